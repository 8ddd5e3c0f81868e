"""Replaying recorded rollouts: check logged paths against today's table, and re-execute them offline from the tape.

*Check* rebuilds each sample's path from the transition events of a trace, or from the copy its tape record keeps,
and verifies that every transition is an edge of today's table (:mod:`fsm_rollout.machine.lifecycle`), with a reason the
edge can give, and that the path ends in a terminal state.

*Re-execute* runs each sample recorded on the I/O tape (:mod:`fsm_rollout.recording`) through today's
:class:`~fsm_rollout.rollout.Rollout` with an engine transport and an environment that answer from its tape record
alone: no server, no environment code, only the tokenizer. Every request today's code sends and every environment
call it makes is compared with the recorded one before the recorded answer is given; every transition is compared
with the recorded event as it fires; at the end tokens, loss mask, logprobs, status, reason and error are compared.
The first difference stops the sample and is reported with its turn, state or token index, expected and actual
values and the decoded text around it. A call the tape has no answer for is such a difference, never a crash.

The parts:

* :mod:`~fsm_rollout.replay.paths`: reading a trace into paths, and checking a path against the table;
* :mod:`~fsm_rollout.replay.tape`: the cursor over one sample record's exchanges, and recorded values revived;
* :mod:`~fsm_rollout.replay.compare`: pure comparators, one per kind of thing, each returning a
  :class:`Divergence` or None;
* :mod:`~fsm_rollout.replay.reexecute`: the tape-backed transport, environment and hooks, and :func:`reexecute`;
* :mod:`~fsm_rollout.replay.report`: :class:`ReplayReport` and :class:`SampleReport`, and their rendering;
* :mod:`~fsm_rollout.replay.run`: :func:`replay`, which reads the recording, checks, re-executes and reports.

:func:`replay` returns a :class:`ReplayReport`; ``fsm-rollout replay`` prints it and exits 0 (all identical),
1 (a divergence, an illegal, unfinished or damaged path, or unreadable lines) or 2 (unusable input).

Its modules are internal: import from this package.
"""

from fsm_rollout.replay.compare import Divergence, DivergenceKind, Outcome, TextContext
from fsm_rollout.replay.paths import TracedPath, TraceFile, check_path, paths_from_tape, read_trace
from fsm_rollout.replay.reexecute import ReplayDiverged, reexecute
from fsm_rollout.replay.report import (
    EXIT_DIVERGED,
    EXIT_IDENTICAL,
    EXIT_UNUSABLE,
    FAILING_VERDICTS,
    VERDICTS,
    ReplayReport,
    SampleReport,
    Verdict,
)
from fsm_rollout.replay.run import STATUS_FILTERS, load_recorded_tokenizer, load_recording, replay, replay_async
from fsm_rollout.replay.tape import RecordedError, TapeCursor, rebuild_error, revive

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_IDENTICAL",
    "EXIT_UNUSABLE",
    "FAILING_VERDICTS",
    "STATUS_FILTERS",
    "VERDICTS",
    "Divergence",
    "DivergenceKind",
    "Outcome",
    "RecordedError",
    "ReplayDiverged",
    "ReplayReport",
    "SampleReport",
    "TapeCursor",
    "TextContext",
    "TraceFile",
    "TracedPath",
    "Verdict",
    "check_path",
    "load_recorded_tokenizer",
    "load_recording",
    "paths_from_tape",
    "read_trace",
    "rebuild_error",
    "reexecute",
    "replay",
    "replay_async",
    "revive",
]
