"""Replaying a recording: read it, check every path, re-execute what the tape holds, and report.

With a tape, each of its sample records is checked (its own copy of the transitions) and, when legal,
re-executed from the record alone (:func:`~fsm_rollout.replay.reexecute.reexecute`). The trace, when there is
one, is checked too, path by path; what it says about a sample is reported with the tape's sample of the same
``(sample_id, session_id)``, in order of occurrence: its lines, its findings when it is incomplete, and an illegal
path fails the sample. The trace never decides what is re-executed. Without a tape, the trace's paths are only
checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.machine import lifecycle
from fsm_rollout.recording.format import RecordingFormatError, tape_path_for, tokenizer_fingerprint
from fsm_rollout.recording.reader import LineProblem, TapeFile, TapeSample, read_tape
from fsm_rollout.replay.compare import Divergence
from fsm_rollout.replay.paths import CheckVerdict, TracedPath, TraceFile, check_path, read_trace, run_labels
from fsm_rollout.replay.reexecute import reexecute
from fsm_rollout.replay.report import ReplayReport, SampleReport

STATUS_FILTERS = (*sorted(lifecycle.TERMINAL), "unfinished")


# ---------------------------------------------------------------------------------------------------- input


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


def load_recorded_tokenizer(records: Sequence[TapeSample], explicit: str | Path | None = None) -> Any:
    """Load ``explicit``, else the tokenizer the recording used: its ``name_or_path``, ``tokenizer_path``, ``model``.

    Raises :class:`~fsm_rollout.recording.RecordingFormatError` naming every candidate that failed.
    """
    from fsm_rollout.tokens.tokenizers import load_tokenizer  # remote code stays off: a tape is data from elsewhere

    candidates = [str(explicit)] if explicit is not None else _tokenizer_candidates(records)
    failures = []
    for candidate in candidates:
        try:
            return load_tokenizer(candidate)
        except Exception as error:
            failures.append(f"{candidate}: {type(error).__name__}: {str(error)[:200]}")
    raise RecordingFormatError(
        "cannot load the tokenizer the recording used ("
        + "; ".join(failures or ["the tape names none"])
        + "); pass --tokenizer PATH"
    )


def _tokenizer_candidates(records: Sequence[TapeSample]) -> list[str]:
    candidates: list[str] = []
    for record in records[:1]:
        for value in (
            record.tokenizer.get("name_or_path"),
            record.config.get("tokenizer_path"),
            record.config.get("model"),
        ):
            if isinstance(value, str) and value and value not in candidates:
                candidates.append(value)
    return candidates


def _warn_tokenizer(report: ReplayReport, tokenizer: Any, records: Sequence[TapeSample]) -> None:
    today = tokenizer_fingerprint(tokenizer)
    seen: set[str] = set()
    for record in records:
        for key in ("vocab_size", "eos_token_id", "chat_template_sha256"):
            recorded = record.tokenizer.get(key)
            if recorded is not None and today.get(key) is not None and recorded != today[key] and key not in seen:
                seen.add(key)
                report.warnings.append(
                    f"the tokenizer differs from the recording's: {key} {recorded!r} recorded, {today[key]!r} now"
                )


# ---------------------------------------------------------------------------------------------------- checking


@dataclass
class _Entry:
    """One sample run to report: checked from its tape record or its trace path, then maybe re-executed."""

    report: SampleReport
    record: TapeSample | None = None
    """The tape's record of the run (None: only the trace has it)."""
    runnable: bool = False
    """Whether the record's own copy of the path is legal (only then is it re-executed)."""
    traced: TracedPath | None = None
    trace_verdict: CheckVerdict | None = None


def _from_trace(path: TracedPath, problems: Sequence[LineProblem]) -> _Entry:
    verdict, findings = check_path(path, problems)
    report = SampleReport(
        path.sample_id,
        path.session_id,
        path.status,
        path.reason,
        verdict,
        findings=findings,
        turns=path.turns,
        rollout_uid=path.rollout_uid,
    )
    if path.lines:
        report.trace_lines = (path.lines[0], path.lines[-1])
    return _Entry(report)


def _from_tape(record: TapeSample) -> _Entry:
    copy = TracedPath(
        sample_id=record.sample_id,
        session_id=record.session_id,
        events=list(record.transitions),
        lines=[record.line] * len(record.transitions),
    )
    verdict, findings = check_path(copy)
    report = SampleReport(
        record.sample_id,
        record.session_id,
        copy.status or record.status,
        copy.reason if copy.terminal else record.reason,
        verdict,
        findings=findings,
        turns=copy.turns,
        tape_line=record.line,
        rollout_uid=record.rollout_uid,
    )
    return _Entry(report, record, runnable=verdict == "legal")


def _with_trace(entry: _Entry, path: TracedPath, problems: Sequence[LineProblem]) -> None:
    """Add what the trace says about a sample taken from the tape."""
    assert entry.record is not None
    report = entry.report
    verdict, findings = check_path(path, problems)
    entry.traced, entry.trace_verdict = path, verdict
    if path.lines:
        report.trace_lines = (path.lines[0], path.lines[-1])
    if verdict in ("unfinished", "damaged"):  # lines of the trace are lost; the tape has the whole path
        report.notes.extend(f"trace: {finding}" for finding in findings)
        report.notes.append(f"the trace is {verdict} here; the tape's copy of the path was used")
    elif verdict == "illegal":
        report.verdict = "illegal"
        report.findings[:0] = [f"trace: {finding}" for finding in findings]
    elif path.triples() != _triples(entry.record):
        report.notes.append(
            f"the trace (lines {path.lines[0]}-{path.lines[-1]}) records another path than the "
            "tape; the tape's is re-executed"
        )


def _triples(record: TapeSample) -> list[tuple[Any, Any, Any]]:
    return [(event.get("src"), event.get("trigger"), event.get("dst")) for event in record.transitions]


def _entries(trace: TraceFile | None, tape: TapeFile | None) -> list[_Entry]:
    """Every sample run to report (see :func:`_paired_entries`), each named by :func:`run_labels`."""
    entries = _paired_entries(trace, tape)
    for entry, label in zip(entries, run_labels(entry.report.sample_id for entry in entries), strict=True):
        entry.report.label = label
    return entries


def _paired_entries(trace: TraceFile | None, tape: TapeFile | None) -> list[_Entry]:
    """Every sample run to report, in the trace's order, then the tape's samples the trace does not have."""
    if tape is None:
        assert trace is not None
        return [_from_trace(path, trace.problems) for path in trace.paths]
    if trace is None:
        return [_from_tape(record) for record in tape.samples]
    # A rollout id pairs a trace path with its record exactly; traces and tapes without one pair by sample and
    # session, in order of occurrence.
    queued: dict[tuple[str | None, str | None, str | None], deque[TapeSample]] = {}
    for record in tape.samples:
        queued.setdefault((record.sample_id, record.session_id, record.rollout_uid), deque()).append(record)
    entries: list[_Entry] = []
    reported: set[int] = set()
    for path in trace.paths:
        waiting = queued.get((path.sample_id, path.session_id, path.rollout_uid))
        if not waiting:
            entry = _from_trace(path, trace.problems)
            if path.terminal:
                entry.report.notes.append("not on the tape: checked, not re-executed")
            entries.append(entry)
            continue
        record = waiting.popleft()
        reported.add(id(record))
        entry = _from_tape(record)
        _with_trace(entry, path, trace.problems)
        entries.append(entry)
    for record in tape.samples:
        if id(record) not in reported:
            entry = _from_tape(record)
            entry.report.notes.append("not found in the trace; the tape's own copy of the path was checked")
            entries.append(entry)
    return entries


def _wanted(report: SampleReport, sample_ids: set[str] | None, statuses: set[str] | None) -> bool:
    if sample_ids is not None and report.sample_id not in sample_ids and report.label not in sample_ids:
        return False
    return statuses is None or (report.status or "unfinished") in statuses


# ---------------------------------------------------------------------------------------------------- replaying


async def replay_async(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    tokenizer: Any = None,
    sample_ids: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    execute: bool = True,
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
                f"{len(trace_file.orphans)} transition(s) without sample_id (lines {_line_list(trace_file.orphans)}):"
                " they belong to no sample's path and were not checked"
            )
    if tape_file is not None:
        report.problems.extend(tape_file.problems)
    if execute and tape_file is None:
        report.warnings.append(
            f"no tape at {tape_path_for(trace_path)} (record with --record): paths are only "
            "checked against today's table, not re-executed"
        )

    entries = [entry for entry in _entries(trace_file, tape_file) if _wanted(entry.report, wanted_ids, wanted_statuses)]
    report.samples.extend(entry.report for entry in entries)
    to_run = [entry for entry in entries if entry.runnable] if execute else []
    if to_run:
        assert tape_file is not None
        records = [entry.record for entry in to_run if entry.record is not None]
        if tokenizer is None or isinstance(tokenizer, str | Path):
            tokenizer = await asyncio.to_thread(load_recorded_tokenizer, records, tokenizer)
        _warn_tokenizer(report, tokenizer, records)
        report.executed = True
        started, started_cpu = time.perf_counter(), time.process_time()
        for entry in to_run:
            await _reexecute(report, entry, tape_file, tokenizer)
        report.seconds = time.perf_counter() - started
        report.cpu_seconds = time.process_time() - started_cpu
    return report


async def _reexecute(report: ReplayReport, entry: _Entry, tape: TapeFile, tokenizer: Any) -> None:
    assert entry.record is not None
    divergence, turns, notes = await reexecute(entry.record, tape, tokenizer=tokenizer)
    sample = entry.report
    sample.turns_replayed = turns  # sample.turns stays the recorded path's: a divergence may stop today's run early
    sample.notes.extend(notes)
    report.turns_executed += turns
    sample.divergence = _at_trace_line(divergence, entry)
    if entry.trace_verdict == "illegal":  # the trace's own path fails the sample whatever the tape replays to
        return
    sample.verdict = "identical" if divergence is None else "diverged"
    if divergence is not None and divergence.kind == "tape":
        sample.verdict = "damaged"


def _at_trace_line(divergence: Divergence | None, entry: _Entry) -> Divergence | None:
    """A transition divergence with the trace line of that transition, when the trace logged it as recorded."""
    path, record = entry.traced, entry.record
    if divergence is None or divergence.kind != "transition" or divergence.index is None or path is None:
        return divergence
    index = divergence.index
    if record is None or index >= min(len(path.events), len(record.transitions)):
        return divergence
    if path.triples()[index] != _triples(record)[index]:
        return divergence
    return dataclasses.replace(divergence, line=path.lines[index])


def _line_list(lines: Sequence[int], limit: int = 5) -> str:
    shown = ", ".join(str(line) for line in lines[:limit])
    return shown + (f" and {len(lines) - limit} more" if len(lines) > limit else "")


def replay(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    tokenizer: Any = None,
    sample_ids: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    execute: bool = True,
) -> ReplayReport:
    """Check a recorded run against today's machine and re-execute it offline; returns a :class:`ReplayReport`.

    ``trace`` is a transition trace (its tape is looked for beside it: ``run.jsonl`` → ``run.tape.jsonl``, or
    give ``tape``), or a tape alone (its own copy of the transitions is checked). ``tokenizer`` is a tokenizer
    object or a path/name to load; by default the recorded ``name_or_path`` (then ``tokenizer_path``, then
    ``model``) is loaded. ``sample_ids`` and ``statuses`` (terminal states, or ``"unfinished"``) select samples;
    ``execute=False`` only checks. Replaying changes no process-wide setting (the garbage collector is left as it
    is, whatever the recorded config's ``tune_gc``). Raises :class:`~fsm_rollout.recording.RecordingFormatError` (a
    :class:`~fsm_rollout.errors.RolloutError`) for unusable input; use :func:`replay_async` inside an event loop.
    """
    return asyncio.run(
        replay_async(trace, tape=tape, tokenizer=tokenizer, sample_ids=sample_ids, statuses=statuses, execute=execute)
    )


__all__ = ["STATUS_FILTERS", "load_recorded_tokenizer", "load_recording", "replay", "replay_async"]
