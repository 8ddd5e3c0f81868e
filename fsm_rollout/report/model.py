"""What a report shows, as JSON-ready data: the run summary, the lifecycle with the run's counts, one row per sample
run, and (through :mod:`fsm_rollout.report.detail`) each sample's page.

Inputs are read with the readers ``inspect`` and ``replay`` use (:func:`fsm_rollout.replay.load_recording` for the
trace and its tape, :func:`fsm_rollout.recording.read_json_lines` for the results file) and summarised with
``inspect``'s :func:`~fsm_rollout.cli.inspect.summarize`, so the report and the terminal agree. The trace alone
gives the summary, the lifecycle counts, the rows and each sample's timeline; the tape adds the conversation and
the token strip, the results file rewards and groups, and a ``replay --json`` file the replay verdicts and
divergences.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.errors import RolloutError
from fsm_rollout.machine import lifecycle
from fsm_rollout.replay.paths import lineage_groups, lineage_of

ROW_COLUMNS = (
    "label",
    "group",
    "status",
    "reason",
    "turns",
    "reward",
    "response_tokens",
    "duration_ms",
    "verdict",
    "flags",
)
"""The fields of each sample row, in order (rows are lists, so 10,000 of them stay small)."""

FORK_REASON = "history_rewritten"
"""The reason a non-terminal edge carries when a rollout rewrote its history (a fork: a new training sequence)."""
COMPACTION_REASON = "compacted"
"""The reason of the fork a gateway agent's compaction takes (a summary replaced earlier turns)."""
SUSPEND_TRIGGERS = ("suspend", "resume", "hand_back")
_QUEUED_SHOWN_MS = 50.0
"""A sample is flagged as queued when it waited at least this long for a slot (shown as at least 0.1 s)."""


class ReportInputError(RolloutError, ValueError):
    """A results or replay file given to the report cannot be used."""


@dataclass
class Inputs:
    """Everything a report is built from (only the trace is required)."""

    trace_path: Path
    trace: Any = None
    """A :class:`~fsm_rollout.replay.TraceFile`, or None when a tape was given as the trace."""
    tape: Any = None
    """A :class:`~fsm_rollout.recording.TapeFile`, or None without a tape."""
    paths: list[Any] = field(default_factory=list)
    """The :class:`~fsm_rollout.replay.TracedPath` of each sample run."""
    results: list[dict[str, Any]] = field(default_factory=list)
    results_path: Path | None = None
    replay: dict[str, Any] | None = None
    replay_path: Path | None = None
    tokenizer: Any = None
    tokenizer_name: str | None = None


def load_inputs(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    results: str | Path | None = None,
    replay: str | Path | None = None,
) -> Inputs:
    """Read the trace (and its tape beside it, when there is one), the results file and a ``replay --json`` file.

    Raises :class:`~fsm_rollout.recording.RecordingFormatError` for an unusable trace or tape and
    :class:`ReportInputError` for an unusable results or replay file.
    """
    from fsm_rollout.replay import load_recording, paths_from_tape

    path, trace_file, tape_file = load_recording(trace, tape)
    inputs = Inputs(trace_path=path, trace=trace_file, tape=tape_file)
    inputs.paths = trace_file.paths if trace_file is not None else paths_from_tape(tape_file) if tape_file else []
    if results is not None:
        inputs.results_path = Path(results)
        inputs.results = read_results(inputs.results_path)
    if replay is not None:
        inputs.replay_path = Path(replay)
        inputs.replay = read_replay(inputs.replay_path)
    return inputs


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file (``Sample.to_dict()`` per line, as ``fsm-rollout run`` writes it)."""
    from fsm_rollout.recording import RecordingFormatError, read_json_lines

    try:
        rows, problems = read_json_lines(path)
    except RecordingFormatError as error:
        raise ReportInputError(str(error)) from error
    if problems:
        raise ReportInputError(f"{path} is not a results file: {problems[0]}")
    if rows and not all("tokens" in row and "status" in row for _, row in rows):
        raise ReportInputError(f"{path} is not a results file: a line lacks `tokens` or `status` (Sample.to_dict())")
    return [row for _, row in rows]


def read_replay(path: Path) -> dict[str, Any]:
    """A report written by ``fsm-rollout replay --json``."""
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as error:
        raise ReportInputError(f"cannot read {path}: {error.strerror or error}") from error
    except orjson.JSONDecodeError as error:
        raise ReportInputError(f"{path} is not JSON ({error}); write it with `fsm-rollout replay --json`") from error
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise ReportInputError(f"{path} is not a `fsm-rollout replay --json` report (no `samples` list)")
    return data


# ---------------------------------------------------------------------------------------------------- matching


def match_results(paths: Sequence[Any], results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any] | None]:
    """For each path, its results row: the one with the run's session id, else the one the run's sample id names
    (its ``index``, or ``group_index.member`` for a group's member). A row is used once, in order."""
    by_session: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    by_id: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in results:
        if isinstance(row.get("session_id"), str):
            by_session[row["session_id"]].append(row)
        for name in _row_names(row):
            by_id[name].append(row)
    used: set[int] = set()
    matched: list[Mapping[str, Any] | None] = []
    for path in paths:
        candidates = [*by_session.get(str(path.session_id), []), *by_id.get(str(path.sample_id), [])]
        found = next((row for row in candidates if id(row) not in used), None)
        if found is not None:
            used.add(id(found))
        matched.append(found)
    return matched


def _row_names(row: Mapping[str, Any]) -> list[str]:
    metadata = row.get("metadata")
    member = metadata.get("group_member") if isinstance(metadata, dict) else None
    if row.get("group_index") is not None and member is not None:
        return [f"{row['group_index']}.{member}"]
    return [str(row["index"])] if row.get("index") is not None else []


def match_replay(paths: Sequence[Any], replay: Mapping[str, Any] | None) -> list[Mapping[str, Any] | None]:
    """For each path, the replay's report of that run: by rollout id, else by run label."""
    if replay is None:
        return [None] * len(paths)
    samples = [sample for sample in replay.get("samples", []) if isinstance(sample, dict)]
    by_uid = {sample["rollout_uid"]: sample for sample in samples if isinstance(sample.get("rollout_uid"), str)}
    by_label = {str(sample.get("label") or sample.get("sample_id")): sample for sample in samples}
    return [by_uid.get(path.rollout_uid) or by_label.get(path.label or str(path.sample_id)) for path in paths]


def match_records(paths: Sequence[Any], tape: Any) -> list[Any]:
    """For each path, its tape record (by rollout id, else by sample and session in order), or None."""
    if tape is None:
        return [None] * len(paths)
    by_uid = {record.rollout_uid: record for record in tape.samples if record.rollout_uid is not None}
    queued: dict[tuple[Any, Any], list[Any]] = defaultdict(list)
    for record in tape.samples:
        queued[(record.sample_id, record.session_id)].append(record)
    matched = []
    for path in paths:
        record = by_uid.get(path.rollout_uid) if path.rollout_uid is not None else None
        if record is None:
            waiting = queued.get((path.sample_id, path.session_id))
            record = waiting.pop(0) if waiting else None
        matched.append(record)
    return matched


# ---------------------------------------------------------------------------------------------------- summary


def group_of(path: Any, row: Mapping[str, Any] | None) -> str | None:
    """The group a sample run belongs to: the results row's ``group_index``, else the id's part before its last dot
    (``7`` of ``7.2``), else None."""
    if row is not None and row.get("group_index") is not None:
        return str(row["group_index"])
    head, dot, member = str(path.sample_id).rpartition(".")
    return head if dot and head and member.isdigit() else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def stats(values: Sequence[float]) -> dict[str, float] | None:
    """Count, total, mean, p50, p95 and max of ``values`` (nearest rank), or None when there are none."""
    from fsm_rollout.cli.inspect import percentile

    if not values:
        return None
    return {
        "n": len(values),
        "total": round(sum(values), 3),
        "mean": round(sum(values) / len(values), 3),
        "p50": round(percentile(values, 0.5), 3),
        "p95": round(percentile(values, 0.95), 3),
        "max": round(max(values), 3),
    }


def run_summary(inputs: Inputs, rows: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The run as a whole: statuses and reasons, turns, tokens, throughput, time per state, groups' rewards, forks
    and suspensions, and the lines that could not be read."""
    from fsm_rollout.cli.inspect import summarize

    paths = inputs.paths
    summary = summarize(paths)
    times = [event["ts"] for path in paths for event in path.events if isinstance(event.get("ts"), float)]
    seconds = max(times) - min(times) if len(times) > 1 else None
    turns = sum(turns * count for turns, count in summary.turns.items())
    generated = sum(summary.generated_tokens)
    order = list(lifecycle.STATE_BY_NAME)

    def state_order(item: tuple[str, Any]) -> tuple[int, str]:
        return (order.index(item[0]) if item[0] in order else len(order), item[0])

    ordered = sorted(summary.dwell_ms.items(), key=state_order)
    dwell = [{"state": state, **(stats(values) or {})} for state, values in ordered]
    problems = [*(inputs.trace.problems if inputs.trace else []), *(inputs.tape.problems if inputs.tape else [])]
    return {
        "runs": summary.runs,
        "finished": summary.runs - summary.unfinished,
        "unfinished": summary.unfinished,
        "transitions": summary.transitions,
        "orphans": len(inputs.trace.orphans) if inputs.trace is not None else 0,
        "statuses": [
            {"status": status, "count": count, "reasons": summary.reasons[status].most_common()}
            for status, count in summary.statuses.most_common()
        ],
        "turns": sorted(summary.turns.items()),
        "turns_total": turns,
        "tokens": {
            "prompt": stats(summary.prompt_tokens),
            "generated": stats(summary.generated_tokens),
            "response": stats(summary.response_tokens),
        },
        "throughput": None
        if not seconds
        else {
            "seconds": round(seconds, 3),
            "samples_per_s": round((summary.runs - summary.unfinished) / seconds, 3),
            "turns_per_s": round(turns / seconds, 3),
            "tokens_per_s": round(generated / seconds, 1),
        },
        "dwell": dwell,
        "queued": stats(summary.queued_ms),
        "admission": stats(summary.admission_ms),
        "staleness": stats(summary.staleness_ms),
        "groups": group_rewards(paths, rows),
        "forks": _edge_reason_usage(paths, FORK_REASON),
        "compactions": _edge_reason_usage(paths, COMPACTION_REASON),
        "lineages": lineage_groups(paths),
        "suspensions": _suspensions(paths),
        "problems": [str(problem) for problem in problems],
    }


def group_rewards(paths: Sequence[Any], rows: Sequence[Mapping[str, Any] | None]) -> list[dict[str, Any]]:
    """Per group with a numeric reward: its members' rewards, mean and spread; ``zero_variance`` when its two or
    more members all got the same reward (a group a GRPO trainer learns nothing from). A one-member group (a
    gateway session, a run without groups) has no variance to speak of: never ``zero_variance``, and ``members``
    lets the page leave it out of the count."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for path, row in zip(paths, rows, strict=True):
        group = group_of(path, row)
        reward = _number(row.get("reward")) if row is not None else None
        if group is not None and reward is not None:
            rewards[group].append(reward)
    groups = []
    for group in sorted(rewards, key=_natural):
        values = rewards[group]
        groups.append(
            {
                "group": group,
                "rewards": values,
                "members": len(values),
                "mean": round(statistics.fmean(values), 4),
                "std": round(statistics.pstdev(values), 4),
                "zero_variance": len(values) > 1 and len(set(values)) == 1,
            }
        )
    return groups


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def _edge_reason_usage(paths: Sequence[Any], reason: str) -> dict[str, Any] | None:
    """How many transitions carried ``reason`` on a non-terminal edge, and in how many samples; None when none."""
    per_sample = Counter(
        path.label or str(path.sample_id)
        for path in paths
        for event in path.events
        if event.get("reason") == reason and event.get("dst") not in lifecycle.TERMINAL
    )
    if not per_sample:
        return None
    return {"reason": reason, "transitions": sum(per_sample.values()), "samples": len(per_sample)}


def _suspensions(paths: Sequence[Any]) -> dict[str, Any] | None:
    """Suspend, resume and hand-back transitions, the samples they touched and how long samples stayed suspended."""
    counts: Counter[str] = Counter()
    samples: set[str] = set()
    suspended: list[float] = []
    for path in paths:
        for event in path.events:
            trigger = event.get("trigger")
            if trigger in SUSPEND_TRIGGERS:
                counts[str(trigger)] += 1
                samples.add(path.label or str(path.sample_id))
            value = _number(event.get("suspended_ms"))
            if value is not None:
                suspended.append(value)
    if not counts:
        return None
    return {"counts": dict(counts), "samples": len(samples), "suspended_ms": stats(suspended)}


def lifecycle_usage(paths: Sequence[Any]) -> dict[str, Any]:
    """The table's edges with the run's counts (the same overlay ``diagram --trace`` draws), and the diagram as an
    SVG data URL when Graphviz is installed."""
    import base64

    from fsm_rollout.machine import diagrams

    overlay = diagrams.build_overlay(event for path in paths for event in path.events)
    labels = diagrams.guard_labels(lifecycle.TRANSITIONS)
    edges = [
        {
            "src": edge.source,
            "trigger": edge.trigger,
            "dst": edge.dest,
            "guard": labels[index],
            "reason": edge.reason,
            "transitions": usage.transitions,
            "samples": usage.samples,
        }
        for index, (edge, usage) in enumerate(zip(lifecycle.TRANSITIONS, overlay.edges, strict=True))
    ]
    svg_url = None
    svg_error = None
    try:
        svg = diagrams.render_svg(diagrams.dot(overlay))
        svg_url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    except diagrams.DiagramError as error:
        svg_error = str(error)
    return {
        "edges": edges,
        "unmatched": [{"edge": list(key), "transitions": count} for key, count in overlay.unmatched.items()],
        "svg": svg_url,
        "svg_error": svg_error,
        "states": {
            name: {"samples": usage.samples, "dwell_p50_ms": usage.dwell_p50_ms}
            for name, usage in overlay.states.items()
        },
    }


# ---------------------------------------------------------------------------------------------------- rows


def sample_row(path: Any, row: Mapping[str, Any] | None, replayed: Mapping[str, Any] | None) -> list[Any]:
    """One sample run as a table row (:data:`ROW_COLUMNS`)."""
    times = [event["ts"] for event in path.events if isinstance(event.get("ts"), float)]
    queued = _number(path.events[0].get("queued_ms")) if path.events else None
    duration = round((max(times) - min(times)) * 1000.0, 1) if len(times) > 1 else None
    if duration is not None and path.events:
        first_dwell = _number(path.events[0].get("dwell_ms"))
        duration = round(duration + (first_dwell or 0.0), 1)  # the first transition's ts is after pending's work
    length = path.events[-1].get("response_length") if path.events else None
    flags = []
    if any(event.get("reason") == FORK_REASON for event in path.events):
        flags.append("fork")
    if any(event.get("reason") == COMPACTION_REASON for event in path.events):
        flags.append("compacted")
    session, lineage = lineage_of(path.sample_id)
    if session != str(path.sample_id):
        flags.append(f"lineage {lineage} of {session}")
    if any(event.get("trigger") in SUSPEND_TRIGGERS for event in path.events):
        flags.append("suspended")
    if any(event.get("trigger") == "fail" for event in path.events):
        flags.append("error")
    if queued is not None and queued >= _QUEUED_SHOWN_MS:
        flags.append(f"queued {queued / 1000.0:.1f}s")
    return [
        path.label or str(path.sample_id),
        group_of(path, row),
        path.status or "unfinished",
        path.reason or "",
        path.turns,
        _number(row.get("reward")) if row is not None else None,
        length if isinstance(length, int) else None,
        duration,
        replayed.get("verdict") if replayed is not None else None,
        " ".join(flags),
    ]
