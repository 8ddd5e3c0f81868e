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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
    codes: npt.NDArray[np.integer[Any]]
    known: dict[str, int] = field(default_factory=dict, repr=False)  # name -> code: one look-up per use

    def __post_init__(self) -> None:
        self.known = {name: code for code, name in enumerate(self.names)}

    def code(self, name: str) -> int:
        found = self.known.get(name)
        if found is None:
            found = self.known[name] = len(self.names)
            self.names.append(name)
        return found


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


Turns = tuple[list[int], list[int], list[int]]


def _turns(offsets: npt.NDArray[np.int64], trained: npt.NDArray[np.bool_]) -> Turns:
    """The batch's runs of loss mask 1 (generated turns) as flat positions, starts and ends (exclusive), cut at the
    sequences' ends, and where each sequence's runs begin in them (sequence ``n``'s are
    ``cut[n]:cut[n + 1]``): one pass over the batch, and no object per run or per sequence."""
    if not trained.size:
        return [], [], [0] * len(offsets)
    first = np.zeros(trained.size, dtype=bool)
    last = np.zeros(trained.size, dtype=bool)
    nonempty = offsets[1:] > offsets[:-1]
    first[offsets[:-1][nonempty]] = True
    last[offsets[1:][nonempty] - 1] = True
    first[1:] |= ~trained[:-1]
    first[0] = True
    last[:-1] |= ~trained[1:]
    last[-1] = True
    first &= trained
    last &= trained
    starts = np.flatnonzero(first)
    return starts.tolist(), (np.flatnonzero(last) + 1).tolist(), np.searchsorted(starts, offsets).tolist()


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
    # the dimensions with a fixed set of labels (defaults plus one or two) take a byte per token, not four
    labels = {
        name: Labels(list(defaults.get(name, [])), np.zeros(len(sequences) if name in PER_SEQUENCE else total,
                                                          dtype=np.uint8 if name in defaults else np.int32))
        for name in DIMENSIONS
    }  # fmt: skip
    turn_starts, turn_ends, cut = _turns(offsets, trained)
    bounds = offsets.tolist()
    version, resume, image, routes = labels["version"], labels["resume"], labels["image"], labels["routes"]
    version_codes, resume_codes, image_codes = version.codes, resume.codes, image.codes
    versions: dict[str, int] = {}  # sampled version -> its label's code
    per_sequence: dict[str, list[int]] = {name: [] for name in PER_SEQUENCE}
    sequence_codes, policy_codes, engine_codes = (per_sequence[name] for name in PER_SEQUENCE)
    policy_given, engine_given = history_policy, engine
    sequence_label: dict[bool, int] = {}  # first sequence or not -> its code, made when first seen (names' order)
    for number, sample in enumerate(sequences):
        lo, hi = bounds[number], bounds[number + 1]
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        start_version = str(metadata.get("start_weight_version", ""))
        spans = metadata.get("weight_version_spans") or []
        for sampled, start, end in [(str(span["version"]), lo + int(span["start"]), lo + int(span["end"]))
                                    for span in spans] or [("unknown", lo, hi)]:  # fmt: skip
            code = versions.get(sampled)
            if code is None:
                code = versions[sampled] = version.code(version_label(sampled, trainer_version))
            version_codes[start:end] = code
            if start_version and spans and sampled != start_version:
                resume_codes[start:end] = resume.code("after_resume")
        first = int(metadata.get("branch", 0)) == 0
        if first not in sequence_label:
            sequence_label[first] = labels["sequence"].code("first" if first else "branch")
        sequence_codes.append(sequence_label[first])
        observations = metadata.get("observations")
        windows = [int(seen["end"]) for seen in observations or () if _has_image(seen.get("messages"))]
        if (getattr(sample, "multimodal_inputs", None) or {}).get("images"):
            windows.append(0)
        for end in windows:
            image_codes[lo + min(end, hi - lo) : lo + min(end + image_window, hi - lo)] = image.code("near_image")
        route_spans = metadata.get("routed_expert_spans")
        if route_spans:
            runs = slice(cut[number], cut[number + 1])
            turns = zip(turn_starts[runs], turn_ends[runs], strict=True)
            _label_routes(routes, route_spans, len(sample.tokens) - (hi - lo), lo, hi, turns)
        policy = metadata.get("history_policy", policy_given)
        policy_codes.append(labels["history_policy"].code("unknown" if policy is None else str(policy)))
        served = metadata.get("engine", engine_given)
        engine_codes.append(labels["engine"].code("unknown" if served is None else str(served)))
    for name, codes in per_sequence.items():
        labels[name].codes[:] = codes
    return labels


def _label_routes(
    routes: Labels, spans: Sequence[Mapping[str, Any]], prompt: int, lo: int, hi: int, turns: Iterable[tuple[int, int]]
) -> None:
    """``routes_kept`` over the sequence, ``routes_changed`` over its turns (flat ``[start, end)``) whose routes
    came from more than one request."""
    routes.codes[lo:hi] = routes.code("routes_kept")
    for start, end in turns:
        # response token p was produced by row prompt + p - 1
        first, last = prompt + start - lo - 1, prompt + end - lo - 1
        requests = {span["request_id"] for span in spans if span["start"] < last and span["end"] > first}
        if len(requests) > 1:
            routes.codes[start:end] = routes.code("routes_changed")


__all__ = ["DIMENSIONS", "PER_SEQUENCE", "Labels", "label_sequences", "staleness_of", "version_label"]
