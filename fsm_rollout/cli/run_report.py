"""Internal: what ``fsm-rollout run`` writes and prints when a run ends: the results file, the summary table, the
reward and error lines, the commands that look inside the run, and why a run that generated nothing failed."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.cli.preflight import one_line
from fsm_rollout.cli.report import default_output as report_path_for
from fsm_rollout.machine.lifecycle import OVERSAMPLED
from fsm_rollout.runtime.metrics import MetricsSnapshot
from fsm_rollout.runtime.runner import NOT_STARTED
from fsm_rollout.runtime.sampling import SampledBatch
from fsm_rollout.sample import Sample, Status
from fsm_rollout.sample.serialise import encode


def write_results(samples: Sequence[Sample], path: Path, *, include_features: bool = False) -> None:
    """Write ``Sample.to_dict()`` per line (images as data URLs).

    The decoded image features (``multimodal_train_inputs``: pixel values, megabytes per image) are written as
    ``{"dtype", "shape"}`` summaries unless ``include_features`` is set.
    """
    images: dict[int, str] = {}  # a group's samples share their prompt's image: each is encoded once

    def json_default(value: Any) -> Any:
        if hasattr(value, "save") and hasattr(value, "mode"):  # PIL images in multimodal_inputs
            from fsm_rollout.multimodal import encode_pil_image

            url = images.get(id(value))
            if url is None:
                url = images[id(value)] = encode_pil_image(value)
            return url
        if hasattr(value, "tolist"):
            return value.tolist()
        raise TypeError(f"cannot serialise {type(value).__name__}")

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as stream:
        for sample in samples:
            features = getattr(sample, "multimodal_train_inputs", None)
            if features and not include_features:  # summarised before to_dict, which would flatten every pixel
                sample = copy.copy(sample)
                sample.multimodal_train_inputs = {key: _feature_summary(value) for key, value in features.items()}
            stream.write(orjson.dumps(sample.to_dict(), default=json_default) + b"\n")


def _feature_summary(value: Any) -> Any:
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a tensor or an array
        return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    return encode(value)


def summary(
    snapshot: MetricsSnapshot,
    *,
    total: int,
    skipped: int,
    out: Path,
    trace: Path | None,
    rewards: Sequence[str] = (),
    errors: Sequence[str] = (),
) -> str:
    """The end-of-run table, with ``rewards`` (see :func:`reward_lines`) and ``errors`` (see :func:`error_lines`)
    under the counts."""
    # an interrupt aborts the samples in flight ("cancelled") and those still queued ("not_started"): neither ran
    # to its end, so the first count is of the samples that did
    never_started = snapshot.reasons.get(NOT_STARTED, 0)
    cut_off = snapshot.reasons.get("cancelled", 0)
    surplus = snapshot.reasons.get(OVERSAMPLED, 0)  # --target-groups cut them once enough groups were complete
    finished = snapshot.samples_done - cut_off - never_started - surplus
    lines = [
        f"{finished}/{total} samples finished in {snapshot.elapsed_s:.1f}s "
        f"({snapshot.samples_per_s:.2f} samples/s, {snapshot.turns} turns, "
        f"{snapshot.tokens_generated} tokens generated, {snapshot.tokens_per_s:.0f} tok/s)",
    ]
    if cut_off or never_started:
        lines.append(f"{cut_off} aborted mid-way, {never_started} never started")
    if surplus:
        lines.append(f"{surplus} cut as surplus (oversampled)")
    if skipped:
        lines.append(f"{skipped} bad dataset line(s) skipped")
    lines.append(f"{'status':<34}{'count':>6}")
    lines.extend(f"  {status:<32}{count:>6}" for status, count in sorted(snapshot.statuses.items()))
    lines.append(f"{'reason':<34}{'count':>6}")
    lines.extend(f"  {reason:<32}{count:>6}" for reason, count in sorted(snapshot.reasons.items()))
    lines.extend(rewards)
    lines.extend(errors)
    lines.append(f"results: {out}" + (f"   trace: {trace}" if trace else ""))
    return "\n".join(lines)


def groups_line(batch: SampledBatch, target: int | None) -> str:
    """``--target-groups``: how many groups were wanted and complete, how many were cut, whether the prompts ran
    out first."""
    line = f"groups: {batch.kept_groups}/{target} complete, {batch.surplus_groups} cut as surplus"
    return line + (" (the prompts ran out first)" if batch.prompts_exhausted else "")


def reward_lines(samples: Sequence[Sample]) -> list[str]:
    """The rewards the environment wrote, in one line: their mean and how many samples earned 1, and of those
    how many completed; nothing when no sample has a numeric reward."""
    rewards = [(float(sample.reward), sample.status) for sample in samples
               if isinstance(sample.reward, int | float) and not isinstance(sample.reward, bool)]  # fmt: skip
    if not rewards:
        return []
    mean = sum(reward for reward, _ in rewards) / len(rewards)
    ones = [status for reward, status in rewards if reward == 1.0]
    completed = sum(1 for status in ones if status == Status.COMPLETED)
    return [f"reward mean {mean:.3f} over {len(rewards)} samples; {len(ones)} at 1.0 ({completed} completed)"]


def error_lines(samples: Sequence[Sample], *, limit: int = 5) -> list[str]:
    """The failed samples' distinct errors (class, message, count), most frequent first, at most ``limit``.

    Messages are shortened to one line; the full ones are in the results' ``metadata["rollout_error"]``.
    """
    counts: Counter[tuple[str, str]] = Counter()
    for sample in samples:
        if sample.status != Status.FAILED:
            continue
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        error = metadata.get("rollout_error")
        if isinstance(error, dict):
            counts[(str(error.get("type")), one_line(str(error.get("message")), 200))] += 1
        else:
            counts[("?", f"no error recorded (reason {metadata.get('rollout_reason', '?')})")] += 1
    if not counts:
        return []
    lines = [f"errors ({sum(counts.values())} failed sample(s), {len(counts)} distinct)"]
    lines.extend(f"  {count:>4} x {kind}: {message}" for (kind, message), count in counts.most_common(limit))
    if len(counts) > limit:
        lines.append(f"  ... {len(counts) - limit} more distinct error(s), see metadata.rollout_error in the results")
    return lines


def example_sample_id(samples: Sequence[Sample], sample_ids: Sequence[str | None]) -> str | None:
    """The id of a sample worth a look: the first that completed with reward 1, else the first completed one, else
    the first (``sample_ids``: the names the run gave by position; a sample without one is named by its index)."""

    def name(position: int) -> str | None:
        given = sample_ids[position] if position < len(sample_ids) else None
        index = samples[position].index
        return given if given is not None else None if index is None else str(index)

    completed = [position for position, sample in enumerate(samples) if sample.status == Status.COMPLETED]
    rewarded = [position for position in completed if samples[position].reward == 1.0]
    for position in (*rewarded, *completed, *range(len(samples))):
        found = name(position)
        if found is not None:
            return found
    return None


def next_lines(
    samples: Sequence[Sample],
    sample_ids: Sequence[str | None],
    *,
    trace: Path | None,
    record: bool,
    results: Path | None = None,
    report: Path | None = None,
) -> list[str]:
    """The commands that look inside this run, with a sample id it has (``report``: the page ``--report`` wrote,
    else the command that writes it, with ``results``)."""
    if trace is None:
        return [
            "next: run with --trace trace.jsonl --record to look inside each sample "
            "(`fsm-rollout report`, `inspect`, `replay`, `diagram --trace`)"
        ]
    example = example_sample_id(samples, sample_ids)
    lines = ["next:"]
    if report is not None:
        lines.append(f"  open {report}")
    else:
        given = f" --results {results}" if results is not None else ""
        lines.append(f"  fsm-rollout report {trace}{given} -o {report_path_for(trace)}")
    lines.append(f"  fsm-rollout inspect {trace}")
    if example is not None:
        text = "" if record else "   (its turns' text needs a tape: run with --record)"
        lines.append(f"  fsm-rollout inspect {trace} --sample {example}{text}")
    overlay = trace.with_suffix(".mmd") if trace.suffix != ".mmd" else trace.with_suffix(".overlay.mmd")
    lines.append(
        f"  fsm-rollout diagram --trace {trace} -o {overlay}" + (f" --sample {example}" if example is not None else "")
    )
    if record:
        lines.append(f"  fsm-rollout replay {trace}")
    return lines


def nothing_generated(samples: Sequence[Sample], *, max_context_len: int | None) -> str | None:
    """Why the run failed when every sample ended ``budget_exhausted`` with nothing generated, else None.

    Each such sample is ``truncated``, a legal ending, but a run with not one generated token has nothing to train
    on: the prompts left no room for a response.
    """
    if not samples or any(sample.metadata.get("rollout_reason") != "budget_exhausted" or sample.response_length
                          for sample in samples):  # fmt: skip
        return None
    lengths = sorted(len(sample.tokens) for sample in samples)
    prompts = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    limit = f" under --max-context-len {max_context_len}" if max_context_len is not None else ""
    return (
        f"nothing was generated: all {len(samples)} sample(s) ended truncated/budget_exhausted before their first "
        f"turn; the prompts ({prompts} tokens) leave no room for a response{limit}"
    )
