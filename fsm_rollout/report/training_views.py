"""The report's training views: the token tree a results file builds, and the train/inference mismatch a file of
trainer logprobs gives (``fsm-rollout report --mismatch FILE``).

The tree view is one tree per GRPO group (a rollout without a group is a tree of its own: its branches share its
prefix), each node a span with its depth, tokens, generated tokens and the sequences that share it. The mismatch
view is :func:`fsm_rollout.mismatch` over the results rows, with the trainer logprobs file aligned with their
training sequences (one JSON line per sequence: a list of floats, or an object with ``logprobs`` and optionally
``step``): K3 per step, the event table, the worst sequences first, and per sample the ``|Δ logprob|`` of each
response token, which colours its token strip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.report.model import ReportInputError

TREES_DRAWN = 100
"""Trees (groups) the page holds at most."""
NODES_DRAWN = 300
"""Nodes per tree the page holds at most (the rest are counted)."""
WORST_LISTED = 20
"""Sequences the mismatch section lists, worst first."""


def tree_views(results: Sequence[Mapping[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """One view per group of the results rows (at most :data:`TREES_DRAWN`), in the order groups first appear."""
    from fsm_rollout.training import training_tree

    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for position, row in enumerate(results):
        group = row.get("group_index")
        groups.setdefault(("group", group) if group is not None else ("sample", position), []).append(row)
    views = []
    for (kind, key), rows in list(groups.items())[:TREES_DRAWN]:
        try:
            tree = training_tree(rows)
        except (TypeError, ValueError, KeyError) as error:
            notes.append(f"token tree of {kind} {key} left out: {error}")
            continue
        views.append({
            "name": f"{kind} {key}",
            "stats": tree.stats,
            "nodes": [[node.id, node.parent, node.depth, len(node), int(node.loss_mask.sum()), len(node.sequences),
                       len(node.images)] for node in tree.nodes[:NODES_DRAWN]],
            "hidden_nodes": max(0, len(tree.nodes) - NODES_DRAWN),
            "leaves": [[leaf.sequence, leaf.index, leaf.branch, leaf.reward, leaf.status, leaf.nodes[-1:] or [None]]
                       for leaf in tree.leaves],
        })  # fmt: skip
    if len(groups) > TREES_DRAWN:
        notes.append(f"token trees: the first {TREES_DRAWN} of {len(groups)} groups are drawn")
    return views


def read_trainer_logprobs(path: Path) -> tuple[list[list[float]], list[Any]]:
    """Each line's logprobs and step (None when the line gives none); raises :class:`ReportInputError`."""
    values: list[list[float]] = []
    steps: list[Any] = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise ReportInputError(f"cannot read the trainer logprobs {path}: {error}") from error
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise ReportInputError(f"{path} line {number} is not JSON: {error}") from error
        step = item.get("step") if isinstance(item, dict) else None
        logprobs = item.get("logprobs") if isinstance(item, dict) else item
        if not isinstance(logprobs, list):
            raise ReportInputError(f'{path} line {number}: expected a list of logprobs or {{"logprobs": [...]}}')
        values.append(logprobs)
        steps.append(step)
    return values, steps


def mismatch_view(
    results: Sequence[Mapping[str, Any]], path: Path
) -> tuple[dict[str, Any], dict[int, list[dict[str, Any]]]]:
    """The mismatch section's data, and per results row (by position) its sequences' ``|Δ|`` per response token."""
    import numpy as np

    from fsm_rollout.sample import Sample, training_sequences
    from fsm_rollout.training import MismatchInputError, mismatch

    if not results:
        raise ReportInputError("--mismatch needs the results file (--results) whose sequences the logprobs follow")
    values, steps = read_trainer_logprobs(path)
    samples = [Sample.from_dict(row) for row in results]
    try:
        report = mismatch(samples, values)
    except MismatchInputError as error:
        raise ReportInputError(f"{path} does not fit the results file: {error}") from error
    owners = [position for position, sample in enumerate(samples) for _ in training_sequences([sample])]
    sequences = training_sequences(samples)
    per_step: dict[str, list[float]] = {}
    for sample, step in zip(report.samples, steps, strict=True):
        totals = per_step.setdefault("all" if step is None else str(step), [0.0, 0.0])
        totals[0] += sample.k3 * sample.tokens
        totals[1] += sample.tokens
    worst = sorted(report.samples, key=lambda s: (-s.k3, -s.max_abs_delta, s.sequence))[:WORST_LISTED]
    section = {
        "file": path.name,
        "totals": {key: value for key, value in report.to_dict().items() if key not in ("samples", "events")},
        "steps": [[step, total / count if count else 0.0, int(count)] for step, (total, count) in per_step.items()],
        "events": [vars(group) for group in report.events],
        "worst": [{**asdict(sample), "row": owners[sample.sequence]} for sample in worst],  # slotted: no vars()
    }
    strips: dict[int, list[dict[str, Any]]] = {}
    absolute = np.where(report.trained, np.round(np.abs(report.log_ratio), 6), -1.0)  # -1: not trained (no Δ)
    for number, owner in enumerate(owners):
        lo, hi = int(report.offsets[number]), int(report.offsets[number + 1])
        sequence = sequences[number]
        strips.setdefault(owner, []).append({
            "prompt": len(sequence.tokens) - sequence.response_length,
            "delta": absolute[lo:hi].tolist(),
            "k3": report.samples[number].k3,
        })  # fmt: skip
    return section, strips


__all__ = ["mismatch_view", "read_trainer_logprobs", "tree_views"]
