"""Building a report: the inputs read, summarised and turned into the page's data, then written as HTML."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm_rollout.report import detail
from fsm_rollout.report.model import (
    ROW_COLUMNS,
    Inputs,
    lifecycle_usage,
    load_inputs,
    match_records,
    match_replay,
    match_results,
    run_summary,
    sample_row,
)
from fsm_rollout.report.training_views import mismatch_view, tree_views


@dataclass
class ReportData:
    """The page's data: ``index`` (summary, lifecycle, rows: parsed when the page opens) and one ``details`` entry
    per row (parsed when that sample is opened)."""

    index: dict[str, Any]
    details: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the report could not show, and why (printed by the command)."""


def build_report(
    trace: str | Path,
    *,
    tape: str | Path | None = None,
    results: str | Path | None = None,
    replay: str | Path | None = None,
    tokenizer: Any = None,
    mismatch: str | Path | None = None,
) -> ReportData:
    """Read a recorded run and build its page's data.

    ``trace`` is a transition trace (its tape is read from beside it, or from ``tape``) or a tape alone;
    ``results`` the results file ``fsm-rollout run`` wrote; ``replay`` the output of ``fsm-rollout replay --json``;
    ``tokenizer`` a tokenizer object or a path/name (default: the one the tape recorded) for the decoded token
    texts; ``mismatch`` a file of trainer logprobs, one JSON line per training sequence of the results rows (the
    mismatch section, and each sample's tokens coloured by ``|Δ logprob|``). Raises
    :class:`~fsm_rollout.recording.RecordingFormatError` or
    :class:`~fsm_rollout.report.ReportInputError` for unusable input.
    """
    inputs = load_inputs(trace, tape=tape, results=results, replay=replay)
    notes: list[str] = []
    section, strips = mismatch_view(inputs.results, Path(mismatch)) if mismatch is not None else (None, {})
    inputs.tokenizer = _tokenizer(inputs, tokenizer, notes)
    rows = match_results(inputs.paths, inputs.results) if inputs.results else [None] * len(inputs.paths)
    replays = match_replay(inputs.paths, inputs.replay)
    records = match_records(inputs.paths, inputs.tape)
    # without a results row, the reward the tape recorded at the sample's end
    rows = [row if row is not None or record is None or "reward" not in record.result
            else {"reward": record.result["reward"]} for row, record in zip(rows, records, strict=True)]  # fmt: skip
    if inputs.tape is None and not inputs.results:
        notes.append("no tape: the sample pages show timelines only (record with `fsm-rollout run --record`)")
    elif inputs.tape is None:
        notes.append(
            "no tape: the sample pages show the results file's prompt, whole response and tokens, not each turn "
            "(record with `fsm-rollout run --record`)"
            + ("" if inputs.tokenizer is not None else "; token ids only, give `--tokenizer` for their text")
        )
    index = {
        "meta": {
            "trace": inputs.trace_path.name,
            "tape": inputs.tape.path.name if inputs.tape is not None else None,
            "results": inputs.results_path.name if inputs.results_path is not None else None,
            "replay": inputs.replay_path.name if inputs.replay_path is not None else None,
            "tokenizer": inputs.tokenizer_name,
            "notes": notes,
        },
        "summary": run_summary(inputs, rows),
        "lifecycle": lifecycle_usage(inputs.paths),
        "columns": list(ROW_COLUMNS),
        "rows": [sample_row(path, row, rep) for path, row, rep in zip(inputs.paths, rows, replays, strict=True)],
        "replay": _replay_summary(inputs.replay),
        "trees": tree_views(inputs.results, notes) if inputs.results else [],
        "mismatch": section,
    }
    details = [
        sample_detail(inputs, path, record, row, rep)
        for path, record, row, rep in zip(inputs.paths, records, rows, replays, strict=True)
    ]
    position = {id(row): number for number, row in enumerate(inputs.results)}
    for page, row in zip(details, rows, strict=True):
        page["mismatch"] = strips.get(position.get(id(row), -1)) if row is not None else None
    return ReportData(index=index, details=details, notes=notes)


def sample_detail(inputs: Inputs, path: Any, record: Any, row: Any, replayed: Any) -> dict[str, Any]:
    """One sample run's page data: identity, timeline, and what the tape or results row adds."""
    page: dict[str, Any] = {
        "label": path.label or str(path.sample_id),
        "sample_id": path.sample_id,
        "session_id": path.session_id,
        "rollout_uid": path.rollout_uid,
        "status": path.status or "unfinished",
        "reason": path.reason,
        "turns": path.turns,
        "timeline": detail.timeline(path),
        "source": None,
        "conversation": None,
        "tokens": None,
        "replay": replayed,
    }
    if record is not None and inputs.tape is not None:
        page["source"] = "tape"
        page["conversation"] = detail.conversation_from_tape(record, inputs.tape)
        page["tokens"] = detail.strip_from_tape(record, inputs.tokenizer)
    elif row is not None:
        page["source"] = "results"
        page["conversation"] = detail.conversation_from_results(row)
        page["tokens"] = detail.strip_from_results(row, inputs.tokenizer)
    if row is not None and page["conversation"] is not None and page["conversation"].get("reward") is None:
        page["conversation"]["reward"] = row.get("reward")
    if replayed is not None and isinstance(replayed.get("divergence"), dict) and page["tokens"] is not None:
        at = strip_position(replayed["divergence"], page["tokens"])
        page["replay"] = {**replayed, "divergence": {**replayed["divergence"], "strip_index": at}}
    return page


_BRANCH_DIVERGENCE = re.compile(r"^branch (\d+) tokens\[")


def strip_position(divergence: dict[str, Any], strip: dict[str, Any]) -> int | None:
    """Where in the token strip a token divergence is: replay counts positions in the sequence it compares (a
    branch's, named in the message, or the last one), the strip runs all sequences end to end."""
    index = divergence.get("index")
    if divergence.get("kind") not in ("tokens", "loss_mask", "logprobs") or not isinstance(index, int):
        return None
    sequences = strip.get("sequences") or []
    if not sequences:
        return index
    branch = _BRANCH_DIVERGENCE.match(str(divergence.get("message", "")))
    number = int(branch.group(1)) if branch else len(sequences) - 1
    return int(sequences[number][0]) + index if number < len(sequences) else None


def _replay_summary(replay: dict[str, Any] | None) -> dict[str, Any] | None:
    if replay is None:
        return None
    return {
        "counts": replay.get("counts"),
        "executed": replay.get("executed"),
        "exit_code": replay.get("exit_code"),
        "warnings": replay.get("warnings") or [],
        "problems": replay.get("problems") or [],
    }


def _tokenizer(inputs: Inputs, given: Any, notes: list[str]) -> Any:
    """The tokenizer for token texts: ``given`` (an object, or a path/name to load), else the tape's."""
    from fsm_rollout.recording import RecordingFormatError
    from fsm_rollout.replay import load_recorded_tokenizer

    if given is not None and not isinstance(given, str | Path):
        inputs.tokenizer_name = _shown_name(getattr(given, "name_or_path", type(given).__name__))
        return given
    records = inputs.tape.samples if inputs.tape is not None else []
    if given is None and not records:
        return None
    try:
        loaded = load_recorded_tokenizer(records, given)
    except RecordingFormatError as error:
        notes.append(f"token texts left out: {error}")
        return None
    inputs.tokenizer_name = _shown_name(getattr(loaded, "name_or_path", given))
    return loaded


def _shown_name(name: Any) -> str:
    """A tokenizer's name as the page shows it: a local path's last part (the page names no directory)."""
    text = str(name)
    return Path(text).name if "/" in text and Path(text).is_absolute() else text


def write_report(data: ReportData, output: str | Path) -> Path:
    """Write the page to ``output``; returns its path."""
    from fsm_rollout.report.page import render_page

    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(data.index, data.details), encoding="utf-8")
    return path
