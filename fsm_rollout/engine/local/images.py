"""Images in the embedded engine: vLLM's Qwen2-VL prompt processing, up to (not into) the language model.

What render does with the image parts of a chat request, step by step as ``vllm serve`` does for a Qwen2-VL model:

1. each ``image_url`` part's ``data:`` URL is decoded and opened with Pillow (EXIF orientation applied, converted
   to RGB, transparency composited onto white, as vLLM's ``ImageMediaIO``);
2. the images of the request are preprocessed together by transformers' ``Qwen2VLImageProcessorPil`` (the
   numpy/PIL backend: the default ``Qwen2VLImageProcessor`` is the torchvision backend, and torchvision does not
   exist for this CPU torch) with patch size 14, merge size 2, temporal patch size 2 and the processor's default
   pixel bounds (``min_pixels`` 56*56, ``max_pixels`` 28*28*1280): ``pixel_values`` of shape
   ``(sum of t*h*w, 3*2*14*14)`` and ``image_grid_thw`` of shape ``(images, 3)``;
3. the chat template's ``<|vision_start|><|image_pad|><|vision_end|>`` for image ``i`` gets ``t*h*w / 2**2``
   ``<|image_pad|>`` tokens, in image order;
4. the answer's ``features`` holds ``mm_hashes``, ``mm_placeholders`` (offset and length of each image's pad run),
   ``kwargs_data`` (one base64 ``MultiModalKwargsItem`` per image: ``pixel_values`` as a ``flat`` field sliced by
   ``t*h*w``, ``image_grid_thw`` as a ``batched`` field kept on the CPU, see :func:`fsm_rollout.multimodal.codec.
   qwen_vl_image_items`) and ``mm_metadata`` (the ``keep_on_cpu`` fields of each item, as vLLM 0.32 sends).

Generate checks the ``features`` of a request the way vLLM's ``MultiModalFeatures`` model does (same modalities,
parallel lists, sorted non-overlapping ranges), plus what vLLM's Qwen2-VL model would trip over later: every range
lies inside ``token_ids`` and holds only ``<|image_pad|>`` tokens, every item decodes and its grid gives exactly the
range's length. Then the text model generates from ``token_ids`` alone: it sees the pad tokens as ordinary tokens
(there is no vision tower; the pixel values are checked and dropped).

Pillow, torch and transformers are imported only when an image is processed or a feature item decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from fsm_rollout.engine.local.protocol import ImageFeatures
from fsm_rollout.engine.schema import RequestError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

__all__ = [
    "IMAGE_MAX_PIXELS",
    "IMAGE_MERGE_SIZE",
    "IMAGE_MIN_PIXELS",
    "IMAGE_PAD_TOKEN",
    "IMAGE_PATCH_SIZE",
    "IMAGE_TEMPORAL_PATCH_SIZE",
    "ImageSupport",
    "RenderedImages",
]

IMAGE_PAD_TOKEN: Final = "<|image_pad|>"
"""The image placeholder token of Qwen2-VL's chat template (between ``<|vision_start|>`` and ``<|vision_end|>``)."""

IMAGE_PATCH_SIZE: Final = 14
IMAGE_MERGE_SIZE: Final = 2
"""Patches merged per side into one language-model token: an image takes ``t*h*w / IMAGE_MERGE_SIZE**2`` tokens."""
IMAGE_TEMPORAL_PATCH_SIZE: Final = 2
IMAGE_MIN_PIXELS: Final = 56 * 56
IMAGE_MAX_PIXELS: Final = 28 * 28 * 1280
"""The image processor's default bounds: images are resized (aspect kept, sides multiples of 28) into them."""

NO_CACHE_ADVICE: Final = (
    "the embedded engine keeps no multimodal cache, so every generate request must carry the image tensors "
    "render returned (render with mm_payload='tensors', the default)"
)

_RGB_BACKGROUND: Final = (255, 255, 255)
_REMEMBERED: Final = 32
_REMEMBERED_BYTES: Final = 256 * 1024 * 1024
"""Rendered image lists and checked feature items remembered (least recently used out, at most this many and about
this many bytes each): a multi-turn conversation renders its images, and sends their feature items, with every turn,
and decoding, resizing and encoding megabytes per turn would be most of a render or generate call's cost."""


class _Remembered(OrderedDict[Any, Any]):
    """A least-recently-used map bounded in entries and in the bytes its entries are said to hold."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[Any, int] = {}

    def remember(self, key: Any, value: Any, size: int) -> None:
        self[key] = value
        self.move_to_end(key)
        self._sizes[key] = size
        while len(self) > 1 and (len(self) > _REMEMBERED or sum(self._sizes.values()) > _REMEMBERED_BYTES):
            oldest, _ = self.popitem(last=False)
            del self._sizes[oldest]

    def touch(self, key: Any) -> Any:
        self.move_to_end(key)
        return self[key]


@dataclass
class _Processed:
    """One render's images, preprocessed, and the features last built from them (with their key)."""

    pixel_values: torch.Tensor
    grids: torch.Tensor
    counts: list[int]
    features: tuple[tuple[bool, tuple[tuple[int, int], ...]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class RenderedImages:
    """A render answer's prompt with the image pad runs expanded, and its ``features``."""

    token_ids: list[int]
    features: dict[str, Any]


class ImageSupport:
    """Image preprocessing and feature checks for one engine; used on the engine's front-end thread only.

    ``tokenizer`` is the served model's: without an ``<|image_pad|>`` token, requests with images are refused.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.pad_token_id = _token_id(tokenizer, IMAGE_PAD_TOKEN)
        self._processor: Any = None
        self._rendered = _Remembered()  # tuple of data URLs -> _Processed  # by the images' data URLs
        # (kwargs_data item, mm_metadata item) -> (the grid's t, h, w, pixel_values' shape or None), least recent first
        self._checked = _Remembered()

    # ---------------------------------------------------------------- render

    def render(
        self,
        token_ids: list[int],
        image_urls: Sequence[str],
        *,
        with_tensors: bool,
        places: Sequence[str] | None = None,
    ) -> RenderedImages:
        """Expand the template's pad token of each image and build the ``features`` (``kwargs_data`` and
        ``mm_metadata`` only ``with_tensors``, as vLLM's ``mm_payload``). ``places`` name the images' parts in
        error messages (default: ``image <index>``)."""
        pad = self._require_pad_token("messages")
        found = token_ids.count(pad)
        if found != len(image_urls):
            raise RequestError(
                400,
                f"The chat template rendered {found} {IMAGE_PAD_TOKEN} placeholder(s) for {len(image_urls)} image "
                "part(s); each image part must become exactly one placeholder (is the placeholder text in a text "
                "part?).",
                "messages",
            )
        urls = tuple(image_urls)
        processed = self._rendered.get(urls)
        if processed is None:
            names = list(places) if places is not None else [f"image {index}" for index in range(len(urls))]
            images = [load_image_url(url, name) for url, name in zip(urls, names, strict=True)]
            pixel_values, grids = self.preprocess(images)
            processed = _Processed(pixel_values, grids, [tokens_per_image(grid) for grid in grids.tolist()])
        # the URLs, the pixel values, and the features built from them (their base64 text, 4/3 of the tensor)
        size = sum(map(len, urls)) + processed.pixel_values.nbytes * 7 // 3
        self._rendered.remember(urls, processed, size)
        counts = processed.counts
        expanded: list[int] = []
        placeholders: list[tuple[int, int]] = []
        for token in token_ids:
            if token == pad:
                count = counts[len(placeholders)]
                placeholders.append((len(expanded), count))
                expanded.extend([pad] * count)
            else:
                expanded.append(token)
        key = (with_tensors, tuple(placeholders))
        if processed.features is None or processed.features[0] != key:
            built = _features(processed.pixel_values, processed.grids, placeholders, with_tensors=with_tensors)
            processed.features = (key, built)
        return RenderedImages(expanded, dict(processed.features[1]))

    def preprocess(self, images: Sequence[Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` (float32, one row per patch) and ``image_grid_thw`` (int64, one row per image) of the
        images, processed together in one batch as vLLM does."""
        output = self._image_processor()(images=list(images), return_tensors="pt")
        return output["pixel_values"], output["image_grid_thw"]

    def _image_processor(self) -> Any:
        if self._processor is None:
            from transformers import Qwen2VLImageProcessorPil

            self._processor = Qwen2VLImageProcessorPil(
                patch_size=IMAGE_PATCH_SIZE,
                merge_size=IMAGE_MERGE_SIZE,
                temporal_patch_size=IMAGE_TEMPORAL_PATCH_SIZE,
                min_pixels=IMAGE_MIN_PIXELS,
                max_pixels=IMAGE_MAX_PIXELS,
            )
        return self._processor

    # ---------------------------------------------------------------- generate

    def check_features(self, features: ImageFeatures, token_ids: list[int]) -> None:
        """Refuse (400) image features that do not fit ``token_ids``: a range holding other tokens than the pad
        token, an item that is missing or does not decode, or a grid whose token count is not the range's length.

        The ranges' bounds were checked by :func:`~fsm_rollout.engine.local.protocol.parse_generate`.
        """
        pad = self._require_pad_token("features")
        for index, (offset, length) in enumerate(features.placeholders):
            where = f"features.mm_placeholders.image[{index}] (offset {offset}, length {length})"
            stray = next((offset + i for i, t in enumerate(token_ids[offset : offset + length]) if t != pad), None)
            if stray is not None:
                raise RequestError(
                    400,
                    f"{where} covers token {token_ids[stray]} at position {stray}, not the image placeholder "
                    f"{IMAGE_PAD_TOKEN} ({pad}): the features do not belong to these token_ids",
                    "features",
                )
            thw, shape = self._item_shapes(features, index)
            patches = thw[0] * thw[1] * thw[2]
            if shape is not None and (len(shape) != 2 or shape[0] != patches):
                raise RequestError(
                    400,
                    f"features.kwargs_data.image[{index}]: pixel_values of shape {list(shape)} do not "
                    f"hold the {patches} patch rows of image_grid_thw {thw}",
                    "features",
                )
            if min(thw) < 1 or patches % (IMAGE_MERGE_SIZE**2) or patches // IMAGE_MERGE_SIZE**2 != length:
                raise RequestError(
                    400,
                    f"{where}: image_grid_thw {thw} gives {patches / IMAGE_MERGE_SIZE**2:g} image tokens "
                    f"(t*h*w / {IMAGE_MERGE_SIZE}**2), not {length}",
                    "features",
                )

    def _item_shapes(self, features: ImageFeatures, index: int) -> tuple[list[int], tuple[int, ...] | None]:
        """The item's integer (t, h, w) grid and its ``pixel_values``' shape (None when it has none), decoded once
        per distinct item (see :data:`_REMEMBERED`); a 400 when it has no such grid."""
        item = features.items[index]
        key = (item, features.metadata[index]) if item is not None else None
        if key is not None and key in self._checked:
            return self._checked.touch(key)  # type: ignore[no-any-return]
        data = self._item_data(features, index)
        grid = data.get("image_grid_thw")
        if grid is None or tuple(grid.shape) not in ((3,), (1, 3)) or grid.dtype.is_floating_point:
            raise RequestError(
                400, f"features.kwargs_data.image[{index}] has no integer (t, h, w) image_grid_thw", "features"
            )
        pixel_values = data.get("pixel_values")
        shapes = (
            [int(size) for size in grid.reshape(-1).tolist()],
            None if pixel_values is None else tuple(pixel_values.shape),
        )
        if key is not None:
            self._checked.remember(key, shapes, len(key[0]) + len(key[1] or ""))
        return shapes

    def _item_data(self, features: ImageFeatures, index: int) -> dict[str, Any]:
        """The item's fields, its ``mm_metadata`` fields over its ``kwargs_data`` ones (vLLM's merge)."""
        from fsm_rollout.errors import FeatureCodecError
        from fsm_rollout.multimodal.codec import decode_item

        item, metadata = features.items[index], features.metadata[index]
        if item is None:
            raise RequestError(400, f"features.kwargs_data.image[{index}] is null: {NO_CACHE_ADVICE}", "features")
        data: dict[str, Any] = {}
        for name, text in (("kwargs_data", item), ("mm_metadata", metadata)):
            if text is None:
                continue
            try:
                data.update(decode_item(text).get_data())
            except FeatureCodecError as error:
                raise RequestError(400, f"features.{name}.image[{index}]: {error}", "features") from error
        return data

    def _require_pad_token(self, param: str) -> int:
        if self.pad_token_id is None:
            raise RequestError(
                400,
                f"The served model's tokenizer has no {IMAGE_PAD_TOKEN} token, so the embedded engine cannot place "
                "images in its prompts (images need a Qwen2-VL-style tokenizer and chat template).",
                param,
            )
        return self.pad_token_id


def load_image_url(url: str, what: str) -> Image:
    """Open a ``data:`` URL's image as vLLM does: base64 only, EXIF orientation applied, converted to RGB with
    transparency composited onto white. Anything unreadable is a 400."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    header, separator, payload = url[len("data:") :].partition(",")
    if not separator:
        raise RequestError(400, f"Invalid data URL {url[:32]!r} ({what}): missing ',' separator.", "messages")
    if header.rpartition(";")[2] != "base64":
        raise RequestError(400, f"Only base64 data URLs are supported for now ({what}).", "messages")
    try:
        data = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(data)) as opened:
            image = ImageOps.exif_transpose(opened)
            image.load()
    except UnidentifiedImageError as error:
        raise RequestError(
            400, f"Failed to load image ({what}): the data is not an image Pillow can read", "messages"
        ) from error
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as error:
        raise RequestError(400, f"Failed to load image ({what}): {error}", "messages") from error
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flattened = Image.new("RGB", rgba.size, _RGB_BACKGROUND)
        flattened.paste(rgba, mask=rgba.getchannel("A"))
        return flattened
    return image.convert("RGB")


def tokens_per_image(grid: list[int]) -> int:
    """How many ``<|image_pad|>`` tokens an image of grid ``(t, h, w)`` becomes."""
    return grid[0] * grid[1] * grid[2] // IMAGE_MERGE_SIZE**2


def _features(
    pixel_values: torch.Tensor, grids: torch.Tensor, placeholders: list[tuple[int, int]], *, with_tensors: bool
) -> dict[str, Any]:
    from fsm_rollout.multimodal.codec import KwargsItem, encode_item, qwen_vl_image_items, render_features

    items = qwen_vl_image_items(pixel_values, grids)
    features = render_features(items, placeholders)
    if not with_tensors:  # vLLM's mm_payload="none": hashes and placeholders only
        features["kwargs_data"] = None
        return features
    # vLLM 0.32 also sends each item's keep_on_cpu fields alone (the (t, h, w) grid), for disaggregated prefill.
    metadata = [
        KwargsItem({key: elem for key, elem in item.items() if elem.field.options.get("keep_on_cpu")}) for item in items
    ]
    features["mm_metadata"] = {"image": [encode_item(item) if item else None for item in metadata]}
    return features


def _token_id(tokenizer: Any, token: str) -> int | None:
    try:
        token_id = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id == tokenizer.unk_token_id:
        return None
    return token_id
