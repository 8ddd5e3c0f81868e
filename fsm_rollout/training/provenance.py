"""Internal: one training sequence's tokens with their provenance, as the arrays the tree compares and keeps.

A sequence is a :class:`~fsm_rollout.sample.Sample` (a rollout's last sequence or one of its ``branches``). Its
``tokens`` are the whole context; ``loss_mask`` and ``rollout_log_probs`` cover only the response side, so the
prompt's tokens get mask 0 and logprob 0.0 here, as a flat trainer row would give them.

Per token the arrays hold:

* ``ids``, ``mask`` and ``logprob`` (float64, compared bit for bit);
* ``version``: an interned weight version (from ``metadata["weight_version_spans"]``), -1 for none;
* ``routed``: an interned routing row (``rollout_routed_experts[i]`` routes token ``i``; the last token has no
  row), -1 where not recorded, with ``routed_seq``/``routed_row`` saying where the row lives;
* ``mm``: an interned multimodal key, -1 for none. With ``image_token_id`` each image placeholder token gets
  ``(image content hash, its place in the image)`` and ``img``/``img_k``/``img_seq``/``img_index`` say which image
  it belongs to; features besides the images' (and every token, when placeholders cannot be found) get the digest
  of the sequence's features, so such sequences merge only with sequences whose features are identical.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fsm_rollout.errors import RolloutError
from fsm_rollout.sample import Sample

IntArray = npt.NDArray[np.int64]
FIELDS: tuple[str, ...] = (
    "ids",
    "mask",
    "logprob",
    "version",
    "routed",
    "routed_seq",
    "routed_row",
    "mm",
    "img",
    "img_k",
    "img_seq",
    "img_index",
)
"""Every per-token array, in the order :class:`Tokens` keeps them."""

IMAGE_FEATURES = ("pixel_values", "image_grid_thw")
"""The multimodal train inputs that describe images (split per image by the grid)."""


class TreeBuildError(RolloutError, ValueError):
    """A sequence cannot go into a token tree (its arrays disagree, or its images cannot be placed)."""


class Interner:
    """Small integer ids for hashable keys (weight versions, routing rows, image keys), shared by a whole build."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.keys: list[Any] = []

    def __call__(self, key: Any) -> int:
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.keys)
            self.keys.append(key)
        return found


KEPT_ROWS = 4
"""``ids``, ``mask``, ``logprob`` and ``version``: the rows every token has, the first of :data:`FIELDS`."""

_ABSENT: list[IntArray] = [np.full(0, -1, dtype=np.int64)]
"""A read-only run of -1 the sequences without routing or images read their absent rows from (grown on demand)."""


def absent(size: int) -> IntArray:
    """``size`` read-only -1 entries (a view: nothing is allocated per call)."""
    if len(_ABSENT[0]) < size:
        grown = np.full(max(size, 2 * len(_ABSENT[0]), 4096), -1, dtype=np.int64)
        grown.flags.writeable = False
        _ABSENT[0] = grown
    return _ABSENT[0][:size]


class Tokens:
    """A run of tokens' arrays (a whole sequence, or a node's span), one int64 row per name in :data:`FIELDS`.

    ``data`` holds the first :data:`KEPT_ROWS` (``logprob`` is its row's bits as float64); ``extra`` the routing and
    multimodal rows, or None when the run recorded none (most sequences): then those rows read as -1 without being
    stored, so a batch's memory holds only what was recorded."""

    __slots__ = ("data", "extra")

    def __init__(self, data: IntArray, extra: IntArray | None = None) -> None:
        self.data = data
        self.extra = extra

    def __len__(self) -> int:
        return int(self.data.shape[1])

    def _row(self, number: int) -> IntArray:
        if number < KEPT_ROWS:
            row: IntArray = self.data[number]
            return row
        if self.extra is None:
            return absent(len(self))
        extra: IntArray = self.extra[number - KEPT_ROWS]
        return extra

    def recorded(self) -> IntArray:
        """The routing and multimodal rows, stored from now on (all -1 where nothing was recorded yet)."""
        if self.extra is None:
            self.extra = np.full((len(FIELDS) - KEPT_ROWS, len(self)), -1, dtype=np.int64)
        return self.extra

    def cut(self, start: int, end: int | None = None) -> Tokens:
        return Tokens(self.data[:, start:end], None if self.extra is None else self.extra[:, start:end])

    def copy(self) -> Tokens:
        return Tokens(self.data.copy(), None if self.extra is None else self.extra.copy())

    def rows(self) -> IntArray:
        """All of :data:`FIELDS` as one array (a copy)."""
        extra = self.extra if self.extra is not None else np.full((len(FIELDS) - KEPT_ROWS, len(self)), -1)
        return np.concatenate((self.data, extra))

    @property
    def logprob(self) -> npt.NDArray[np.float64]:
        return self._row(2).view(np.float64)

    @property
    def ids(self) -> IntArray:
        return self._row(0)

    @property
    def mask(self) -> IntArray:
        return self._row(1)

    @property
    def version(self) -> IntArray:
        return self._row(3)

    @property
    def routed(self) -> IntArray:
        return self._row(4)

    @property
    def routed_seq(self) -> IntArray:
        return self._row(5)

    @property
    def routed_row(self) -> IntArray:
        return self._row(6)

    @property
    def mm(self) -> IntArray:
        return self._row(7)

    @property
    def img(self) -> IntArray:
        return self._row(8)

    @property
    def img_k(self) -> IntArray:
        return self._row(9)

    @property
    def img_seq(self) -> IntArray:
        return self._row(10)

    @property
    def img_index(self) -> IntArray:
        return self._row(11)


@dataclass(frozen=True)
class Intern:
    """The interners one build shares."""

    versions: Interner
    routing: Interner
    mm: Interner
    images: Interner


def sequence_tokens(
    sample: Sample, number: int, image_token_id: int | None, intern: Intern, *, stored: bool = False
) -> Tokens:
    """The arrays of training sequence ``number`` (its place in :func:`training_sequences` order); with ``stored``
    every row is stored even where nothing was recorded (the reference build's layout)."""
    tokens = np.asarray(sample.tokens, dtype=np.int64).reshape(-1)
    size = len(tokens)
    response = int(sample.response_length)
    prompt = size - response
    if prompt < 0:
        raise TreeBuildError(f"{_name(sample, number)}: response_length {response} exceeds its {size} tokens")
    mask = np.zeros(size, dtype=np.int64)
    mask[prompt:] = (
        1 if sample.loss_mask is None else _flags(_response(sample.loss_mask, response, "loss_mask", sample, number))
    )
    logprob = np.zeros(size, dtype=np.float64)
    if sample.rollout_log_probs is not None:
        logprob[prompt:] = _response(sample.rollout_log_probs, response, "rollout_log_probs", sample, number)
    out = Tokens(np.empty((KEPT_ROWS, size), dtype=np.int64))
    out.data[0], out.data[1], out.data[2], out.data[3] = tokens, mask, logprob.view(np.int64), -1
    if stored:
        out.recorded()
    _place_versions(out, sample, prompt, intern.versions)
    _place_routing(out, sample, number, intern.routing)
    _place_multimodal(out, sample, number, image_token_id, intern)
    return out


def batch_tokens(sequences: Sequence[Sample], image_token_id: int | None, intern: Intern) -> list[Tokens]:
    """What :func:`sequence_tokens` gives for each of ``sequences``, their kept rows read into one array for the
    whole batch: token ids and logprobs written straight from their lists into it by ``struct`` (several times
    faster than numpy reads a list, and one allocation instead of several per sequence). A sequence whose lists
    ``struct`` refuses (not plain numbers, not lists) is read by :func:`sequence_tokens`, which converts it (or
    raises) as it always does."""
    sizes = [len(sample.tokens) if type(sample.tokens) is list else 0 for sample in sequences]
    data = np.empty((KEPT_ROWS, sum(sizes)), dtype=np.int64)
    data[1:3] = 0
    data[3] = -1
    ids = data[0]
    layouts: dict[tuple[int, str], struct.Struct] = {}
    out: list[Tokens] = []
    start = 0
    for number, (sample, size) in enumerate(zip(sequences, sizes, strict=True)):
        tokens = _fast_tokens(sample, data, start, size, layouts) if size else None
        if tokens is None:
            ids[start : start + size] = -1  # unused: this sequence's arrays are its own
            tokens = sequence_tokens(sample, number, image_token_id, intern)
        else:
            prompt = size - int(sample.response_length)
            _place_versions(tokens, sample, prompt, intern.versions)
            _place_routing(tokens, sample, number, intern.routing)
            _place_multimodal(tokens, sample, number, image_token_id, intern)
        out.append(tokens)
        start += size
    return out


def _fast_tokens(
    sample: Sample, data: IntArray, start: int, size: int, layouts: dict[tuple[int, str], struct.Struct]
) -> Tokens | None:
    """A sequence's kept rows written into ``data`` from ``start``; None (nothing raised) for anything
    but plain lists of the right lengths, which :func:`sequence_tokens` then reads, converts or names."""
    response = int(sample.response_length)
    prompt = size - response
    logprobs, mask = sample.rollout_log_probs, sample.loss_mask
    if prompt < 0 or not (logprobs is None or (type(logprobs) is list and len(logprobs) == response)):
        return None
    if not (mask is None or (type(mask) is list and len(mask) == response)):
        return None
    try:
        _layout(layouts, size, "q").pack_into(data[0].data, 8 * start, *sample.tokens)
        if logprobs:
            _layout(layouts, response, "d").pack_into(data[2].data, 8 * (start + prompt), *logprobs)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    stop = start + size
    data[1, start + prompt : stop] = 1 if mask is None else _flags(mask)
    return Tokens(data[:, start:stop])


def _layout(layouts: dict[tuple[int, str], struct.Struct], size: int, code: str) -> struct.Struct:
    layout = layouts.get((size, code))
    if layout is None:
        layout = layouts[size, code] = struct.Struct(f"={size}{code}")
    return layout


def _flags(values: Any) -> Any:
    """A list of small non-negative ints (a loss mask) read through ``bytes``, several times faster than numpy
    reads a list; anything else as it is, for numpy to convert."""
    if isinstance(values, list):
        try:
            return np.frombuffer(bytes(values), dtype=np.uint8)
        except (TypeError, ValueError):
            pass
    return values


def _response(values: Any, response: int, name: str, sample: Sample, number: int) -> Any:
    if len(values) != response:
        raise TreeBuildError(
            f"{_name(sample, number)}: {name} has {len(values)} entries for response_length {response}"
        )
    return values


def _place_versions(out: Tokens, sample: Sample, prompt: int, versions: Interner) -> None:
    spans = sample.metadata.get("weight_version_spans") if isinstance(sample.metadata, Mapping) else None
    if spans:
        for span in spans:
            out.version[prompt + int(span["start"]) : prompt + int(span["end"])] = versions(str(span["version"]))
    elif len(set(sample.weight_versions)) == 1:  # one version for the whole sequence: its generated tokens
        out.version[out.mask == 1] = versions(str(sample.weight_versions[0]))


def _place_routing(out: Tokens, sample: Sample, number: int, routing: Interner) -> None:
    experts = sample.rollout_routed_experts
    if experts is None:
        return
    rows = np.asarray(experts)
    if rows.ndim == 0 or rows.shape[0] > len(out):
        raise TreeBuildError(
            f"{_name(sample, number)}: rollout_routed_experts has {rows.shape[:1]} rows for {len(out)} tokens"
        )
    if rows.shape[0] == 0:
        return
    flat = np.ascontiguousarray(rows.reshape(rows.shape[0], -1), dtype=np.int32)
    out.recorded()
    for row in range(flat.shape[0]):
        out.routed[row] = routing(flat[row].tobytes())
    out.routed_seq[: flat.shape[0]] = number
    out.routed_row[: flat.shape[0]] = np.arange(flat.shape[0])


def _place_multimodal(out: Tokens, sample: Sample, number: int, image_token_id: int | None, intern: Intern) -> None:
    features = sample.multimodal_train_inputs
    if not features:
        return
    arrays = {key: _array(value) for key, value in features.items() if value is not None}
    if any(isinstance(value, Mapping | str) for value in features.values()):
        # a results file's summaries (dtype and shape) say nothing of the pixels: the images themselves stand for
        # them, and the features bind the whole sequence
        shown = (sample.multimodal_inputs or {}).get("images") if isinstance(sample.multimodal_inputs, dict) else None
        arrays["images"] = np.frombuffer(json.dumps(shown, sort_keys=True, default=str).encode(), dtype=np.uint8)
        images = None
    else:
        images = _image_hashes(arrays, sample, number)
    other = {key: value for key, value in arrays.items() if key not in IMAGE_FEATURES}
    out.recorded()
    if image_token_id is None or images is None:
        out.mm[:] = intern.mm(("features", _digest(arrays)))  # nothing finer is known: the features as a whole
        return
    if other:  # features not tied to an image placeholder: they bind every token of the sequence
        out.mm[:] = intern.mm(("features", _digest(other)))
    starts, lengths = _runs(out.ids == image_token_id)
    if len(starts) != len(images):
        raise TreeBuildError(
            f"{_name(sample, number)}: {len(images)} images in multimodal_train_inputs but {len(starts)} runs of "
            f"the image placeholder token {image_token_id} in its tokens"
        )
    for index, (start, length, content) in enumerate(zip(starts, lengths, images, strict=True)):
        image = intern.images(content)
        for k in range(length):
            out.mm[start + k] = intern.mm(("image", content, k))
        out.img[start : start + length] = image
        out.img_k[start : start + length] = np.arange(length)
        out.img_seq[start : start + length] = number
        out.img_index[start : start + length] = index


def _image_hashes(arrays: Mapping[str, npt.NDArray[Any]], sample: Sample, number: int) -> list[str] | None:
    """One content hash per image (its pixel rows and grid), or None when the features hold no images."""
    pixels, grid = arrays.get("pixel_values"), arrays.get("image_grid_thw")
    if pixels is None or grid is None:
        return None
    grid = grid.reshape(-1, 3)
    rows = [int(np.prod(each)) for each in grid]
    if sum(rows) != pixels.shape[0]:
        raise TreeBuildError(
            f"{_name(sample, number)}: image_grid_thw covers {sum(rows)} pixel rows but pixel_values has "
            f"{pixels.shape[0]}"
        )
    bounds = np.cumsum([0, *rows])
    return [
        "sha256:" + _digest({"pixel_values": pixels[bounds[i] : bounds[i + 1]], "image_grid_thw": grid[i]})
        for i in range(len(rows))
    ]


def _runs(flags: npt.NDArray[np.bool_]) -> tuple[list[int], list[int]]:
    edges = np.diff(np.concatenate(([0], flags.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts.tolist(), (ends - starts).tolist()


def _array(value: Any) -> npt.NDArray[Any]:
    if hasattr(value, "detach"):  # a tensor: read without importing torch
        value = value.detach().cpu()
        value = value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()
    array = np.asarray(value) if not isinstance(value, Mapping | str) else np.asarray(None, dtype=object)
    if array.dtype == object:  # a summary a results file wrote (dtype and shape), not the values: hash its text
        return np.frombuffer(json.dumps(value, sort_keys=True, default=str).encode(), dtype=np.uint8)
    return array


def _digest(arrays: Mapping[str, npt.NDArray[Any]]) -> str:
    digest = hashlib.sha256()
    for key in sorted(arrays):
        array = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}|{array.dtype}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:32]


def _name(sample: Sample, number: int) -> str:
    return f"training sequence {number} (sample index={sample.index}, branch={sample.metadata.get('branch')})"


__all__ = [
    "FIELDS",
    "KEPT_ROWS",
    "Intern",
    "Interner",
    "Tokens",
    "TreeBuildError",
    "absent",
    "batch_tokens",
    "sequence_tokens",
]
