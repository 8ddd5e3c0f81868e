"""What each trained token went through during its rollout, as group labels for :func:`fsm_rollout.mismatch`.

Every dimension labels every trained token of a batch once:

- ``version``: the weight version it was sampled under (``metadata["weight_version_spans"]``) and the one it is
  trained at, with the staleness between them when both read as integers;
- ``resume``: ``after_resume`` when it was sampled under a later version than its rollout started with (a weight
  update suspended the rollout before it), else ``before_resume``;
- ``sequence``: ``first`` for a rollout's first sequence, ``branch`` for a sequence a history rewrite forked;
- ``image``: ``near_image`` within ``image_window`` tokens after an observation with an image (or after an image
  prompt), else ``no_image``;
- ``routes``: ``routes_changed`` in a turn whose routed experts came from more than one request
  (``metadata["routed_expert_spans"]``), ``routes_kept`` in one whose came from one, ``routes_unknown`` without;
- ``history_policy`` and ``engine``: as the sample's metadata says, else as the caller says, else ``unknown``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

DIMENSIONS = ("version", "resume", "sequence", "image", "routes", "history_policy", "engine")


@dataclass
class Labels:
    """One dimension's label per response token of the batch: ``codes`` index ``names``."""

    names: list[str]
    codes: npt.NDArray[np.int32]

    def code(self, name: str) -> int:
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)


def _staleness(sampled: str, trained: Any) -> int | None:
    try:
        return int(trained) - int(sampled)
    except (TypeError, ValueError):
        return None


def version_label(sampled: str, trained: Any) -> str:
    """``v -> w (staleness s)``, or ``v`` when the trained version is not known."""
    if trained is None:
        return f"sampled {sampled}"
    staleness = _staleness(sampled, trained)
    tail = "" if staleness is None else f" (staleness {staleness})"
    return f"{sampled} -> {trained}{tail}"


def staleness_of(label: str) -> int | None:
    """The staleness a ``version`` label carries, if any."""
    marker = "(staleness "
    return int(label[label.index(marker) + len(marker) : -1]) if marker in label else None


def _has_image(messages: Any) -> bool:
    for message in messages or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(item, Mapping) and item.get("type") in ("image", "image_url", "input_image") for item in content
        ):
            return True
    return False


def _turns(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of loss mask 1 (generated turns) as response positions ``[start, end)``."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, value in enumerate(mask):
        if value == 1 and start is None:
            start = position
        elif value != 1 and start is not None:
            runs.append((start, position))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def label_sequences(
    sequences: Sequence[Any],
    offsets: npt.NDArray[np.int64],
    *,
    trainer_version: Any,
    image_window: int,
    history_policy: str | None,
    engine: str | None,
) -> dict[str, Labels]:
    """Each dimension's labels over the batch's response tokens (``offsets`` delimit each sequence's)."""
    total = int(offsets[-1])
    labels = {name: Labels([], np.zeros(total, dtype=np.int32)) for name in DIMENSIONS}
    for number, sample in enumerate(sequences):
        lo, hi = int(offsets[number]), int(offsets[number + 1])
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        start_version = str(metadata.get("start_weight_version", ""))
        version = labels["version"]
        resume = labels["resume"]
        resume.codes[lo:hi] = resume.code("before_resume")
        spans = metadata.get("weight_version_spans") or []
        if not spans:
            version.codes[lo:hi] = version.code(version_label("unknown", trainer_version))
        for span in spans:
            sampled = str(span["version"])
            start, end = lo + int(span["start"]), lo + int(span["end"])
            version.codes[start:end] = version.code(version_label(sampled, trainer_version))
            if start_version and sampled != start_version:
                resume.codes[start:end] = resume.code("after_resume")
        sequence = labels["sequence"]
        sequence.codes[lo:hi] = sequence.code("first" if int(metadata.get("branch", 0)) == 0 else "branch")
        image = labels["image"]
        image.codes[lo:hi] = image.code("no_image")
        observations = metadata.get("observations") or []
        windows = [int(seen["end"]) for seen in observations if _has_image(seen.get("messages"))]
        if (getattr(sample, "multimodal_inputs", None) or {}).get("images"):
            windows.append(0)
        for end in windows:
            image.codes[lo + min(end, hi - lo) : lo + min(end + image_window, hi - lo)] = image.code("near_image")
        _label_routes(labels["routes"], sample, metadata, lo, hi)
        for name, given in (("history_policy", history_policy), ("engine", engine)):
            value = metadata.get(name, given)
            labels[name].codes[lo:hi] = labels[name].code("unknown" if value is None else str(value))
    return labels


def _label_routes(routes: Labels, sample: Any, metadata: Mapping[str, Any], lo: int, hi: int) -> None:
    spans = metadata.get("routed_expert_spans") or []
    if not spans:
        routes.codes[lo:hi] = routes.code("routes_unknown")
        return
    prompt = len(sample.tokens) - (hi - lo)
    routes.codes[lo:hi] = routes.code("routes_kept")
    for start, end in _turns(sample.loss_mask or []):
        # response token p was produced by row prompt + p - 1
        first, last = prompt + start - 1, prompt + end - 1
        requests = {span["request_id"] for span in spans if span["start"] < last and span["end"] > first}
        if len(requests) > 1:
            routes.codes[lo + start : lo + end] = routes.code("routes_changed")


__all__ = ["DIMENSIONS", "Labels", "label_sequences", "staleness_of", "version_label"]
