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


PER_SEQUENCE = ("sequence", "history_policy", "engine")
"""The dimensions whose label is the same over a whole sequence: labelled per sequence, not per token."""


@dataclass
class Labels:
    """One dimension's label per response token of the batch (per sequence for :data:`PER_SEQUENCE`): ``codes``
    index ``names``."""

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


def _turns(offsets: npt.NDArray[np.int64], trained: npt.NDArray[np.bool_]) -> list[list[tuple[int, int]]]:
    """Each sequence's runs of loss mask 1 (generated turns) as response positions ``[start, end)``: one pass over
    the batch, the runs cut at the sequences' ends."""
    count = len(offsets) - 1
    if not trained.size:
        return [[] for _ in range(count)]
    first = np.zeros(trained.size, dtype=bool)
    last = np.zeros(trained.size, dtype=bool)
    nonempty = offsets[1:] > offsets[:-1]
    first[offsets[:-1][nonempty]] = True
    last[offsets[1:][nonempty] - 1] = True
    first[1:] |= ~trained[:-1]
    first[0] = True
    last[:-1] |= ~trained[1:]
    last[-1] = True
    starts = np.flatnonzero(trained & first)
    ends = np.flatnonzero(trained & last) + 1
    cut = np.searchsorted(starts, offsets).tolist()
    starts_list, ends_list, lows = starts.tolist(), ends.tolist(), offsets.tolist()
    return [
        [(a - lows[n], b - lows[n]) for a, b in zip(starts_list[cut[n] : cut[n + 1]], ends_list[cut[n] : cut[n + 1]],
                                                   strict=True)]
        for n in range(count)
    ]  # fmt: skip


def label_sequences(
    sequences: Sequence[Any],
    offsets: npt.NDArray[np.int64],
    trained: npt.NDArray[np.bool_],
    *,
    trainer_version: Any,
    image_window: int,
    history_policy: str | None,
    engine: str | None,
) -> dict[str, Labels]:
    """Each dimension's labels over the batch's response tokens (``offsets`` delimit each sequence's; ``trained``
    marks the tokens of loss mask 1), per sequence for :data:`PER_SEQUENCE`."""
    total = int(offsets[-1])
    # code 0 of a dimension is the label a token has unless something says otherwise: written by the zeros
    defaults = {"resume": ["before_resume"], "image": ["no_image"], "routes": ["routes_unknown"]}
    labels = {
        name: Labels(list(defaults.get(name, [])), np.zeros(len(sequences) if name in PER_SEQUENCE else total,
                                                          dtype=np.int32))
        for name in DIMENSIONS
    }  # fmt: skip
    turns = _turns(offsets, trained)
    bounds = offsets.tolist()
    versions: dict[str, int] = {}  # sampled version -> its label's code
    for number, sample in enumerate(sequences):
        lo, hi = bounds[number], bounds[number + 1]
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        start_version = str(metadata.get("start_weight_version", ""))
        version = labels["version"]
        resume = labels["resume"]
        spans = metadata.get("weight_version_spans") or []
        for sampled, start, end in [(str(span["version"]), lo + int(span["start"]), lo + int(span["end"]))
                                    for span in spans] or [("unknown", lo, hi)]:  # fmt: skip
            if sampled not in versions:
                versions[sampled] = version.code(version_label(sampled, trainer_version))
            version.codes[start:end] = versions[sampled]
            if start_version and spans and sampled != start_version:
                resume.codes[start:end] = resume.code("after_resume")
        sequence = labels["sequence"]
        sequence.codes[number] = sequence.code("first" if int(metadata.get("branch", 0)) == 0 else "branch")
        image = labels["image"]
        observations = metadata.get("observations") or []
        windows = [int(seen["end"]) for seen in observations if _has_image(seen.get("messages"))]
        if (getattr(sample, "multimodal_inputs", None) or {}).get("images"):
            windows.append(0)
        for end in windows:
            image.codes[lo + min(end, hi - lo) : lo + min(end + image_window, hi - lo)] = image.code("near_image")
        _label_routes(labels["routes"], sample, metadata, lo, hi, turns[number])
        for name, given in (("history_policy", history_policy), ("engine", engine)):
            value = metadata.get(name, given)
            labels[name].codes[number] = labels[name].code("unknown" if value is None else str(value))
    return labels


def _label_routes(
    routes: Labels, sample: Any, metadata: Mapping[str, Any], lo: int, hi: int, turns: list[tuple[int, int]]
) -> None:
    spans = metadata.get("routed_expert_spans") or []
    if not spans:
        return  # code 0: routes_unknown
    prompt = len(sample.tokens) - (hi - lo)
    routes.codes[lo:hi] = routes.code("routes_kept")
    for start, end in turns:
        # response token p was produced by row prompt + p - 1
        first, last = prompt + start - 1, prompt + end - 1
        requests = {span["request_id"] for span in spans if span["start"] < last and span["end"] > first}
        if len(requests) > 1:
            routes.codes[lo + start : lo + end] = routes.code("routes_changed")


__all__ = ["DIMENSIONS", "PER_SEQUENCE", "Labels", "label_sequences", "staleness_of", "version_label"]
