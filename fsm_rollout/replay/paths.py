"""Checking logged paths against today's lifecycle table.

A path is one sample run's transitions in order, rebuilt from a transition trace (:func:`read_trace`) or from the
copy a tape keeps of them (:func:`paths_from_tape`). :func:`check_path` verifies that every transition is an edge
of today's table (:mod:`fsm_rollout.machine.lifecycle`), carrying a reason that edge can give, that each leaves the
state the previous one entered, and that the path ends in a terminal state. Nothing here re-executes anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsm_rollout.machine import lifecycle
from fsm_rollout.recording.format import RecordingFormatError, SchemaVersionError
from fsm_rollout.recording.reader import LineProblem, TapeFile, read_json_lines
from fsm_rollout.trace import TRACE_SCHEMA_VERSION, TRANSITION_EVENT

CheckVerdict = Literal["legal", "illegal", "unfinished", "damaged"]


@dataclass
class TracedPath:
    """One sample's transitions as logged, in order, with the line each came from."""

    sample_id: str | None
    session_id: str | None
    events: list[dict[str, Any]] = field(default_factory=list)
    rollout_uid: str | None = None
    """Unique to the rollout, when the trace or tape carries it (a sample index may repeat across runs)."""
    label: str = ""
    """How reports and ``inspect`` name this path: the sample id, with ``#N`` for its N-th run when the id repeats
    (set by :func:`run_labels`)."""
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

    Events are grouped by ``rollout_uid``, or, in traces written before it existed, by ``(sample_id, session_id)``,
    where a ``pending`` event after a terminal one starts a new path (a trace appended to by several runs). An
    unreadable line whose text names a sample is given to that sample's path (:attr:`TracedPath.damage`). Raises
    :class:`~fsm_rollout.recording.SchemaVersionError` for events of another schema version and
    :class:`~fsm_rollout.recording.RecordingFormatError` when there is no transition event.
    """
    trace = TraceFile(Path(path))
    rows, problems = read_json_lines(trace.path)
    trace.problems.extend(problems)
    open_paths: dict[tuple[str, str | None, str | None], TracedPath] = {}
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
        rollout_uid = row.get("rollout_uid") if isinstance(row.get("rollout_uid"), str) else None
        key = (sample_id, session_id if isinstance(session_id, str) else None, rollout_uid)
        current = open_paths.get(key)
        if current is None or (current.terminal and row.get("src") == lifecycle.INITIAL):
            current = TracedPath(sample_id=key[0], session_id=key[1], rollout_uid=rollout_uid)
            trace.paths.append(current)
            open_paths[key] = current
        current.events.append(row)
        current.lines.append(number)
    if trace.transitions == 0:
        raise RecordingFormatError(f"{trace.path} holds no transition events: not an fsm-rollout trace")
    _attribute_damage(trace.paths, trace.problems)
    for traced, label in zip(trace.paths, run_labels(traced.sample_id for traced in trace.paths), strict=True):
        traced.label = label
    return trace


def run_labels(sample_ids: Iterable[str | None]) -> list[str]:
    """How runs are named, in order: the sample id, with ``#N`` (1-based) on every run of an id that repeats."""
    ids = list(sample_ids)
    runs = Counter(ids)
    seen: Counter[str | None] = Counter()
    labels = []
    for sample_id in ids:
        seen[sample_id] += 1
        labels.append(f"{sample_id}#{seen[sample_id]}" if runs[sample_id] > 1 else str(sample_id))
    return labels


def _attribute_damage(paths: Sequence[TracedPath], problems: Sequence[LineProblem]) -> None:
    """Give each unreadable line that names a sample to that sample's path that was open at that line."""
    for problem in problems:
        if problem.sample_id is None:
            continue
        owners = [
            path
            for path in paths
            if path.sample_id == problem.sample_id and path.lines and path.lines[0] < problem.line
        ]
        if owners:
            owners[-1].damage.append(problem)


def paths_from_tape(tape: TapeFile) -> list[TracedPath]:
    """Paths rebuilt from the transitions kept on a tape (each transition's line is its record's)."""
    paths = []
    for record in tape.samples:
        path = TracedPath(sample_id=record.sample_id, session_id=record.session_id, rollout_uid=record.rollout_uid)
        path.events = list(record.transitions)
        path.lines = [record.line] * len(record.transitions)
        paths.append(path)
    for traced, label in zip(paths, run_labels(traced.sample_id for traced in paths), strict=True):
        traced.label = label
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


def check_path(path: TracedPath, problems: Sequence[LineProblem] = ()) -> tuple[CheckVerdict, list[str]]:
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
            findings.append(f"line {line}: {arrow(src, trigger, dst)} after the sample ended in {state}")
            illegal = True
        elif src != state:
            gap = [number for number in unreadable if previous_line is not None and previous_line < number < line]
            if gap:
                findings.append(
                    f"line {line}: leaves {src}, but the sample was in {state}; unreadable line {gap[0]} "
                    "lies in between"
                )
                damaged = True
            else:
                where = "starts" if previous_line is None else "leaves"
                findings.append(f"line {line}: {where} in {src}, but the sample was in {state}")
                illegal = True
        finding = _edge_finding(edges, event, line)
        if finding is not None:
            findings.append(finding)
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


def _edge_finding(
    edges: dict[tuple[str, str, str], frozenset[str | None] | None], event: dict[str, Any], line: int
) -> str | None:
    """What is wrong with one transition as an edge of today's table (its edge and its reason), or None."""
    src, trigger, dst = event.get("src"), event.get("trigger"), event.get("dst")
    key = (str(src), str(trigger), str(dst))
    if key not in edges:
        return f"line {line}: {arrow(src, trigger, dst)} is not a transition of today's table"
    allowed = edges[key]
    reason = event.get("reason")
    if dst in lifecycle.TERMINAL and allowed is None and not (isinstance(reason, str) and reason):
        return f"line {line}: {arrow(src, trigger, dst)} without the caller's abort reason"
    if allowed is not None and reason not in allowed:
        expected = " or ".join(repr(item) for item in sorted(allowed, key=str))
        return f"line {line}: {arrow(src, trigger, dst)} with reason {reason!r}; today's table gives {expected}"
    return None


def arrow(src: Any, trigger: Any, dst: Any) -> str:
    """A transition as text: ``src --trigger--> dst``."""
    return f"{src} --{trigger}--> {dst}"


__all__ = [
    "CheckVerdict",
    "TraceFile",
    "TracedPath",
    "arrow",
    "check_path",
    "lineage_groups",
    "lineage_of",
    "paths_from_tape",
    "read_trace",
]


def lineage_of(sample_id: Any) -> tuple[str, str]:
    """``(session run, lineage)`` of a sample id: a gateway session's lineage ``l1`` runs as ``7.0.l1`` beside its main
    lineage ``7.0`` (``l0``); any other id is its own main lineage."""
    head, dot, member = str(sample_id).rpartition(".")
    if dot and head and member[:1] == "l" and member[1:].isdigit():
        return head, member
    return str(sample_id), "l0"


def lineage_groups(paths: Sequence[Any]) -> list[dict[str, Any]] | None:
    """Per gateway session with more than one lineage: each lineage's runs, training sequences (a fork starts one)
    and the reasons of its forks; None when no session has more than one."""
    sessions: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        session, lineage = lineage_of(path.sample_id)
        entry = sessions.setdefault(session, {}).setdefault(
            lineage, {"lineage": lineage, "runs": 0, "sequences": 0, "forks": Counter()}
        )
        forks = [
            str(event.get("reason"))
            for event in path.events
            if event.get("trigger") == "fork" and event.get("dst") == "rendered"
        ]
        entry["runs"] += 1
        entry["sequences"] += 1 + len(forks)
        entry["forks"].update(forks)
    groups = [
        {
            "session": session,
            "lineages": [
                {**entry, "forks": dict(entry["forks"])}
                for _, entry in sorted(lineages.items(), key=lambda item: int(item[0][1:]))
            ],
        }
        for session, lineages in sessions.items()
        if len(lineages) > 1
    ]
    return groups or None
