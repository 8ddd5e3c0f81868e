"""Internal: overlays of recorded runs on the lifecycle diagram (how often each edge was taken, time spent in each
state, one sample's path), read from a transition trace; :mod:`~fsm_rollout.machine.diagrams` draws and exports them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.errors import RolloutError
from fsm_rollout.machine import lifecycle


class DiagramError(RolloutError, RuntimeError):
    """A diagram cannot be generated, written or checked (missing tool, unreadable trace, README without markers)."""


_GUARD_EVIDENCE: Mapping[str, str] = {"stop_eos_due": "eos_inserted"}
"""Guard → the trace field that is true exactly when that guard's edge was taken.

A trace event names its trigger, source, destination and (on terminal and fork edges) reason, but not the guard.
That identifies the table edge, except where two edges share all four; those are told apart by these fields.
"""


@dataclass(frozen=True)
class EdgeUsage:
    """How a recorded run used one table edge."""

    transitions: int
    """Transitions that took the edge (a sample that loops takes an edge more than once)."""
    sample_ids: frozenset[str]
    """The samples that took it."""
    sample_steps: tuple[int, ...] = ()
    """When one sample is highlighted: the 1-based positions in its path at which it took the edge."""

    @property
    def samples(self) -> int:
        """How many distinct samples took the edge."""
        return len(self.sample_ids)


@dataclass(frozen=True)
class StateUsage:
    """How a recorded run used one state."""

    samples: int
    """Distinct samples that entered the state (every sample enters the initial state)."""
    dwell_p50_ms: float | None
    """Median time spent in the state, over the transitions out of it; None when none left it."""
    on_sample_path: bool = False
    """Whether the highlighted sample entered the state."""
    queued_p50_ms: float | None = None
    """Initial state only: the median time samples waited for a concurrency slot before they entered it (their
    first transition's ``queued_ms``; not part of the dwell); None when the trace has none."""


@dataclass(frozen=True)
class Overlay:
    """A recorded run summarised on the transition table: usage per edge (aligned with the table) and per state."""

    total_samples: int
    edges: tuple[EdgeUsage, ...]
    states: Mapping[str, StateUsage]
    sample: str | None = None
    """The highlighted sample's id, if any."""
    unmatched: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    """Transitions (trigger, src, dst) the table has no edge for, with their counts (a trace of another version)."""


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The transition events of a trace file, in file order.

    Lines that are not JSON objects, or whose ``event`` is not ``"transition"``, are skipped (a trace file may hold
    other log lines). Raises :class:`DiagramError` when the file cannot be read.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DiagramError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    events: list[dict[str, Any]] = []
    for line in raw.splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "transition":
            events.append(event)
    return events


def match_edge(event: Mapping[str, Any], transitions: Sequence[lifecycle.Edge]) -> int | None:
    """The index in ``transitions`` of the edge a transition event took, or None if the table has no such edge.

    Candidates share the event's trigger, source and destination; a ``reason`` picks among terminal and fork edges,
    and the fields in :data:`_GUARD_EVIDENCE` among the rest. If that still leaves several, the last (most general)
    wins.
    For many events, build an :class:`EdgeIndex` once and call its :meth:`~EdgeIndex.match`.
    """
    return EdgeIndex(transitions).match(event)


class EdgeIndex:
    """A transition table's edges by (trigger, source, destination), so that matching an event costs a lookup
    rather than a scan of the table (a large trace has one event per transition)."""

    def __init__(self, transitions: Sequence[lifecycle.Edge]) -> None:
        self._transitions = transitions
        candidates: dict[tuple[str, str, str], list[int]] = {}
        for index, edge in enumerate(transitions):
            candidates.setdefault((edge.trigger, edge.source, edge.dest), []).append(index)
        # keyed by whatever an event holds (a lookup of a non-string finds nothing)
        self._candidates: dict[tuple[Any, Any, Any], tuple[int, ...]] = {
            key: tuple(indices) for key, indices in candidates.items()
        }

    def match(self, event: Mapping[str, Any]) -> int | None:
        """What :func:`match_edge` gives for ``event`` on this table."""
        key = (event.get("trigger"), event.get("src"), event.get("dst"))
        try:
            found = self._candidates.get(key)
        except TypeError:  # an unhashable field: no edge of the table has it
            return None
        if found is None:
            return None
        if len(found) == 1:
            return found[0]
        transitions = self._transitions
        candidates = list(found)
        reason = event.get("reason")
        if any(transitions[index].reason == reason for index in candidates):
            candidates = [index for index in candidates if transitions[index].reason == reason]
        if len(candidates) > 1:
            with_evidence = [index for index in candidates if transitions[index].guard in _GUARD_EVIDENCE]
            for index in with_evidence:
                if event.get(_GUARD_EVIDENCE[str(transitions[index].guard)]) is True:
                    return index
            candidates = [index for index in candidates if index not in with_evidence] or candidates
        return candidates[-1]


def build_overlay(events: Iterable[Mapping[str, Any]], sample: str | None = None) -> Overlay:
    """Summarise transition events (in the order they happened) on the current transition table.

    Samples are counted by rollout (``rollout_uid``, or the sample id in traces without one), so a sample index
    that ran several times counts once per run. ``sample`` (compared with ``str(event["sample_id"])``) selects a
    sample whose path is highlighted (its first run); raises :class:`DiagramError` if the events hold no transition
    of it. Events without a ``sample_id``, ``trigger``, ``src`` or ``dst`` are skipped.
    """
    transitions = lifecycle.TRANSITIONS
    edges = EdgeIndex(transitions)
    edge_transitions = [0] * len(transitions)
    edge_samples: list[set[str]] = [set() for _ in transitions]
    entered: dict[str, set[str]] = {state.name: set() for state in lifecycle.STATES}
    dwell: dict[str, list[float]] = {state.name: [] for state in lifecycle.STATES}
    queued: list[float] = []
    sample_steps: dict[int, list[int]] = {}
    sample_states: set[str] = set()
    path_lengths: Counter[str] = Counter()
    highlighted: str | None = None  # the run of ``sample`` that is highlighted
    sample_ids: set[str] = set()
    unmatched: Counter[tuple[str, str, str]] = Counter()
    for event in events:
        sample_id, trigger, src, dst = (event.get(key) for key in ("sample_id", "trigger", "src", "dst"))
        if sample_id is None or not all(isinstance(value, str) for value in (trigger, src, dst)):
            continue
        rollout_uid = event.get("rollout_uid")
        sid = str(rollout_uid) if isinstance(rollout_uid, str) else str(sample_id)
        sample_ids.add(str(sample_id))
        if highlighted is None and str(sample_id) == sample:
            highlighted = sid
        path_lengths[sid] += 1
        if src == lifecycle.INITIAL and src in entered:
            entered[src].add(sid)
        if dst in entered:
            entered[dst].add(sid)
        dwell_ms = event.get("dwell_ms")
        if src in dwell and isinstance(dwell_ms, int | float) and not isinstance(dwell_ms, bool):
            dwell[src].append(float(dwell_ms))
        queued_ms = event.get("queued_ms")
        if src == lifecycle.INITIAL and isinstance(queued_ms, int | float) and not isinstance(queued_ms, bool):
            queued.append(float(queued_ms))
        index = edges.match(event)
        if index is None:
            unmatched[(str(trigger), str(src), str(dst))] += 1
        else:
            edge_transitions[index] += 1
            edge_samples[index].add(sid)
        if sid == highlighted:
            sample_states.update((str(src), str(dst)))
            if index is not None:
                sample_steps.setdefault(index, []).append(path_lengths[sid])
    if sample is not None and highlighted is None:
        known = ", ".join(sorted(sample_ids)[:5]) or "none"
        raise DiagramError(
            f"sample {sample!r} has no transitions in the trace ({len(sample_ids)} samples there, e.g. {known})"
        )
    return Overlay(
        total_samples=len(path_lengths),
        edges=tuple(
            EdgeUsage(edge_transitions[index], frozenset(edge_samples[index]), tuple(sample_steps.get(index, ())))
            for index in range(len(transitions))
        ),
        states={
            name: StateUsage(
                len(entered[name]),
                statistics.median(dwell[name]) if dwell[name] else None,
                name in sample_states,
                statistics.median(queued) if queued and name == lifecycle.INITIAL else None,
            )
            for name in entered
        },
        sample=sample,
        unmatched=dict(sorted(unmatched.items())),
    )


def _share(samples: int, total: int) -> str:
    if total == 0 or samples == 0:
        return "0%"
    percent = 100.0 * samples / total
    return "<1%" if percent < 1 else f"{percent:.0f}%"


def _duration(ms: float) -> str:
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 100:
        return f"{ms:.1f} ms"
    if ms < 10_000:
        return f"{ms:.0f} ms"
    return f"{ms / 1000:.1f} s"


def usage_text(usage: EdgeUsage, total: int) -> str:
    if usage.transitions == 0:
        return "unused"
    plural = "" if usage.transitions == 1 else "s"
    return f"{usage.transitions} transition{plural} · {_share(usage.samples, total)} of samples"


def state_usage_text(usage: StateUsage) -> str:
    text = f"{usage.samples} sample" + ("" if usage.samples == 1 else "s")
    if usage.dwell_p50_ms is not None:
        text += f" · p50 {_duration(usage.dwell_p50_ms)}"
    if usage.queued_p50_ms is not None:
        text += f" · queued before it p50 {_duration(usage.queued_p50_ms)}"
    return text


def steps_text(sample: str, steps: Sequence[int]) -> str:
    return f"sample {sample} at " + ", ".join(str(step) for step in steps)
