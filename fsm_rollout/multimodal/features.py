"""Training features from render answers: ``features.kwargs_data["image"]`` items decoded into tensors.

Items are decoded with vLLM's codec when it is importable, else with :mod:`fsm_rollout.multimodal.codec` (same wire
format, bit-identical tensors).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

from fsm_rollout.errors import (
    FeatureCodecError,
    ImageFeaturesMissingError,
    MalformedFeaturesError,
    MultimodalError,
)
from fsm_rollout.multimodal._prefix import sample_prefix

VLLM_MM_SERDE_MODULES = (
    "vllm.entrypoints.scale_out.token_in_token_out.mm_serde",
    "vllm.frontend.entrypoints.scale_out.token_in_token_out.mm_serde",
    "vllm.entrypoints.serve.disagg.mm_serde",
)
"""Where vLLM versions keep ``decode_mm_kwargs_item``, newest layout first."""

NULL_ITEM_ADVICE = (
    "start the server with --mm-processor-cache-gb 0 so render always sends the image tensors, and do not set "
    "mm_payload='none' (or return_mm_kwargs=false) on the render request"
)


@functools.cache
def _vllm_item_decoder() -> Callable[[str], Any] | None:
    for name in VLLM_MM_SERDE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # vLLM absent, or installed but unable to import here: the built-in codec decodes
            continue
        decoder = getattr(module, "decode_mm_kwargs_item", None)
        if callable(decoder):
            return decoder  # type: ignore[no-any-return]
    return None


def feature_item_decoder() -> Callable[[str], Any]:
    """The ``kwargs_data`` item decoder in use: vLLM's ``decode_mm_kwargs_item`` when importable, else the
    built-in :func:`fsm_rollout.multimodal.codec.decode_item`. Both return an object with ``get_data()``."""
    decoder = _vllm_item_decoder()
    if decoder is not None:
        return decoder
    from fsm_rollout.multimodal.codec import decode_item

    return decode_item


def decode_train_features(
    features: Any, *, sample_id: Any = None, decoder: Callable[[str], Any] | None = None
) -> dict[str, Any] | None:
    """Decode render ``features.kwargs_data["image"]`` into training tensors (``pixel_values``, ``image_grid_thw``).

    Returns None when there are no image features. Only tensor values are kept; a 1-D ``image_grid_thw`` is
    reshaped to ``(1, 3)``; several images are concatenated along dim 0 in image order. ``decoder`` replaces
    :func:`feature_item_decoder` (tests use it to pin one codec).

    Raises :class:`~fsm_rollout.errors.MalformedFeaturesError` for features of the wrong shape,
    :class:`~fsm_rollout.errors.ImageFeaturesMissingError` when images are named but their tensors are not sent
    (a ``null`` item is vLLM's cache hit), and :class:`~fsm_rollout.errors.FeatureCodecError` when an item
    cannot be decoded.
    """
    prefix = sample_prefix(sample_id)
    if not features:
        return None
    decoded = _features_mapping(features, prefix)
    image_hashes = _image_hash_count(decoded, prefix)
    kwargs_data = decoded.get("kwargs_data")
    if kwargs_data is not None and not isinstance(kwargs_data, dict):
        raise MalformedFeaturesError(f"{prefix}features.kwargs_data must be a dictionary or null")
    if kwargs_data is None or "image" not in kwargs_data:
        if image_hashes:
            raise ImageFeaturesMissingError(
                f"{prefix}render features name {image_hashes} image(s) in mm_hashes but carry no image tensors "
                f"(kwargs_data has no 'image' list): {NULL_ITEM_ADVICE}"
            )
        return None
    items = kwargs_data["image"]
    if not isinstance(items, list):
        raise MalformedFeaturesError(f"{prefix}features.kwargs_data.image must be a list")
    if image_hashes is not None and image_hashes != len(items):
        raise MalformedFeaturesError(
            f"{prefix}features name {image_hashes} image(s) in mm_hashes but kwargs_data.image has {len(items)}"
        )
    missing = [index for index, item in enumerate(items) if item is None]
    if missing:
        raise ImageFeaturesMissingError(
            f"{prefix}features.kwargs_data.image{missing} is null (vLLM's multimodal cache hit): {NULL_ITEM_ADVICE}"
        )
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise MalformedFeaturesError(
                f"{prefix}features.kwargs_data.image[{index}] must be base64 text, got {type(item).__name__}"
            )
    if not items:
        return None
    decode = decoder or feature_item_decoder()
    return _merge_items([_decode_one(decode, item, index, prefix) for index, item in enumerate(items)], prefix)


def _features_mapping(features: Any, prefix: str) -> dict[str, Any]:
    if isinstance(features, str):
        try:
            features = json.loads(features)
        except json.JSONDecodeError as error:
            raise MalformedFeaturesError(f"{prefix}render features are a string but not JSON: {error}") from error
    if not isinstance(features, dict):
        raise MalformedFeaturesError(
            f"{prefix}vLLM features must decode to a dictionary, got {type(features).__name__}"
        )
    return features


def _image_hash_count(features: dict[str, Any], prefix: str) -> int | None:
    mm_hashes = features.get("mm_hashes")
    if not isinstance(mm_hashes, dict) or mm_hashes.get("image") is None:
        return None
    hashes = mm_hashes["image"]
    if not isinstance(hashes, list):
        raise MalformedFeaturesError(f"{prefix}features.mm_hashes.image must be a list")
    return len(hashes)


def _decode_one(decode: Callable[[str], Any], item: str, index: int, prefix: str) -> dict[str, Any]:
    try:
        data = decode(item).get_data()
    except FeatureCodecError as error:
        raise FeatureCodecError(f"{prefix}features.kwargs_data.image[{index}]: {error}") from error
    except Exception as error:  # vLLM's decoder raises whatever msgspec/torch raise
        raise FeatureCodecError(
            f"{prefix}features.kwargs_data.image[{index}] cannot be decoded: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(data, dict):
        raise FeatureCodecError(f"{prefix}features.kwargs_data.image[{index}] did not decode to a field map")
    return data


def _merge_items(items: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    import torch

    parts_by_key: dict[str, list[Any]] = {}
    for data in items:
        for key, value in data.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "image_grid_thw" and value.dim() == 1:
                value = value.reshape(1, -1)
            parts_by_key.setdefault(key, []).append(value)
    merged: dict[str, Any] = {}
    for key, values in parts_by_key.items():
        if len(values) == 1:
            merged[key] = values[0]
            continue
        try:
            merged[key] = torch.cat(values, dim=0)
        except RuntimeError as error:
            shapes = [tuple(value.shape) for value in values]
            raise MultimodalError(
                f"{prefix}image feature {key!r} cannot be concatenated across images (shapes {shapes}): {error}"
            ) from error
    return merged
