"""vLLM's multimodal feature wire format without vLLM: one ``MultiModalKwargsItem`` as base64 msgpack.

vLLM's render endpoint sends each image's processed inputs as ``features.kwargs_data["image"][i]``: the base64 of
the msgpack that ``MsgpackEncoder(size_threshold=2**62)`` (``vllm/v1/serial_utils.py``) makes of one
``MultiModalKwargsItem``, every tensor inline (``...token_in_token_out.mm_serde.encode_mm_kwargs_item``, vLLM
0.26 to 0.33). This module reads and writes that format with ``msgpack`` and torch alone, so a trainer without vLLM
can decode features, and a fake or embedded engine can produce them. Decoded tensors are bit-identical to what
vLLM's own decoder returns, and re-encoding a decoded item gives vLLM's bytes back.

The format, in msgpack terms::

    item     = map {field name: elem}
    elem     = map {"data": nested | nil, "field": [kind, options]}
    nested   = tensor | int | float | array of nested
    tensor   = array [dtype, shape, ext(3, raw bytes)]
    kind     = "batched" | "flat" | "shared"
    options  = map of the field dataclass's attributes, in declaration order:
               {"keep_on_cpu"} (batched), {"keep_on_cpu", "slices", "dim"} (flat),
               {"keep_on_cpu", "batch_size"} (shared)
    slices   = array of slice, or array of arrays of slice;  slice = array [start, stop, step] (int or nil)

``dtype`` is the torch dtype's name without ``torch.`` (``float32``, ``bfloat16``, ``int64``, ...), ``shape`` an
array of ints, and the raw bytes are the tensor's elements in C order and native (little-endian) byte order.
An array whose first element is a string is a tensor; any other array is a list of nested values. Ext type 3 is
vLLM's ``CUSTOM_TYPE_RAW_VIEW``; types 1 and 2 (pickle, cloudpickle) are refused, and so are tensors stored out
of band (an int buffer index or a dict instead of the ext), which the render endpoint never sends.

torch is imported only when a tensor is decoded or encoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]  # ships no type information

from fsm_rollout.errors import FeatureCodecError

if TYPE_CHECKING:
    import torch

RAW_VIEW_EXT_TYPE = 3
"""vLLM's ``CUSTOM_TYPE_RAW_VIEW``: an ext holding a tensor's raw bytes inline."""

_PICKLE_EXT_TYPES = {1: "pickle", 2: "cloudpickle"}
FIELD_KINDS = ("batched", "flat", "shared")
"""The field kinds vLLM's encoder knows (``MMF_CLASS_TO_FACTORY``); others are kept as they come."""


@dataclass(frozen=True)
class FieldSpec:
    """How vLLM batches one keyword argument across items: the ``field`` of an element, as sent on the wire.

    ``kind`` is the ``MultiModalFieldConfig`` factory name and ``options`` its keyword arguments in wire order.
    A ``flat`` field's ``slices`` are ``slice`` objects (or tuples of them, for ``dim > 0``), covering every item
    of the batch the item came from.
    """

    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def batched(cls, *, keep_on_cpu: bool = False) -> FieldSpec:
        """Items are rows of the batch tensor (vLLM's ``MultiModalFieldConfig.batched``)."""
        return cls("batched", {"keep_on_cpu": keep_on_cpu})

    @classmethod
    def flat(cls, slices: Sequence[Any], dim: int = 0, *, keep_on_cpu: bool = False) -> FieldSpec:
        """Items are slices of the batch tensor along ``dim`` (vLLM's ``MultiModalFieldConfig.flat``)."""
        return cls("flat", {"keep_on_cpu": keep_on_cpu, "slices": list(slices), "dim": dim})

    @classmethod
    def flat_from_sizes(cls, sizes: Sequence[int], dim: int = 0, *, keep_on_cpu: bool = False) -> FieldSpec:
        """Consecutive slices of the given sizes along ``dim`` (vLLM's ``flat_from_sizes``)."""
        slices: list[tuple[slice, ...]] = []
        start = 0
        for size in sizes:
            slices.append((slice(None),) * dim + (slice(start, start + int(size)),))
            start += int(size)
        return cls.flat(slices, dim, keep_on_cpu=keep_on_cpu)

    @classmethod
    def shared(cls, batch_size: int, *, keep_on_cpu: bool = False) -> FieldSpec:
        """Every item holds the whole data (vLLM's ``MultiModalFieldConfig.shared``)."""
        return cls("shared", {"keep_on_cpu": keep_on_cpu, "batch_size": batch_size})


@dataclass(frozen=True)
class FieldElem:
    """One keyword argument of one item: its data (a tensor, a number or a list of them, or None) and field."""

    data: Any
    field: FieldSpec


class KwargsItem(dict[str, FieldElem]):
    """One decoded multimodal item: field name to :class:`FieldElem` (vLLM's ``MultiModalKwargsItem``)."""

    def get_data(self) -> dict[str, Any]:
        """Field name to data, like vLLM's ``MultiModalKwargsItem.get_data``."""
        return {key: elem.data for key, elem in self.items()}


# ---------------------------------------------------------------------------------------------------- decoding


def decode_item(text: str) -> KwargsItem:
    """Decode one ``kwargs_data`` entry (base64 text) into a :class:`KwargsItem`.

    Raises :class:`~fsm_rollout.errors.FeatureCodecError` when the text is not base64 or the payload is not
    an item in vLLM's format.
    """
    if not isinstance(text, str):
        raise FeatureCodecError(f"a feature item must be base64 text, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise FeatureCodecError(f"a feature item is not valid base64: {error}") from error
    return decode_item_msgpack(raw)


def decode_item_msgpack(raw: bytes) -> KwargsItem:
    """Decode the msgpack bytes of one item (the payload under the base64)."""
    try:
        payload = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as error:
        raise FeatureCodecError(f"a feature item is not valid msgpack: {error}") from error
    if not isinstance(payload, dict):
        raise FeatureCodecError(f"a feature item must be a msgpack map, got {type(payload).__name__}")
    item = KwargsItem()
    for key, elem in payload.items():
        item[key] = _decode_elem(elem, key)
    return item


def decode_item_tensors(text: str) -> dict[str, Any]:
    """Decode one ``kwargs_data`` entry straight to ``{field name: tensor}`` (nested data as lists)."""
    return decode_item(text).get_data()


def _decode_elem(elem: Any, key: str) -> FieldElem:
    if not isinstance(elem, dict) or "data" not in elem or "field" not in elem:
        raise FeatureCodecError(f"field {key!r}: expected a map with 'data' and 'field', got {elem!r:.120}")
    spec = elem["field"]
    if not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str) or not isinstance(spec[1], dict):
        raise FeatureCodecError(f"field {key!r}: 'field' must be [kind, options], got {spec!r:.120}")
    kind, options = spec
    if kind == "flat" and "slices" in options:
        options = {**options, "slices": _decode_slices(options["slices"], key)}
    data = None if elem["data"] is None else _decode_nested(elem["data"], key)
    return FieldElem(data=data, field=FieldSpec(kind, options))


def _decode_slices(value: Any, key: str) -> Any:
    if not isinstance(value, list):
        raise FeatureCodecError(f"field {key!r}: flat slices must be arrays, got {value!r:.120}")
    if value and not isinstance(value[0], list):
        if len(value) != 3 or not all(bound is None or _is_int(bound) for bound in value):
            raise FeatureCodecError(f"field {key!r}: a slice must be [start, stop, step], got {value!r:.120}")
        return slice(*value)
    # Top level: a list of per-item slices; below it, a tuple of per-dimension slices (as vLLM builds them).
    return [_decode_slice_group(group, key) for group in value]


def _decode_slice_group(value: Any, key: str) -> Any:
    decoded = _decode_slices(value, key)
    return decoded if isinstance(decoded, slice) else tuple(decoded)


def _decode_nested(value: Any, key: str) -> Any:
    if isinstance(value, bool | int | float):  # vLLM allows plain numbers as data
        return value
    if not isinstance(value, list):
        raise FeatureCodecError(f"field {key!r}: unexpected data of type {type(value).__name__}")
    if value and isinstance(value[0], str):
        return decode_tensor(value, key=key)
    return [_decode_nested(part, key) for part in value]


def decode_tensor(value: Any, *, key: str = "?") -> torch.Tensor:
    """Decode one wire tensor ``[dtype, shape, ext(3, raw bytes)]`` into a torch tensor that owns its memory."""
    import torch

    if not isinstance(value, list) or len(value) != 3:
        raise FeatureCodecError(f"field {key!r}: a tensor must be [dtype, shape, data], got {value!r:.120}")
    dtype_name, shape, payload = value
    torch_dtype = _torch_dtype(dtype_name, key)
    if not isinstance(shape, list) or not all(_is_int(size) and size >= 0 for size in shape):
        raise FeatureCodecError(f"field {key!r}: tensor shape must be non-negative ints, got {shape!r:.120}")
    if isinstance(payload, int | dict):
        raise FeatureCodecError(
            f"field {key!r}: the tensor is stored out of band ({type(payload).__name__} reference); render "
            "features must carry every tensor inline"
        )
    if not isinstance(payload, msgpack.ExtType):
        raise FeatureCodecError(f"field {key!r}: tensor data must be a msgpack ext, got {type(payload).__name__}")
    if payload.code != RAW_VIEW_EXT_TYPE:
        kind = _PICKLE_EXT_TYPES.get(payload.code, "unknown")
        raise FeatureCodecError(
            f"field {key!r}: msgpack ext type {payload.code} ({kind}) is not a raw tensor buffer; refused"
        )
    raw = payload.data
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(raw) != expected:
        raise FeatureCodecError(
            f"field {key!r}: a {dtype_name} tensor of shape {shape} needs {expected} bytes, got {len(raw)}"
        )
    if not raw:
        return torch.empty(shape, dtype=torch_dtype)
    # bytearray: the tensor gets its own writable memory (vLLM clones inline tensors too).
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype).view(shape)


def _torch_dtype(name: Any, key: str) -> torch.dtype:
    import torch

    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise FeatureCodecError(f"field {key!r}: invalid tensor dtype {name!r:.60}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FeatureCodecError(f"field {key!r}: {name!r} is not a torch dtype")
    return dtype


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------- encoding


def encode_item(item: Mapping[str, FieldElem]) -> str:
    """Encode one item as vLLM's render does: base64 text of the msgpack, every tensor inline."""
    return base64.b64encode(encode_item_msgpack(item)).decode("ascii")


def encode_item_msgpack(item: Mapping[str, FieldElem]) -> bytes:
    """The msgpack bytes of one item (byte-identical to vLLM's ``MsgpackEncoder`` for the same item)."""
    payload: dict[str, Any] = {}
    for key, elem in item.items():
        if not isinstance(key, str):
            raise FeatureCodecError(f"field names must be strings, got {key!r}")
        if not isinstance(elem, FieldElem):
            raise FeatureCodecError(f"field {key!r}: expected a FieldElem, got {type(elem).__name__}")
        payload[key] = {
            "data": None if elem.data is None else _encode_nested(elem.data, key),
            "field": [elem.field.kind, _encode_options(elem.field, key)],
        }
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


def _encode_options(spec: FieldSpec, key: str) -> dict[str, Any]:
    options = dict(spec.options)
    if "slices" in options:
        options["slices"] = _encode_slices(options["slices"], key)
    return options


def _encode_slices(value: Any, key: str) -> Any:
    if isinstance(value, slice):
        return [_slice_bound(bound, key) for bound in (value.start, value.stop, value.step)]
    if isinstance(value, list | tuple):
        return [_encode_slices(part, key) for part in value]
    raise FeatureCodecError(f"field {key!r}: slices must be slice objects, got {type(value).__name__}")


def _slice_bound(bound: Any, key: str) -> int | None:
    if bound is None:
        return None
    try:
        return int(bound)
    except (TypeError, ValueError) as error:
        raise FeatureCodecError(f"field {key!r}: slice bounds must be integers, got {bound!r}") from error


def _encode_nested(value: Any, key: str) -> Any:
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_encode_nested(part, key) for part in value]
    return encode_tensor(value, key=key)


def encode_tensor(value: Any, *, key: str = "?") -> list[Any]:
    """One tensor (torch, or a numpy array, taken as the torch tensor sharing its data) in wire form."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OV":
            raise FeatureCodecError(f"field {key!r}: numpy arrays of dtype {value.dtype} cannot be encoded")
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise FeatureCodecError(f"field {key!r}: cannot encode data of type {type(value).__name__}")
    raw = value.detach().flatten().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    dtype_name = str(value.dtype).removeprefix("torch.")
    return [dtype_name, list(value.shape), msgpack.ExtType(RAW_VIEW_EXT_TYPE, raw)]


# ---------------------------------------------------------------------------------------------------- builders


def qwen_vl_image_items(pixel_values: Any, image_grid_thw: Any) -> list[KwargsItem]:
    """Split one processor batch into per-image items the way vLLM's Qwen2-VL processor does.

    ``pixel_values`` is ``(sum of t*h*w, patch_dim)``; ``image_grid_thw`` is ``(num_images, 3)``. Each item
    holds its image's rows of ``pixel_values`` (a ``flat`` field sized by ``t*h*w``) and its 1-D grid row (a
    ``batched`` field kept on the CPU).
    """
    grids = image_grid_thw.reshape(-1, 3)
    sizes = [int(size) for size in grids.prod(-1).tolist()]
    if sum(sizes) != pixel_values.shape[0]:
        raise FeatureCodecError(
            f"pixel_values has {pixel_values.shape[0]} rows but image_grid_thw sums to {sum(sizes)} patches"
        )
    pixel_field = FieldSpec.flat_from_sizes(sizes)
    grid_field = FieldSpec.batched(keep_on_cpu=True)
    items: list[KwargsItem] = []
    for index, item_slices in enumerate(pixel_field.options["slices"]):
        items.append(
            KwargsItem(
                pixel_values=FieldElem(pixel_values[item_slices], pixel_field),
                image_grid_thw=FieldElem(grids[index], grid_field),
            )
        )
    return items


def render_features(
    image_items: Sequence[Mapping[str, FieldElem]],
    placeholders: Sequence[tuple[int, int]],
    hashes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A render answer's ``features`` for images: hashes, placeholder ranges and the encoded items.

    ``placeholders`` holds one ``(offset, length)`` per image. ``hashes`` default to the SHA-256 of each
    encoded item (vLLM hashes the image and processor options instead; only uniqueness matters here).
    """
    if len(placeholders) != len(image_items) or (hashes is not None and len(hashes) != len(image_items)):
        raise FeatureCodecError("render_features needs one placeholder (and hash) per image item")
    encoded = [encode_item(item) for item in image_items]
    item_hashes = (
        list(hashes) if hashes is not None else [hashlib.sha256(text.encode()).hexdigest() for text in encoded]
    )
    return {
        "mm_hashes": {"image": item_hashes},
        "mm_placeholders": {"image": [{"offset": offset, "length": length} for offset, length in placeholders]},
        "kwargs_data": {"image": encoded},
        "mm_metadata": None,
    }
