"""Images in observations: limits on their size, and the engine's features of an observation placed in the sample.

An image observation is rendered by the engine after a dummy prefix, so the engine expands the placeholders and
encodes the images; only the boundary suffix is kept (as for text). The functions here take that render answer's
``features`` and make them the sample's:

* :func:`check_observation_parts` refuses media the rollout does not take (video, audio) with a typed error;
* :func:`check_image_limits` refuses images over the configured byte and pixel limits before anything decodes
  their pixels (a decompression bomb is refused from its header);
* :func:`place_features` shifts the new items' placeholder offsets from the dummy render to their place in the
  sample's sequence, fills items the engine left out (its processor-cache hit) from the sample's own items with
  the same hash, and refuses what it cannot fill: a generate request must never carry a null item;
* :func:`check_observation_tokens` is the prompt path's image-token check, for the observation alone;
* :func:`merge_features` appends placed features to the sample's cumulative ones, in image order.

Features are vLLM's render ``features``: ``{"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"}``, each
(but the placeholders) ``{modality: list}`` or null.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from fsm_rollout.errors import (
    FeatureCodecError,
    ImageFeaturesMissingError,
    ImageInputError,
    ImageObservationError,
    ImageTooLargeError,
    MalformedFeaturesError,
    VideoObservationError,
)
from fsm_rollout.multimodal._prefix import sample_prefix
from fsm_rollout.multimodal.features import NULL_ITEM_ADVICE
from fsm_rollout.multimodal.image_tokens import validate_image_tokens

DEFAULT_MAX_IMAGE_BYTES: Final = 16 * 1024 * 1024
"""The default limit on one observation image's encoded size (its file, or its ``data:`` URL's payload)."""
DEFAULT_MAX_IMAGE_PIXELS: Final = 4096 * 4096
"""The default limit on one observation image's width times height."""

MEDIA_PART_TYPES: Final = ("video", "video_url", "input_video", "audio", "audio_url", "input_audio")
"""Content part types (or keys) of media other than images: refused in observations."""

_HEADER_PROBE_CHARS: Final = 4 * 16 * 1024
"""How much of a ``data:`` URL's base64 payload (a multiple of 4: 48 KiB decoded) the limits check decodes to read
the image's header; a header further in is read from the whole payload."""

FEATURE_LISTS: Final = ("mm_hashes", "kwargs_data", "mm_metadata")
"""The per-modality lists of render features besides the placeholders."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Limits on one observation image: its encoded bytes and its pixels (width times height)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def observation_image_count(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many image parts (``image``/``image_url``) the observation's messages hold."""
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and _is_image(part))
    return count


def check_observation_parts(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse media parts other than images (a video, say) with :class:`~fsm_rollout.errors.VideoObservationError`,
    and images given as ``http(s)`` URLs with :class:`~fsm_rollout.errors.ImageObservationError`, naming the part.

    A remote image would be fetched by the engine, so the rollout would never see its content: its trace and tape
    could hold only the URL, and a replay could not show that the image was the same. An environment has its
    images at hand; it passes them as PIL images, files or ``data:`` URLs.
    """
    for message_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            source = part.get("image_url", part.get("image"))
            source = source.get("url") if isinstance(source, dict) else source
            if isinstance(source, str) and source.startswith(("http://", "https://")):
                raise ImageObservationError(
                    f"observation message [{message_index}] content[{index}] is a remote image ({source[:80]!r}): "
                    "pass the image itself (a PIL image, a file path or a data: URL), whose content the trace and "
                    "tape can keep"
                )
            kind = part.get("type")
            media = kind if kind in MEDIA_PART_TYPES else next((key for key in part if key in MEDIA_PART_TYPES), None)
            if media is not None:
                raise VideoObservationError(
                    f"observation message [{message_index}] content[{index}] is a {media!r} part: observations take "
                    "text and image parts only (send a video's frames as images)"
                )


def _is_image(part: Mapping[str, Any]) -> bool:
    return part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part


def check_image_limits(messages: Sequence[Mapping[str, Any]], limits: ImageLimits, *, sample_id: Any = None) -> None:
    """Refuse an observation image over ``limits`` with :class:`~fsm_rollout.errors.ImageTooLargeError` naming it.

    Sizes are read without decoding pixels: a PIL image's ``size``, a file's length and header, a ``data:`` URL's
    payload length and header. Images in other forms (``http(s)`` URLs) are not checked here; their errors come
    from :func:`~fsm_rollout.multimodal.prepare_render_messages`.
    """
    image_index = 0
    for message_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or not _is_image(part):
                continue
            place = f"message [{message_index}] content[{part_index}]"
            where = f"{sample_prefix(sample_id)}observation image {image_index} ({place})"
            image_index += 1
            value = part.get("image") if part.get("type") != "image_url" and "image" in part else part.get("image_url")
            if isinstance(value, dict):
                value = value.get("url")
            _check_one(value, limits, where)


def check_encoded_sizes(messages: Sequence[Mapping[str, Any]], limits: ImageLimits, *, sample_id: Any = None) -> None:
    """Refuse a ``data:`` image URL of the render request (a PIL image once encoded, say) whose payload is over
    the byte limit."""
    index = 0
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str) and url.startswith("data:"):
                comma = url.find(",")
                payload_chars = len(url) - comma - 1 if comma >= 0 else 0  # counted, not copied
                _check_bytes(payload_chars * 3 // 4, limits,
                             f"{sample_prefix(sample_id)}observation image {index} (encoded)")  # fmt: skip
            index += 1


def _check_one(value: Any, limits: ImageLimits, where: str) -> None:
    if hasattr(value, "size") and hasattr(value, "mode") and hasattr(value, "save"):  # a PIL image
        width, height = value.size
        _check_pixels(width, height, limits, where)
        return
    if isinstance(value, os.PathLike) or (
        isinstance(value, str) and not value.startswith(("data:", "http://", "https://"))
    ):
        path = Path(os.fspath(value)).expanduser()
        try:
            size = path.stat().st_size
        except (OSError, ValueError):
            return  # not a file: prepare_render_messages says why
        _check_bytes(size, limits, where)
        _check_header(path, limits, where)
        return
    if isinstance(value, str) and value.startswith("data:"):
        comma = value.find(",")
        start = comma + 1 if comma >= 0 else len(value)
        _check_bytes((len(value) - start) * 3 // 4, limits, where)
        # The header is read from the payload's first bytes, not all of it: the render preparation decodes the
        # whole payload (once) for the bytes it sends and hashes.
        if len(value) - start > _HEADER_PROBE_CHARS:
            try:
                head = base64.b64decode(value[start : start + _HEADER_PROBE_CHARS], validate=True)
                _check_header(io.BytesIO(head), limits, where)
                return
            except ImageTooLargeError:
                raise
            except (binascii.Error, ValueError, ImageInputError):
                pass  # a header past the probe (a JPEG's long EXIF): read from the whole payload below
        try:
            data = base64.b64decode(value[start:], validate=True)
        except (binascii.Error, ValueError):
            return  # prepare_render_messages names the bad base64
        _check_header(io.BytesIO(data), limits, where)


def _check_bytes(size: int, limits: ImageLimits, where: str) -> None:
    if size > limits.max_bytes:
        raise ImageTooLargeError(
            f"{where}: {size} bytes is over the limit of {limits.max_bytes} (RolloutConfig.observation_image_max_bytes)"
        )


def _check_pixels(width: int, height: int, limits: ImageLimits, where: str) -> None:
    if width * height > limits.max_pixels:
        raise ImageTooLargeError(
            f"{where}: {width}x{height} = {width * height} pixels is over the limit of {limits.max_pixels} "
            "(RolloutConfig.observation_image_max_pixels)"
        )


def _check_header(source: Any, limits: ImageLimits, where: str) -> None:
    """Read the image's size from its header only (PIL decodes no pixels on open)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as opened:
                width, height = opened.size
    except Image.DecompressionBombError as error:
        raise ImageTooLargeError(f"{where}: refused as a decompression bomb: {error}") from error
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ImageInputError(f"{where}: not an image PIL can read ({type(error).__name__})") from error
    _check_pixels(width, height, limits, where)


# ---------------------------------------------------------------------------------------------------- features


def image_features(features: Any, *, what: str, sample_id: Any = None) -> dict[str, Any] | None:
    """Render ``features`` as a dictionary with image lists only, or None when they hold no images; anything other
    than images (a video item) is refused."""
    prefix = sample_prefix(sample_id)
    if features is None:
        return None
    if not isinstance(features, dict):
        raise MalformedFeaturesError(f"{prefix}{what}: features must be a dictionary, got {type(features).__name__}")
    placeholders = features.get("mm_placeholders")
    if not isinstance(placeholders, dict) or not placeholders.get("image"):
        return None
    other = sorted(key for key, value in placeholders.items() if key != "image" and value)
    if other:
        raise VideoObservationError(f"{prefix}{what}: features hold {', '.join(other)} items; only images are taken")
    out: dict[str, Any] = {"mm_placeholders": {"image": [dict(entry) for entry in placeholders["image"]]}}
    count = len(out["mm_placeholders"]["image"])
    for name in FEATURE_LISTS:
        value = features.get(name)
        if value is None:
            out[name] = None
            continue
        items = value.get("image") if isinstance(value, dict) else None
        if not isinstance(items, list) or len(items) != count:
            raise MalformedFeaturesError(
                f"{prefix}{what}: features.{name}.image must list one entry per image placeholder ({count})"
            )
        out[name] = {"image": list(items)}
    return out


def place_features(
    features: dict[str, Any],
    *,
    shift: int,
    first_offset: int,
    end: int,
    known: Mapping[str, tuple[Any, Any]],
    what: str,
    sample_id: Any = None,
) -> dict[str, Any]:
    """The observation's image features (from :func:`image_features`) moved into the sample's sequence.

    Each placeholder offset gets ``shift`` added; every range must lie in ``[first_offset, end)`` of the sequence
    (the observation's tokens). Null items (the engine's processor-cache hit) are filled from ``known``, the
    sample's ``{hash: (kwargs item, metadata item)}``; an item no one has is an
    :class:`~fsm_rollout.errors.ImageFeaturesMissingError` naming the engine flag.
    """
    prefix = sample_prefix(sample_id)
    placed: dict[str, Any] = {"mm_placeholders": {"image": []}}
    for index, entry in enumerate(features["mm_placeholders"]["image"]):
        offset, length = entry.get("offset"), entry.get("length")
        if not isinstance(offset, int) or not isinstance(length, int) or length < 1:
            raise MalformedFeaturesError(
                f"{prefix}{what}: mm_placeholders.image[{index}] needs integer offset and length"
            )
        start = offset + shift
        if start < first_offset or start + length > end:
            raise MalformedFeaturesError(
                f"{prefix}{what}: image placeholder {index} [{offset}, {offset + length}) of the render is not inside "
                "the observation's tokens (an image in the dummy prefix?)"
            )
        placed["mm_placeholders"]["image"].append({**entry, "offset": start})
    hashes = (features.get("mm_hashes") or {}).get("image")
    items = (features.get("kwargs_data") or {}).get("image")
    metadata = (features.get("mm_metadata") or {}).get("image")
    count = len(placed["mm_placeholders"]["image"])
    if items is None:
        items = [None] * count
    filled_items, filled_metadata = [], []
    for index in range(count):
        item = items[index]
        meta = metadata[index] if metadata is not None else None
        if item is None:
            digest = hashes[index] if hashes is not None else None
            cached = known.get(digest) if isinstance(digest, str) else None
            if cached is None or cached[0] is None:
                raise ImageFeaturesMissingError(
                    f"{prefix}{what}: the engine's render sent no tensors for observation image {index} (a null "
                    f"kwargs_data item, its processor-cache hit) and the sample holds no image with its hash: "
                    f"{NULL_ITEM_ADVICE}"
                )
            item, meta = cached[0], meta if meta is not None else cached[1]
        if not isinstance(item, str):
            raise MalformedFeaturesError(f"{prefix}{what}: kwargs_data.image[{index}] must be base64 text")
        filled_items.append(item)
        filled_metadata.append(meta)
    placed["mm_hashes"] = {"image": list(hashes)} if hashes is not None else None
    placed["kwargs_data"] = {"image": filled_items}
    placed["mm_metadata"] = {"image": filled_metadata} if metadata is not None else None
    return placed


def known_items(features: Any) -> dict[str, tuple[Any, Any]]:
    """The sample's image items by hash: ``{hash: (kwargs item, metadata item)}`` (for filling null items)."""
    features = features_dict(features)
    if not isinstance(features, dict):
        return {}
    hashes = (features.get("mm_hashes") or {}).get("image") or []
    items = (features.get("kwargs_data") or {}).get("image") or []
    metadata = (features.get("mm_metadata") or {}).get("image") or []
    known: dict[str, tuple[Any, Any]] = {}
    for index, digest in enumerate(hashes):
        item = items[index] if index < len(items) else None
        if isinstance(digest, str) and item is not None:
            known[digest] = (item, metadata[index] if index < len(metadata) else None)
    return known


def features_dict(features: Any) -> Any:
    """Render ``features`` as a dictionary when an engine sent them as JSON text (older vLLM); else as they are."""
    if isinstance(features, str):
        try:
            return json.loads(features)
        except json.JSONDecodeError as error:
            raise MalformedFeaturesError(f"render features are a string but not JSON: {error}") from error
    return features


def fill_null_items(features: Any, *, sample_id: Any = None, known: Mapping[str, tuple[Any, Any]] | None = None) -> Any:
    """A prompt's render ``features`` with each null image item (the engine's processor-cache hit) filled from an
    item of the same hash in the same answer, or in ``known`` (the sample's items, for a re-render of a conversation
    whose images the engine has seen); one no item can fill is an
    :class:`~fsm_rollout.errors.ImageFeaturesMissingError` naming the engine flag, raised before any generate
    request could carry it (a null item kills vLLM's engine). Features without null items come back as they are.
    """
    original, features = features, features_dict(features)
    items = ((features.get("kwargs_data") or {}).get("image") if isinstance(features, dict) else None) or []
    if None not in items:
        return original  # as the engine sent them (text stays text)
    known = {**(known or {}), **known_items(features)}
    hashes = (features.get("mm_hashes") or {}).get("image") or []
    filled = list(items)
    for index, item in enumerate(items):
        if item is not None:
            continue
        digest = hashes[index] if index < len(hashes) else None
        cached = known.get(digest) if isinstance(digest, str) else None
        if cached is None:
            raise ImageFeaturesMissingError(
                f"{sample_prefix(sample_id)}features.kwargs_data.image[{index}] is null (vLLM's multimodal cache hit) "
                f"and no other image of the answer has its hash: {NULL_ITEM_ADVICE}"
            )
        filled[index] = cached[0]
    return {**features, "kwargs_data": {**features["kwargs_data"], "image": filled}}


def merge_features(base: Any, new: dict[str, Any]) -> dict[str, Any]:
    """The sample's features with an observation's placed features appended (image order is sequence order).

    A list missing on one side is filled with nulls for the other side's items, except ``kwargs_data``, which
    :func:`place_features` always fills.
    """
    base = features_dict(base)
    if not isinstance(base, dict) or not ((base.get("mm_placeholders") or {}).get("image")):
        merged = dict(base) if isinstance(base, dict) else {}
        merged.update(new)
        return merged
    old_count = len(base["mm_placeholders"]["image"])
    new_count = len(new["mm_placeholders"]["image"])
    merged = dict(base)
    merged["mm_placeholders"] = {
        **base["mm_placeholders"],
        "image": [*base["mm_placeholders"]["image"], *new["mm_placeholders"]["image"]],
    }
    for name in FEATURE_LISTS:
        old_items = (base.get(name) or {}).get("image")
        new_items = (new.get(name) or {}).get("image")
        if old_items is None and new_items is None:
            merged[name] = base.get(name)
            continue
        left = list(old_items) if old_items is not None else [None] * old_count
        right = list(new_items) if new_items is not None else [None] * new_count
        merged[name] = {**(base.get(name) or {}), "image": left + right}
    return merged


def item_grids(features: dict[str, Any], *, what: str, sample_id: Any = None) -> Any:
    """The ``(images, 3)`` ``image_grid_thw`` of the features' items: from ``mm_metadata`` (the grid alone, small)
    when the engine sent it, else from the full items."""
    import torch

    from fsm_rollout.multimodal.codec import decode_item

    prefix = sample_prefix(sample_id)
    metadata = (features.get("mm_metadata") or {}).get("image") or []
    items = features["kwargs_data"]["image"]
    rows = []
    for index, item in enumerate(items):
        grid = None
        for text in (metadata[index] if index < len(metadata) else None, item):
            if text is None:
                continue
            try:
                grid = decode_item(text).get_data().get("image_grid_thw")
            except FeatureCodecError as error:
                raise FeatureCodecError(f"{prefix}{what}: kwargs_data.image[{index}]: {error}") from error
            if grid is not None:
                break
        if grid is None:
            raise MalformedFeaturesError(f"{prefix}{what}: image item {index} has no image_grid_thw")
        rows.append(grid.reshape(1, -1))
    return torch.cat(rows, dim=0)


def check_observation_tokens(
    tokens: Sequence[int],
    features: dict[str, Any],
    *,
    tokenizer: Any,
    processor: Any,
    placeholder_token: str,
    merge_size: int | None,
    sample_id: Any = None,
) -> None:
    """The prompt path's image-token check for one observation: its placeholder tokens against its items' grids."""
    grids = item_grids(features, what="observation features", sample_id=sample_id)
    validate_image_tokens(
        tokens,
        tokenizer,
        processor,
        {"image_grid_thw": grids},
        placeholder_token=placeholder_token,
        merge_size=merge_size,
        sample_id=sample_id,
    )


__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MEDIA_PART_TYPES",
    "ImageLimits",
    "check_encoded_sizes",
    "check_image_limits",
    "check_observation_parts",
    "check_observation_tokens",
    "features_dict",
    "fill_null_items",
    "image_features",
    "item_grids",
    "known_items",
    "merge_features",
    "observation_image_count",
    "place_features",
]
