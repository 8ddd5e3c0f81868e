"""Replaying recorded rollouts: check logged paths against today's table, and re-execute them offline from the tape.

*Check* rebuilds each sample's path from the transition events of a trace and verifies that every transition is an
edge of today's table (:mod:`fsm_rollout.lifecycle`), with a reason the edge can give, and that the path ends in a
terminal state.

*Re-execute* runs each sample recorded on the I/O tape (:mod:`fsm_rollout.recording`) through today's
:class:`~fsm_rollout.rollout.Rollout` with an engine client and an environment that answer from the tape: no
server, no environment code, only the tokenizer. Every request today's code sends and every environment call it
makes is compared with the recorded one before the recorded answer is given; every transition is compared with the
recorded event as it fires; at the end tokens, loss mask, logprobs, status and reason are compared. The first
difference stops the sample and is reported with its turn, state or token index, expected and actual values and
the decoded text around it. A call the tape has no answer for is such a difference, never a crash.

:func:`replay` returns a :class:`ReplayReport`; ``fsm-rollout replay`` prints it and exits 0 (all identical),
1 (a divergence, an illegal, unfinished or damaged path, or unreadable lines) or 2 (unusable input).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from fsm_rollout import gc_policy, lifecycle
from fsm_rollout.chat import ObservationEncoder
from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.recording.format import (
    ENGINE_OPS,
    RecordingFormatError,
    SchemaVersionError,
    answer_token_ids,
    expand_run_lengths,
    expand_tokens,
    jsonable,
    tape_path_for,
    tokenizer_fingerprint,
)
from fsm_rollout.recording.reader import LineProblem, TapeFile, TapeSample, read_json_lines, read_tape
from fsm_rollout.rollout import Rollout
from fsm_rollout.sample import Sample
from fsm_rollout.trace import NULL_TRACER, TRACE_SCHEMA_VERSION, TRANSITION_EVENT

VERDICTS = ("identical", "legal", "diverged", "illegal", "unfinished", "damaged")
"""Per-sample outcomes, from best to worst. ``legal``: checked only (not re-executed)."""
FAILING_VERDICTS = frozenset({"diverged", "illegal", "unfinished", "damaged"})
STATUS_FILTERS = (*sorted(lifecycle.TERMINAL), "unfinished")

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_UNUSABLE = 0, 1, 2

_CORE_FIELDS = ("trigger", "src", "dst", "turn", "reason", "response_length", "remaining_budget")
_UNCOMPARED_FIELDS = frozenset({"dwell_ms", "ts", "schema", "event", "sample_id", "session_id"})
_CONTEXT_TOKENS = 12
_CONTEXT_CHARS = 60


# ---------------------------------------------------------------------------------------------------- traces


@dataclass
class TracedPath:
    """One sample's transitions as logged, in order, with the line each came from."""

    sample_id: str | None
    session_id: str | None
    events: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    damage: list[LineProblem] = field(default_factory=list)
    """Unreadable lines that belonged to this sample."""

    @property
    def terminal(self) -> bool:
        """Whether the last transition ends in a terminal state."""
        return bool(self.events) and self.events[-1].get("dst") in lifecycle.TERMINAL

    @property
    def status(self) -> str | None:
        """The terminal state reached, or None when the path is unfinished."""
        return str(self.events[-1]["dst"]) if self.terminal else None

    @property
    def reason(self) -> str | None:
        """The terminal reason, or None."""
        value = self.events[-1].get("reason") if self.terminal else None
        return value if isinstance(value, str) else None

    @property
    def turns(self) -> int:
        """Generate turns answered (``step`` transitions)."""
        return sum(1 for event in self.events if event.get("trigger") == "step")

    def triples(self) -> list[tuple[Any, Any, Any]]:
        """The path as ``(src, trigger, dst)`` triples."""
        return [(event.get("src"), event.get("trigger"), event.get("dst")) for event in self.events]


@dataclass
class TraceFile:
    """A transition trace read from disk: one path per sample run, and the lines that could not be used."""

    path: Path
    paths: list[TracedPath] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    transitions: int = 0
    orphans: list[int] = field(default_factory=list)
    """Lines of transitions without a ``sample_id`` (belonging to no path)."""


def read_trace(path: str | Path) -> TraceFile:
    """Read a trace and rebuild each sample's path; unreadable lines are reported, the rest is used.

    Events are grouped by ``(sample_id, session_id)``; a ``pending`` event after a terminal one starts a new path
    (a trace appended to by several runs). Raises :class:`~fsm_rollout.recording.SchemaVersionError` for events of
    another schema version and :class:`~fsm_rollout.recording.RecordingFormatError` when there is no transition event.
    """
    trace = TraceFile(Path(path))
    rows, problems = read_json_lines(trace.path)
    trace.problems.extend(problems)
    open_paths: dict[tuple[str, str | None], TracedPath] = {}
    for number, row in rows:
        if row.get("event") != TRANSITION_EVENT:
            continue
        if row.get("schema") != TRACE_SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{trace.path} line {number}: transition schema {row.get('schema')!r}, but this fsm-rollout reads "
                f"trace schema {TRACE_SCHEMA_VERSION}; check it with the fsm-rollout version that wrote it"
            )
        trace.transitions += 1
        sample_id, session_id = row.get("sample_id"), row.get("session_id")
        if not isinstance(sample_id, str):
            trace.orphans.append(number)
            continue
        key = (sample_id, session_id if isinstance(session_id, str) else None)
        current = open_paths.get(key)
        if current is None or (current.terminal and row.get("src") == lifecycle.INITIAL):
            current = TracedPath(sample_id=key[0], session_id=key[1])
            trace.paths.append(current)
            open_paths[key] = current
        current.events.append(row)
        current.lines.append(number)
    if trace.transitions == 0:
        raise RecordingFormatError(f"{trace.path} holds no transition events: not an fsm-rollout trace")
    _attribute_damage(trace.paths, trace.problems)
    return trace


def _attribute_damage(paths: Sequence[TracedPath], problems: Sequence[LineProblem]) -> None:
    """Give each unreadable line that names a sample to that sample's path that was open at that line."""
    for problem in problems:
        if problem.sample_id is None:
            continue
        owners = [path for path in paths if path.sample_id == problem.sample_id and path.lines
                  and path.lines[0] < problem.line]
        if owners:
            owners[-1].damage.append(problem)


def paths_from_tape(tape: TapeFile) -> list[TracedPath]:
    """Paths rebuilt from the transitions kept on a tape (when the trace itself is not available)."""
    paths = []
    for record in tape.samples:
        path = TracedPath(sample_id=record.sample_id, session_id=record.session_id)
        path.events = list(record.transitions)
        path.lines = [record.line] * len(record.transitions)
        paths.append(path)
    return paths


def _edge_reasons() -> dict[tuple[str, str, str], frozenset[str | None] | None]:
    """For each ``(src, trigger, dst)`` of today's table: the reasons it may carry (None: the caller's reason)."""
    reasons: dict[tuple[str, str, str], set[str | None] | None] = {}
    for edge in lifecycle.TRANSITIONS:
        key = (edge.source, edge.trigger, edge.dest)
        if edge.trigger == "abort":
            reasons[key] = None
            continue
        reason = "error" if edge.trigger == "fail" else edge.reason
        allowed = reasons.setdefault(key, set())
        if allowed is not None:
            allowed.add(reason)
    return {key: None if value is None else frozenset(value) for key, value in reasons.items()}


def check_path(path: TracedPath, problems: Sequence[LineProblem] = ()) -> tuple[str, list[str]]:
    """Check one path against today's table; returns its verdict (legal, illegal, unfinished, damaged) and findings.

    ``problems`` are the file's unreadable lines: a break in the path across one of them makes it damaged rather
    than illegal.
    """
    findings: list[str] = [f"line {problem.line} belonged to this sample and is unreadable" for problem in path.damage]
    edges = _edge_reasons()
    unreadable = sorted(problem.line for problem in problems if problem.sample_id is None)
    state = lifecycle.INITIAL
    previous_line: int | None = None
    damaged = bool(path.damage)
    illegal = False
    for event, line in zip(path.events, path.lines, strict=True):
        src, trigger, dst = event.get("src"), event.get("trigger"), event.get("dst")
        if state in lifecycle.TERMINAL:
            findings.append(f"line {line}: {_arrow(src, trigger, dst)} after the sample ended in {state}")
            illegal = True
        elif src != state:
            gap = [number for number in unreadable if previous_line is not None and previous_line < number < line]
            if gap:
                findings.append(f"line {line}: leaves {src}, but the sample was in {state}; unreadable line {gap[0]} "
                                "lies in between")
                damaged = True
            else:
                where = "starts" if previous_line is None else "leaves"
                findings.append(f"line {line}: {where} in {src}, but the sample was in {state}")
                illegal = True
        key = (str(src), str(trigger), str(dst))
        if key not in edges:
            findings.append(f"line {line}: {_arrow(src, trigger, dst)} is not a transition of today's table")
            illegal = True
        else:
            allowed = edges[key]
            reason = event.get("reason")
            if dst in lifecycle.TERMINAL and allowed is None and not (isinstance(reason, str) and reason):
                findings.append(f"line {line}: {_arrow(src, trigger, dst)} without the caller's abort reason")
                illegal = True
            elif allowed is not None and reason not in allowed:
                expected = " or ".join(repr(item) for item in sorted(allowed, key=str))
                findings.append(f"line {line}: {_arrow(src, trigger, dst)} with reason {reason!r}; today's table "
                                f"gives {expected}")
                illegal = True
        state = str(dst)
        previous_line = line
    if state not in lifecycle.TERMINAL:
        last = path.lines[-1] if path.lines else "?"
        findings.append(f"unfinished: the last transition (line {last}) leaves the sample in {state}")
    if damaged:
        return "damaged", findings
    if illegal:
        return "illegal", findings
    if state not in lifecycle.TERMINAL:
        return "unfinished", findings
    return "legal", findings


def _arrow(src: Any, trigger: Any, dst: Any) -> str:
    return f"{src} --{trigger}--> {dst}"


def _line_list(lines: Sequence[int], limit: int = 5) -> str:
    shown = ", ".join(str(line) for line in lines[:limit])
    return shown + (f" and {len(lines) - limit} more" if len(lines) > limit else "")


# ---------------------------------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class TextContext:
    """Decoded text around a divergence: what came before, then what the recording and today's code have there."""

    before: str
    expected: str
    actual: str


@dataclass(frozen=True)
class Divergence:
    """The first place where today's rollout did something the recording did not."""

    kind: str
    """``transition``, ``request`` (a request or environment call differs), ``unexpected call``, ``missing answer``
    (the tape has no answer), ``tokens``, ``loss_mask``, ``logprobs``, ``status``, ``reason``, ``leftover`` (the
    recording made more calls), ``setup`` (today's code rejects the recorded sample or config) or ``tape`` (the
    record itself is malformed)."""
    message: str
    turn: int | None = None
    state: str | None = None
    index: int | None = None
    """The token index (into ``sample.tokens``), character index or transition number the message refers to."""
    expected: Any = None
    actual: Any = None
    context: TextContext | None = None
    line: int | None = None
    """The trace line of the diverging transition (or of the tape record)."""


@dataclass
class SampleReport:
    """What replay found for one recorded sample run."""

    sample_id: str | None
    session_id: str | None
    status: str | None
    reason: str | None
    verdict: str
    findings: list[str] = field(default_factory=list)
    divergence: Divergence | None = None
    turns: int = 0
    trace_lines: tuple[int, int] | None = None
    tape_line: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failing(self) -> bool:
        """Whether this sample makes the replay exit non-zero."""
        return self.verdict in FAILING_VERDICTS


@dataclass
class ReplayReport:
    """Everything one replay found; :attr:`exit_code` is what ``fsm-rollout replay`` exits with."""

    trace: Path | None
    tape: Path | None
    samples: list[SampleReport] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    executed: bool = False
    turns_executed: int = 0
    seconds: float = 0.0
    """Wall time of the re-execution."""
    cpu_seconds: float = 0.0
    """CPU time of the re-execution (this process)."""

    @property
    def exit_code(self) -> int:
        """0 when every sample is identical (or legal, when only checked) and every input line was readable; else 1."""
        failing = self.problems or any(sample.failing for sample in self.samples)
        return EXIT_DIVERGED if failing else EXIT_IDENTICAL

    @property
    def identical(self) -> bool:
        """Whether nothing failed."""
        return self.exit_code == EXIT_IDENTICAL

    def counts(self) -> dict[str, int]:
        """Samples per verdict, in :data:`VERDICTS` order."""
        found = {verdict: 0 for verdict in VERDICTS}
        for sample in self.samples:
            found[sample.verdict] += 1
        return {verdict: count for verdict, count in found.items() if count}

    def sample(self, sample_id: str) -> SampleReport:
        """The (first) report of a sample id."""
        for sample in self.samples:
            if sample.sample_id == sample_id:
                return sample
        raise KeyError(sample_id)

    @property
    def turns_per_second(self) -> float:
        """Re-executed turns per second of wall time."""
        return self.turns_executed / self.seconds if self.seconds > 0 else 0.0

    @property
    def turns_per_cpu_second(self) -> float:
        """Re-executed turns per CPU second (the speed on one core, whatever else the machine runs)."""
        return self.turns_executed / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-compatible data."""
        data = dataclasses.asdict(self)
        data["trace"] = None if self.trace is None else str(self.trace)
        data["tape"] = None if self.tape is None else str(self.tape)
        data["problems"] = [str(problem) for problem in self.problems]
        data["exit_code"] = self.exit_code
        data["counts"] = self.counts()
        converted: dict[str, Any] = jsonable(data)
        return converted

    def render(self, *, color: bool = False, verbose: bool = False) -> str:
        """The report as text: a summary line, then every sample that is not fine (all with ``verbose``)."""
        paint = _painter(color)
        lines = [self._headline()]
        counts = "  ".join(f"{paint(verdict, _VERDICT_COLOR[verdict])} {count}"
                           for verdict, count in self.counts().items())
        lines.append(counts or "no samples matched")
        for sample in self.samples:
            if verbose or sample.failing or sample.notes:
                lines.extend(_render_sample(sample, paint, verbose=verbose))
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"    {warning}" for warning in self.warnings)
        if self.problems:
            lines.append("unreadable input lines:")
            lines.extend(f"    {problem}" for problem in self.problems)
        return "\n".join(lines)

    def _headline(self) -> str:
        sources = [str(path) for path in (self.trace, self.tape) if path is not None]
        head = f"replay of {' + '.join(sources)}: {len(self.samples)} sample run(s)"
        if self.executed:
            head += (f"; re-executed {self.turns_executed} turns in {self.seconds:.3f}s "
                     f"({self.turns_per_cpu_second:,.0f} turns per CPU second)")
        else:
            head += "; checked against today's table (not re-executed)"
        return head


_VERDICT_COLOR = {
    "identical": "32", "legal": "32", "diverged": "31", "illegal": "31", "unfinished": "33", "damaged": "33",
}


Paint = Callable[[str, str], str]


def _painter(color: bool) -> Paint:
    def paint(text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if color else text

    return paint


def _render_sample(sample: SampleReport, paint: Paint, *, verbose: bool) -> list[str]:
    outcome = f"{sample.status or 'unfinished'}" + (f"/{sample.reason}" if sample.reason else "")
    where = []
    if sample.trace_lines is not None:
        where.append(f"trace lines {sample.trace_lines[0]}-{sample.trace_lines[1]}")
    if sample.tape_line is not None:
        where.append(f"tape line {sample.tape_line}")
    head = (f"sample {sample.sample_id} [{outcome}, {sample.turns} turn(s)] "
            f"{paint(sample.verdict.upper(), _VERDICT_COLOR[sample.verdict])}")
    lines = [head + (f"  ({', '.join(where)})" if where else "")]
    divergence = sample.divergence
    if divergence is not None:
        at = []
        if divergence.turn is not None:
            at.append(f"turn {divergence.turn}")
        if divergence.state is not None:
            at.append(f"state {divergence.state}")
        if divergence.line is not None:
            at.append(f"line {divergence.line}")
        lines.append(f"    {divergence.kind}" + (f" at {', '.join(at)}" if at else "") + f": {divergence.message}")
        if divergence.expected is not None or divergence.actual is not None:
            lines.append(f"      expected: {_short(divergence.expected)}")
            lines.append(f"      actual:   {_short(divergence.actual)}")
        if divergence.context is not None:
            context = divergence.context
            lines.append(f"      text before: {'…' + repr(context.before)}")
            lines.append(f"      recorded:    {repr(context.expected) + '…'}")
            lines.append(f"      today:       {repr(context.actual) + '…'}")
    if sample.verdict != "legal" or verbose:
        lines.extend(f"    {finding}" for finding in sample.findings)
    lines.extend(f"    note: {note}" for note in sample.notes)
    return lines


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=repr).decode()
    return text if len(text) <= limit else text[:limit] + "…"


# ---------------------------------------------------------------------------------------------------- playback


class ReplayDiverged(Exception):
    """Today's rollout did something the recording did not; its replay stops (see :class:`Divergence`)."""


class RecordedError(Exception):
    """An error the recording saw, raised again under its original class name (``type(error).__name__``)."""


class _Opaque:
    """Stands in for a recorded value that was not JSON: same class name, same repr."""

    def __init__(self, text: str) -> None:
        self._repr = text

    def __repr__(self) -> str:
        return self._repr


_ERROR_CLASSES: dict[tuple[str, str], type[RecordedError]] = {}
_OPAQUE_CLASSES: dict[str, type[_Opaque]] = {}
_ENV_CLASSES: dict[str, type[_TapeEnv]] = {}


def rebuild_error(described: Mapping[str, Any]) -> RecordedError:
    """The exception a tape's ``error`` entry describes, with the recorded class name and message."""
    name = str(described.get("type") or "Exception")
    module = str(described.get("module") or __name__)
    cls = _ERROR_CLASSES.get((module, name))
    if cls is None:
        cls = type(name, (RecordedError,), {"__module__": module})
        _ERROR_CLASSES[(module, name)] = cls
    return cls(str(described.get("message", "")))


def revive(value: Any) -> Any:
    """Recorded environment data with ``{"$object": ...}`` stand-ins turned back into same-named, same-repr objects."""
    if isinstance(value, dict):
        described = value.get("$object")
        if len(value) == 1 and isinstance(described, dict):
            name = str(described.get("type") or "object")
            cls = _OPAQUE_CLASSES.get(name)
            if cls is None:
                cls = type(name, (_Opaque,), {})
                _OPAQUE_CLASSES[name] = cls
            return cls(str(described.get("repr", "")))
        return {key: revive(item) for key, item in value.items()}
    if isinstance(value, list):
        return [revive(item) for item in value]
    return value


class _Player:
    """Answers one sample's engine requests and environment calls from its tape record, comparing as it goes.

    The tape's ``io`` entries are consumed in order; each call today's rollout makes must be the next entry's, with
    the same request. Recorded caller aborts (``abort_requested``) are re-issued where they landed: before the start,
    inside an environment call, during a request (which is then cut off) or just after its answer. The first
    difference is kept as :attr:`divergence`; every later call raises :class:`ReplayDiverged` so the rollout ends.
    """

    def __init__(self, record: TapeSample, tape: TapeFile, tokenizer: Any, trace_lines: Sequence[int] | None) -> None:
        self.record = record
        self.tape = tape
        self.tokenizer = tokenizer
        self.trace_lines = trace_lines
        self.io = record.io
        self.pos = 0
        self.expected_transitions = record.transitions
        self.actual_transitions: list[dict[str, Any]] = []
        self.divergence: Divergence | None = None
        self.base_tokens: list[int] = []
        self.env_passthrough = False
        self.rollout: Rollout | None = None

    # ------------------------------------------------------------------ divergence

    def _diverge(self, kind: str, message: str, **details: Any) -> ReplayDiverged:
        if self.divergence is None:
            rollout = self.rollout
            details.setdefault("turn", rollout.turn_index if rollout is not None else None)
            details.setdefault("state", rollout.state if rollout is not None else None)
            self.divergence = Divergence(kind=kind, message=message, **details)
        return ReplayDiverged(message)

    def _stop_if_diverged(self) -> None:
        if self.divergence is not None:
            raise ReplayDiverged(self.divergence.message)

    # ------------------------------------------------------------------ the tape

    def _peek(self) -> dict[str, Any] | None:
        return self.io[self.pos] if self.pos < len(self.io) else None

    def _take(self, op: str, call: str) -> dict[str, Any]:
        entry = self._peek()
        if entry is None:
            raise self._diverge("missing answer", f"today's rollout calls {call}, but the recording has no more calls "
                                "(the tape has no answer for it)")
        if entry["op"] != op:
            raise self._diverge("unexpected call", f"today's rollout calls {call}, but the recording's next call is "
                                f"{_describe_entry(entry)}")
        self.pos += 1
        return entry

    def _field(self, entry: Mapping[str, Any], key: str) -> Any:
        """An entry's field with its blob references resolved (entries without any are used as they are)."""
        value = entry.get(key)
        if not entry.get("refs"):
            return value
        try:
            return self.tape.resolve(value)
        except KeyError as error:
            raise self._diverge("tape", f"the tape lacks blob {error.args[0]} (tape line {self.record.line})") from None

    def abort_before_start(self) -> str | None:
        """The reason of an abort the recording got before the sample started, if any."""
        entry = self._peek()
        if entry is not None and entry["op"] == "abort_requested" and not entry.get("running", True):
            self.pos += 1
            return str(entry.get("reason"))
        return None

    def _abort_landing_here(self, *, in_flight: bool) -> str | None:
        """The reason of a recorded abort request that arrived at this point, consuming it."""
        entry = self._peek()
        rollout = self.rollout
        if entry is None or entry["op"] != "abort_requested" or rollout is None or entry.get("state") != rollout.state:
            return None
        if bool(entry.get("in_flight")) != in_flight:
            return None
        self.pos += 1
        return str(entry.get("reason"))

    async def _cancel_in_flight(self, reason: str) -> None:
        assert self.rollout is not None
        self.rollout.request_abort(reason)
        await asyncio.sleep(0)  # the rollout cancels this request: CancelledError lands here
        raise self._diverge("transition", f"the recording's abort ({reason}) cut this request off, but today's "
                            "rollout did not cancel it")

    # ------------------------------------------------------------------ engine

    async def engine_call(self, path: str, payload: Mapping[str, Any], headers: Mapping[str, str] | None) -> Any:
        self._stop_if_diverged()
        op = ENGINE_OPS.get(path, "post")
        call = f"POST {path}" if op == "post" else f"the {op} endpoint"
        reason = self._abort_landing_here(in_flight=True)
        if reason is not None:  # the recording's abort came before this request even started
            await self._cancel_in_flight(reason)
        entry = self._take(op, call)
        self._compare_engine_request(op, entry, payload, headers)
        if entry.get("cancelled"):
            if op == "abort":
                raise TimeoutError  # the abort notice ran out of time in the recording
            await self._cancel_in_flight(self._abort_landing_here(in_flight=True) or "cancelled")
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        if "text" in entry:
            return self._field(entry, "text")
        if "answer" not in entry:
            raise self._diverge("tape", f"the recorded {op} call has no outcome (tape line {self.record.line})")
        answer = self._field(entry, "answer")
        if op == "render":
            token_ids = answer_token_ids(entry["answer"])
            if token_ids is not None:
                self.base_tokens = list(token_ids)
        late = self._abort_landing_here(in_flight=True)
        if late is not None and self.rollout is not None:  # arrived after the answer, before the rollout resumed
            asyncio.get_running_loop().call_soon(self.rollout.request_abort, late)
        return answer

    def _compare_engine_request(
        self, op: str, entry: dict[str, Any], payload: Mapping[str, Any], headers: Mapping[str, str] | None
    ) -> None:
        what = f"the {op} request" if op != "post" else f"POST {entry.get('path')}"
        rest: Mapping[str, Any] = payload
        if op == "generate" and isinstance(entry.get("tokens"), dict):
            try:
                expected_tokens = expand_tokens(entry["tokens"], self.base_tokens)
            except RecordingFormatError as error:
                raise self._diverge("tape", f"{what}: {error}") from None
            self.base_tokens = expected_tokens
            actual_tokens = payload.get("token_ids")
            if actual_tokens != expected_tokens:
                actual_list = list(actual_tokens) if isinstance(actual_tokens, list | tuple) else []
                index = _first_index(expected_tokens, actual_list)
                raise self._diverge(
                    "request",
                    f"{what} sends different token_ids: token_ids[{index}] "
                    f"{_token_at(self.tokenizer, expected_tokens, index)} in the recording, "
                    f"{_token_at(self.tokenizer, actual_list, index)} today "
                    f"({len(expected_tokens)} vs {len(actual_list)} ids)",
                    index=index,
                    context=_token_context(self.tokenizer, expected_tokens, actual_list, index),
                    line=self.record.line,
                )
            rest = {key: value for key, value in payload.items() if key != "token_ids"}
        expected = self._field(entry, "request")
        if expected != rest:
            difference = _first_difference(expected, jsonable(rest))
            if difference is not None:
                where, recorded, today = difference
                raise self._diverge("request", f"{what} differs at {where or 'the top level'}",
                                    expected=recorded, actual=today, line=self.record.line)
        recorded_headers = entry.get("headers") or None
        sent_headers = dict(headers) if headers else None
        if recorded_headers != sent_headers:
            raise self._diverge("request", f"{what} sends different headers", expected=recorded_headers,
                                actual=sent_headers, line=self.record.line)

    # ------------------------------------------------------------------ environment

    def build_env(self, **_: Any) -> Any:
        self._stop_if_diverged()
        entry = self._take("env_build", "build_env()")
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        name = str(entry.get("type") or "Environment")
        missing = entry.get("missing")
        if isinstance(missing, list) and missing:  # the rollout rejects it, as it did the recorded one
            self.env_passthrough = True
            env = _env_class(name)(self)
            for method in missing:
                setattr(env, str(method), None)
            return env
        return _env_class(name)(self)

    def env_call(self, op: str, *, text: str | None = None) -> dict[str, Any] | None:
        if self.divergence is not None:
            if op == "close":
                return None
            raise ReplayDiverged(self.divergence.message)
        if self.env_passthrough:
            return None
        entry = self._take(op, f"env.{op}()")
        if op == "step":
            recorded = self._field(entry, "text")
            if recorded != text:
                recorded_text, today_text = str(recorded), str(text)
                index = _first_index(recorded_text, today_text)
                raise self._diverge(
                    "request",
                    f"env.step gets different text (first difference at character {index})",
                    index=index,
                    context=TextContext(recorded_text[max(0, index - _CONTEXT_CHARS):index],
                                        recorded_text[index:index + _CONTEXT_CHARS],
                                        today_text[index:index + _CONTEXT_CHARS]),
                    line=self.record.line,
                )
        reason = self._abort_landing_here(in_flight=False)
        if reason is not None and self.rollout is not None:  # the environment itself asked for the abort
            self.rollout.request_abort(reason)
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        return entry

    def step_result(self, entry: dict[str, Any] | None) -> Any:
        result = self._field(entry, "result") if entry is not None else None
        if not isinstance(result, dict):
            return (None, False, {})
        if isinstance(result.get("tuple_len"), int):
            return tuple([None] * result["tuple_len"])
        if isinstance(result.get("type"), str):
            return revive({"$object": {"type": result["type"], "repr": ""}})
        return (revive(result.get("observation")), bool(result.get("done")), {})

    def observation_message(self, entry: dict[str, Any] | None) -> Any:
        if entry is None:
            return None
        return revive(self._field(entry, "message"))

    # ------------------------------------------------------------------ transitions

    def on_transition(self, fields: dict[str, Any]) -> None:
        index = len(self.actual_transitions)
        self.actual_transitions.append(fields)
        if self.divergence is not None:
            return
        line = self._line_of(index)
        today = _arrow(fields.get("src"), fields.get("trigger"), fields.get("dst"))
        if index >= len(self.expected_transitions):
            self._diverge("transition", f"today's rollout fires {today} after the recording's last transition",
                          turn=fields.get("turn"), state=fields.get("src"), index=index, actual=_event_view(fields))
            return
        expected = self.expected_transitions[index]
        differing = [name for name in _CORE_FIELDS if expected.get(name) != fields.get(name)]
        differing += [name for name in expected if name in fields and name not in _CORE_FIELDS
                      and name not in _UNCOMPARED_FIELDS and expected[name] != fields[name]]
        if not differing:
            return
        recorded = _arrow(expected.get("src"), expected.get("trigger"), expected.get("dst"))
        detail = ", ".join(f"{name} {expected.get(name)!r} → {fields.get(name)!r}" for name in differing)
        message = (f"transition {index + 1}: recorded {recorded}, today {today}" if recorded != today
                   else f"transition {index + 1} ({today})") + f"; differs in {detail}"
        self._diverge("transition", message, turn=expected.get("turn"), state=expected.get("src"), index=index,
                      expected=_event_view(expected), actual=_event_view(fields), line=line,
                      context=self._token_context_now())

    def _line_of(self, index: int) -> int | None:
        if self.trace_lines is not None and index < len(self.trace_lines):
            return self.trace_lines[index]
        return None

    def _token_context_now(self) -> TextContext | None:
        """Where today's tokens so far part from the recording's, if they do."""
        rollout = self.rollout
        recorded = self._recorded_tokens()
        if rollout is None or recorded is None:
            return None
        today = list(rollout.sample.tokens)
        index = _first_index(recorded, today)
        if index >= min(len(recorded), len(today)):
            return None
        return _token_context(self.tokenizer, recorded, today, index)

    def _recorded_tokens(self) -> list[int] | None:
        """The sample's final tokens as recorded (token lists are deltas along the io entries)."""
        base: list[int] = []
        try:
            for entry in self.io:
                if entry["op"] == "generate" and isinstance(entry.get("tokens"), dict):
                    base = expand_tokens(entry["tokens"], base)
                elif entry["op"] == "render":
                    token_ids = answer_token_ids(entry.get("answer"))
                    if token_ids is not None:
                        base = list(token_ids)
            tokens = self.record.result.get("tokens")
            return expand_tokens(tokens, base) if isinstance(tokens, dict) else None
        except RecordingFormatError:
            return None

    # ------------------------------------------------------------------ the end

    def finish(self, rollout: Rollout) -> None:
        """Compare what the rollout produced with the recorded result (after it ended without a divergence)."""
        if self.divergence is not None:
            return
        result = self.record.result
        sample = rollout.sample
        recorded_tokens = self._recorded_tokens()
        if recorded_tokens is None:
            self._diverge("tape", f"the recorded result has no readable tokens (tape line {self.record.line})")
            return
        today_tokens = list(sample.tokens)
        recorded_prompt = result.get("prompt_length")
        prompt_length = recorded_prompt if isinstance(recorded_prompt, int) else 0
        if today_tokens != recorded_tokens:
            index = _first_index(recorded_tokens, today_tokens)
            self._diverge(
                "tokens",
                f"tokens[{index}]: {_token_at(self.tokenizer, recorded_tokens, index)} recorded, "
                f"{_token_at(self.tokenizer, today_tokens, index)} today "
                f"({len(recorded_tokens)} vs {len(today_tokens)} tokens)",
                turn=self._turn_of(index - prompt_length), state=None, index=index,
                context=_token_context(self.tokenizer, recorded_tokens, today_tokens, index),
            )
            return
        recorded_mask = expand_run_lengths(result.get("loss_mask"))
        if recorded_mask != sample.loss_mask:
            today_mask = list(sample.loss_mask or [])
            index = _first_index(recorded_mask or [], today_mask)
            self._diverge(
                "loss_mask",
                f"loss_mask[{index}] (tokens[{prompt_length + index}]): "
                f"{_at(recorded_mask or [], index)} recorded, {_at(today_mask, index)} today",
                turn=self._turn_of(index), state=None, index=prompt_length + index,
                context=_token_context(self.tokenizer, recorded_tokens, today_tokens, prompt_length + index),
            )
            return
        recorded_logprobs = result.get("rollout_log_probs")
        if recorded_logprobs != sample.rollout_log_probs:
            today_logprobs = list(sample.rollout_log_probs or [])
            index = _first_index(recorded_logprobs or [], today_logprobs)
            self._diverge(
                "logprobs",
                f"rollout_log_probs[{index}] (tokens[{prompt_length + index}]): "
                f"{_at(recorded_logprobs or [], index)} recorded, {_at(today_logprobs, index)} today",
                turn=self._turn_of(index), state=None, index=prompt_length + index,
                expected=_at(recorded_logprobs or [], index), actual=_at(today_logprobs, index),
            )
            return
        status = str(getattr(sample.status, "value", sample.status))
        if result.get("status") != status:
            self._diverge("status", "the sample ends with another status", state=None,
                          expected=result.get("status"), actual=status)
            return
        if result.get("reason") != rollout.reason:
            self._diverge("reason", "the sample ends for another reason", state=None,
                          expected=result.get("reason"), actual=rollout.reason)
            return
        if len(self.actual_transitions) < len(self.expected_transitions):
            missing = self.expected_transitions[len(self.actual_transitions)]
            self._diverge("transition", "today's rollout ended before the recording's "
                          f"{_arrow(missing.get('src'), missing.get('trigger'), missing.get('dst'))}",
                          index=len(self.actual_transitions), expected=_event_view(missing))
            return
        leftover = self._peek()
        if leftover is not None:
            self._diverge("leftover", "today's rollout ended without the recording's next call: "
                          f"{_describe_entry(leftover)}", state=None)

    def _turn_of(self, response_index: int) -> int | None:
        for event in self.expected_transitions:
            length = event.get("response_length")
            if isinstance(length, int) and length > response_index:
                turn = event.get("turn")
                return turn if isinstance(turn, int) else None
        last = self.expected_transitions[-1].get("turn") if self.expected_transitions else None
        return last if isinstance(last, int) else None


class _TapeTransport:
    """A transport whose every POST is answered by the tape (the parsing is today's :class:`VLLMClient`'s)."""

    base_url = "http://replay.invalid"

    def __init__(self, player: _Player) -> None:
        self._player = player

    async def close(self) -> None:
        """Nothing to release."""

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        return await self._player.engine_call(path, payload, headers)


class _TapeEnv:
    """An environment whose calls are answered by the tape (its class is renamed after the recorded one)."""

    def __init__(self, player: _Player) -> None:
        self._player = player

    def reset(self) -> None:
        self._player.env_call("reset")

    def step(self, response_text: str) -> Any:
        return self._player.step_result(self._player.env_call("step", text=response_text))

    def format_observation(self, observation: Any) -> Any:
        return self._player.observation_message(self._player.env_call("format_observation"))

    def close(self) -> None:
        self._player.env_call("close")


def _env_class(name: str) -> type[_TapeEnv]:
    cls = _ENV_CLASSES.get(name)
    if cls is None:
        cls = type(name, (_TapeEnv,), {})
        _ENV_CLASSES[name] = cls
    return cls


class _ComparingHooks(RolloutHooks):
    """Hands every transition of a replayed rollout to its player for comparison."""

    wants_events = True

    def __init__(self, player: _Player) -> None:
        self._player = player

    def transition(
        self, rollout: Rollout, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        assert fields is not None
        self._player.on_transition(dict(fields))


# ---------------------------------------------------------------------------------------------------- helpers


def _describe_entry(entry: Mapping[str, Any]) -> str:
    op = entry.get("op")
    if op == "abort_requested":
        return f"an abort ({entry.get('reason')}) requested in state {entry.get('state')}"
    if op in ("render", "generate", "abort"):
        return f"the {op} endpoint"
    if op == "post":
        return f"POST {entry.get('path')}"
    if op == "env_build":
        return "build_env()"
    return f"env.{op}()"


def _event_view(event: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in event.items() if key not in _UNCOMPARED_FIELDS}


def _first_index(expected: Sequence[Any], actual: Sequence[Any]) -> int:
    limit = min(len(expected), len(actual))
    for index in range(limit):
        if expected[index] != actual[index]:
            return index
    return limit


def _at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else "(none)"


def _decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    try:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))
    except Exception:  # an id the tokenizer does not know (a tampered tape): show the ids
        return " ".join(f"<{token}>" for token in token_ids)


def _token_at(tokenizer: Any, token_ids: Sequence[int], index: int) -> str:
    if index >= len(token_ids):
        return "(end)"
    return f"{token_ids[index]} {_decode(tokenizer, token_ids[index:index + 1])!r}"


def _token_context(tokenizer: Any, expected: Sequence[int], actual: Sequence[int], index: int) -> TextContext:
    return TextContext(
        before=_decode(tokenizer, expected[max(0, index - _CONTEXT_TOKENS):index]),
        expected=_decode(tokenizer, expected[index:index + _CONTEXT_TOKENS]),
        actual=_decode(tokenizer, actual[index:index + _CONTEXT_TOKENS]),
    )


_ABSENT = "(absent)"


def _first_difference(expected: Any, actual: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first place (a dotted path) where two JSON values differ, with both values there."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in list(expected) + [key for key in actual if key not in expected]:
            inner = f"{where}.{key}" if where else str(key)
            if key not in actual:
                return inner, expected[key], _ABSENT
            if key not in expected:
                return inner, _ABSENT, actual[key]
            found = _first_difference(expected[key], actual[key], inner)
            if found is not None:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for index, (left, right) in enumerate(zip(expected, actual, strict=False)):
            found = _first_difference(left, right, f"{where}[{index}]")
            if found is not None:
                return found
        if len(expected) != len(actual):
            return f"{where} (length)", len(expected), len(actual)
        return None
    return None if expected == actual else (where, expected, actual)


_RENAMED_CONFIG_FIELDS = {"defer_full_gc": "tune_gc"}  # tapes recorded before a rename replay as they were


def _config_from(recorded: Mapping[str, Any]) -> tuple[RolloutConfig, list[str]]:
    known = {item.name for item in dataclasses.fields(RolloutConfig)}
    recorded = {_RENAMED_CONFIG_FIELDS.get(key, key): value for key, value in recorded.items()}
    values = {key: value for key, value in recorded.items() if key in known and key not in ("trace", "record")}
    dropped = sorted(set(recorded) - known)
    return RolloutConfig(**values), dropped


def _processor_for(merge_size: int | None) -> Any:
    if merge_size is None:
        return None
    return SimpleNamespace(image_processor=SimpleNamespace(merge_size=merge_size))


# ---------------------------------------------------------------------------------------------------- replay


async def reexecute(
    record: TapeSample,
    tape: TapeFile,
    *,
    tokenizer: Any,
    encoder: ObservationEncoder | None = None,
    trace_lines: Sequence[int] | None = None,
) -> tuple[Divergence | None, int, list[str]]:
    """Re-run one recorded sample through today's rollout; returns (first divergence or None, turns run, notes)."""
    notes: list[str] = []
    player = _Player(record, tape, tokenizer, trace_lines)
    missing = tape.missing_blobs([record.sample, *(entry for entry in record.io if entry.get("refs"))])
    if missing:
        return Divergence("tape", f"the tape lacks {len(missing)} blob(s) this sample needs, e.g. {missing[0]}",
                          line=record.line), 0, notes
    try:
        config, dropped = _config_from(record.config)
        if dropped:
            notes.append(f"config fields unknown today were ignored: {', '.join(dropped)}")
        sample = Sample.from_dict(revive(tape.resolve(record.sample)))
        rollout = Rollout(
            sample,
            config=config,
            sampling_params=record.sampling_params,
            client=VLLMClient(transport=_TapeTransport(player)),
            tokenizer=tokenizer,
            env_factory=player.build_env,
            processor=_processor_for(record.processor_merge_size),
            tracer=NULL_TRACER,
            encoder=encoder,
            hooks=_ComparingHooks(player),
            sample_id=record.sample_id,
            request_prefix=record.request_prefix,  # request ids are part of what is compared
        )
    except Exception as error:
        return Divergence("setup", f"today's code rejects the recorded sample or config: "
                          f"{type(error).__name__}: {error}", line=record.line), 0, notes
    player.rollout = rollout
    early_abort = player.abort_before_start()
    if early_abort is not None:
        rollout.request_abort(early_abort)
    with contextlib.suppress(Exception):  # the recorded sample may have failed too: the outcome is compared below
        await rollout.run()
    player.finish(rollout)
    turns = sum(1 for event in player.actual_transitions if event.get("trigger") == "step")
    return player.divergence, turns, notes


def load_recorded_tokenizer(records: Sequence[TapeSample], explicit: str | Path | None = None) -> Any:
    """Load ``explicit``, else the tokenizer the recording used: its ``name_or_path``, ``tokenizer_path``, ``model``.

    Raises :class:`~fsm_rollout.recording.RecordingFormatError` naming every candidate that failed.
    """
    return _load_tokenizer([str(explicit)] if explicit is not None else _tokenizer_candidates(records))


def _load_tokenizer(candidates: Sequence[str]) -> Any:
    from fsm_rollout.runner import load_tokenizer

    failures = []
    for candidate in candidates:
        try:
            return load_tokenizer(candidate)
        except Exception as error:
            failures.append(f"{candidate}: {type(error).__name__}: {str(error)[:200]}")
    raise RecordingFormatError(
        "cannot load the tokenizer the recording used (" + "; ".join(failures or ["the tape names none"])
        + "); pass --tokenizer PATH"
    )


def _tokenizer_candidates(records: Sequence[TapeSample]) -> list[str]:
    candidates: list[str] = []
    for record in records[:1]:
        for value in (record.tokenizer.get("name_or_path"), record.config.get("tokenizer_path"),
                      record.config.get("model")):
            if isinstance(value, str) and value and value not in candidates:
                candidates.append(value)
    return candidates


def _is_tape(path: Path) -> bool:
    try:
        with path.open("rb") as stream:
            first = stream.readline(1 << 20)
    except OSError as error:
        raise RecordingFormatError(f"cannot read {path}: {error.strerror or error}") from error
    try:
        row = orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return isinstance(row, dict) and row.get("kind") in ("header", "sample", "blob")


def _join(
    paths: Sequence[TracedPath], records: Sequence[TapeSample]
) -> tuple[list[tuple[TracedPath | None, TapeSample | None]], list[str]]:
    """Pair trace paths with tape records of the same sample, in order; keep the unpaired ones alone."""
    warnings: list[str] = []
    by_key: dict[tuple[str | None, str | None], list[TapeSample]] = {}
    for record in records:
        by_key.setdefault((record.sample_id, record.session_id), []).append(record)
    pairs: list[tuple[TracedPath | None, TapeSample | None]] = []
    used: set[int] = set()
    for path in paths:
        candidates = [record for record in by_key.get((path.sample_id, path.session_id), []) if id(record) not in used]
        triples = path.triples()
        match = None
        if path.damage:  # lines are missing: the next record of the sample is its complete copy
            match = candidates[0] if candidates else None
        elif path.terminal:
            match = next((record for record in candidates if _record_triples(record) == triples), None)
        else:  # the trace stops early (a crash while writing it): the tape may hold the whole path
            match = next((record for record in candidates if _record_triples(record)[: len(triples)] == triples),
                         None)
        if match is None and path.terminal and not path.damage:
            for record in candidates:
                warnings.append(
                    f"sample {path.sample_id}: the trace (lines {path.lines[0]}-{path.lines[-1]}) and the tape "
                    f"(line {record.line}) record different paths; the tape's is re-executed separately")
                break
        if match is not None:
            used.add(id(match))
        pairs.append((path, match))
    for record in records:
        if id(record) not in used:
            pairs.append((None, record))
    return pairs, warnings


def _record_triples(record: TapeSample) -> list[tuple[Any, Any, Any]]:
    return [(event.get("src"), event.get("trigger"), event.get("dst")) for event in record.transitions]


def _wanted(sample_id: str | None, status: str | None, sample_ids: set[str] | None, statuses: set[str] | None) -> bool:
    if sample_ids is not None and sample_id not in sample_ids:
        return False
    return statuses is None or (status or "unfinished") in statuses


async def replay_async(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    tokenizer: Any = None,
    sample_ids: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    execute: bool = True,
    tune_gc: bool = False,
) -> ReplayReport:
    """:func:`replay` inside a running event loop."""
    wanted_ids = None if sample_ids is None else {str(item) for item in sample_ids}
    wanted_statuses = None if statuses is None else set(statuses)
    unknown = sorted((wanted_statuses or set()) - set(STATUS_FILTERS))
    if unknown:
        raise ValueError(f"unknown status filter(s) {unknown}; expected some of {list(STATUS_FILTERS)}")
    trace_path, trace_file, tape_file = await asyncio.to_thread(load_recording, trace, tape, tape_wanted=execute)
    report = ReplayReport(trace=trace_file.path if trace_file else None, tape=tape_file.path if tape_file else None)
    if trace_file is not None:
        report.problems.extend(trace_file.problems)
        if trace_file.orphans:
            report.warnings.append(
                f"{len(trace_file.orphans)} transition(s) without sample_id (lines {_line_list(trace_file.orphans)}; "
                "a sample aborted before it started is traced outside its task): only their tape copy is replayed")
    if tape_file is not None:
        report.problems.extend(tape_file.problems)
    if execute and tape_file is None:
        report.warnings.append(f"no tape at {tape_path_for(trace_path)} (record with --record): paths are only "
                               "checked against today's table, not re-executed")

    paths = trace_file.paths if trace_file is not None else paths_from_tape(tape_file) if tape_file else []
    records = tape_file.samples if tape_file is not None and execute else []
    if trace_file is None:
        pairs: list[tuple[TracedPath | None, TapeSample | None]] = list(zip(paths, records, strict=True)) \
            if execute else [(path, None) for path in paths]
    else:
        pairs, join_warnings = _join(paths, records)
        report.warnings.extend(join_warnings)
    problems = trace_file.problems if trace_file is not None else []

    selected = []
    for path, record in pairs:
        sample_id = path.sample_id if path is not None else record.sample_id if record is not None else None
        status = (path.status if path is not None else None) or (record.status if record is not None else None)
        if _wanted(sample_id, status, wanted_ids, wanted_statuses):
            selected.append((path, record))

    to_run: list[tuple[SampleReport, TapeSample, TracedPath | None]] = []
    for path, record in selected:
        sample_report = _check_report(path, record, problems, trace_file is not None)
        report.samples.append(sample_report)
        if record is not None and sample_report.verdict == "legal":
            to_run.append((sample_report, record, path))
        elif path is not None and record is None and tape_file is not None and path.terminal:
            sample_report.notes.append("not on the tape: checked, not re-executed")
    if to_run and execute:
        if tokenizer is None or isinstance(tokenizer, str | Path):
            tokenizer = await asyncio.to_thread(load_recorded_tokenizer, [r for _, r, _ in to_run], tokenizer)
        _warn_tokenizer(report, tokenizer, [record for _, record, _ in to_run])
        assert tape_file is not None
        report.executed = True
        started, started_cpu = time.perf_counter(), time.process_time()
        # One span of collector tuning, when asked for: no full passes between samples.
        with gc_policy.rollouts_in_flight() if tune_gc else contextlib.nullcontext():
            await _run_all(report, to_run, tape_file, tokenizer, from_trace=trace_file is not None)
        report.seconds = time.perf_counter() - started
        report.cpu_seconds = time.process_time() - started_cpu
    return report


async def _run_all(
    report: ReplayReport,
    to_run: Sequence[tuple[SampleReport, TapeSample, TracedPath | None]],
    tape_file: TapeFile,
    tokenizer: Any,
    *,
    from_trace: bool,
) -> None:
    for sample_report, record, path in to_run:
        lines = path.lines if path is not None and from_trace else None
        divergence, turns, notes = await reexecute(record, tape_file, tokenizer=tokenizer, trace_lines=lines)
        sample_report.turns = turns
        sample_report.notes.extend(notes)
        report.turns_executed += turns
        sample_report.divergence = divergence
        sample_report.verdict = "identical" if divergence is None else "diverged"
        if divergence is not None and divergence.kind == "tape":
            sample_report.verdict = "damaged"


def load_recording(
    trace: str | Path, tape: str | Path | None = None, *, tape_wanted: bool = True
) -> tuple[Path, TraceFile | None, TapeFile | None]:
    """Read a trace and its tape (beside it unless ``tape`` is given); ``trace`` may also be a tape alone.

    Returns the given path, the trace (None when a tape was given) and the tape (None when there is none or it is
    not wanted).
    """
    trace_path = Path(trace).expanduser()
    if _is_tape(trace_path):
        return trace_path, None, read_tape(trace_path)
    trace_file = read_trace(trace_path)
    tape_path = Path(tape).expanduser() if tape is not None else tape_path_for(trace_path)
    if tape_wanted and (tape is not None or tape_path.exists()):
        return trace_path, trace_file, read_tape(tape_path)
    return trace_path, trace_file, None


def _check_report(
    path: TracedPath | None, record: TapeSample | None, problems: Sequence[LineProblem], from_trace: bool
) -> SampleReport:
    if path is None:
        assert record is not None
        probe = TracedPath(sample_id=record.sample_id, session_id=record.session_id,
                           events=list(record.transitions), lines=[record.line] * len(record.transitions))
        verdict, findings = check_path(probe)
        sample_report = SampleReport(record.sample_id, record.session_id, record.status, record.reason, verdict,
                                     findings=findings, turns=probe.turns, tape_line=record.line)
        if from_trace:
            sample_report.notes.append("not found in the trace; the tape's own copy of the path was checked")
        return sample_report
    verdict, findings = check_path(path, problems)
    sample_report = SampleReport(path.sample_id, path.session_id, path.status, path.reason, verdict,
                                 findings=findings, turns=path.turns)
    if from_trace and path.lines:
        sample_report.trace_lines = (path.lines[0], path.lines[-1])
    if record is not None:
        sample_report.tape_line = record.line
        if verdict in ("unfinished", "damaged"):  # the trace is incomplete here; the tape has the whole path
            copy = TracedPath(sample_id=record.sample_id, session_id=record.session_id,
                              events=list(record.transitions), lines=[record.line] * len(record.transitions))
            sample_report.verdict, sample_report.findings = check_path(copy)
            sample_report.status, sample_report.reason, sample_report.turns = copy.status, copy.reason, copy.turns
            sample_report.notes.extend(f"trace: {finding}" for finding in findings)
            sample_report.notes.append(f"the trace is {verdict} here; the tape's copy of the path was used")
    return sample_report


def _warn_tokenizer(report: ReplayReport, tokenizer: Any, records: Sequence[TapeSample]) -> None:
    today = tokenizer_fingerprint(tokenizer)
    seen: set[str] = set()
    for record in records:
        for key in ("vocab_size", "eos_token_id", "chat_template_sha256"):
            recorded = record.tokenizer.get(key)
            if recorded is not None and today.get(key) is not None and recorded != today[key] and key not in seen:
                seen.add(key)
                report.warnings.append(f"the tokenizer differs from the recording's: {key} {recorded!r} recorded, "
                                       f"{today[key]!r} now")


def replay(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    tokenizer: Any = None,
    sample_ids: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    execute: bool = True,
    tune_gc: bool = False,
) -> ReplayReport:
    """Check a recorded run against today's machine and re-execute it offline; returns a :class:`ReplayReport`.

    ``trace`` is a transition trace (its tape is looked for beside it: ``run.jsonl`` → ``run.tape.jsonl``, or
    give ``tape``), or a tape alone (its own copy of the transitions is checked). ``tokenizer`` is a tokenizer
    object or a path/name to load; by default the recorded ``name_or_path`` (then ``tokenizer_path``, then
    ``model``) is loaded. ``sample_ids`` and ``statuses`` (terminal states, or ``"unfinished"``) select samples;
    ``execute=False`` only checks; ``tune_gc`` tunes the process's collector while re-executing, as
    ``RolloutConfig.tune_gc`` does for rollouts. Raises :class:`~fsm_rollout.recording.RecordingFormatError` (a
    :class:`~fsm_rollout.errors.RolloutError`) for unusable input; use :func:`replay_async` inside an event loop.
    """
    return asyncio.run(replay_async(trace, tape=tape, tokenizer=tokenizer, sample_ids=sample_ids, statuses=statuses,
                                    execute=execute, tune_gc=tune_gc))


__all__ = [
    "Divergence",
    "RecordedError",
    "ReplayDiverged",
    "ReplayReport",
    "SampleReport",
    "TextContext",
    "TraceFile",
    "TracedPath",
    "check_path",
    "load_recorded_tokenizer",
    "load_recording",
    "paths_from_tape",
    "read_trace",
    "reexecute",
    "replay",
    "replay_async",
]
