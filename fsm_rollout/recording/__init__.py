"""The I/O tape: every engine and environment exchange of a recorded rollout, kept for offline replay.

With recording on (``RolloutConfig(record=True)`` through :class:`~fsm_rollout.runtime.runner.RolloutRunner`, or
:func:`recorded_rollout`, or ``fsm-rollout run --record``) each rollout's engine transport and environment are
wrapped by a :class:`SampleRecorder`, which is also the rollout's hooks; when the sample reaches a terminal state
its record is handed to a :class:`TapeWriter`, which writes it beside the transition trace (``run.jsonl`` →
``run.tape.jsonl``, see :func:`tape_path_for`) from a background thread. Without recording nothing is wrapped.

* :mod:`~fsm_rollout.recording.format`: the format (value encoding, blobs, token deltas), documented there;
* :mod:`~fsm_rollout.recording.writer`: the writer;
* :mod:`~fsm_rollout.recording.recorder`: the recording transport, environment wrapper and hooks;
* :mod:`~fsm_rollout.recording.reader`: the reader.

Its modules are internal: import from this package.
"""

from fsm_rollout.recording.format import (
    BLOB_MIN_CHARS,
    TAPE_SCHEMA_VERSION,
    RecordingFormatError,
    SchemaVersionError,
    tape_path_for,
)
from fsm_rollout.recording.reader import LineProblem, TapeFile, TapeSample, read_json_lines, read_tape
from fsm_rollout.recording.recorder import RecordingEnv, RecordingTransport, SampleRecorder, recorded_rollout
from fsm_rollout.recording.writer import (
    TapeWriter,
    get_tape_writer,
    hold_tape_writer,
    release_tape_writer,
    tape_writer_for,
)

__all__ = [
    "BLOB_MIN_CHARS",
    "TAPE_SCHEMA_VERSION",
    "LineProblem",
    "RecordingEnv",
    "RecordingFormatError",
    "RecordingTransport",
    "SampleRecorder",
    "SchemaVersionError",
    "TapeFile",
    "TapeSample",
    "TapeWriter",
    "get_tape_writer",
    "hold_tape_writer",
    "read_json_lines",
    "read_tape",
    "recorded_rollout",
    "release_tape_writer",
    "tape_path_for",
    "tape_writer_for",
]
