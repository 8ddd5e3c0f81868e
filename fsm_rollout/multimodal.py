"""Images in prompts: initial chat messages, images as render URLs, training features and image-token checks.

The rules (contract sections 4 and 9, with the seed's fragile spots made strict):

* A string prompt becomes one user message: one image part per image, then the text without ``<image>``.
* Every image becomes a URL vLLM's render accepts, before any request is sent: a PIL image (PNG data URL), a
  ``data:`` URL (Geo3K's ``image/None`` fixed to ``image/png``; the payload must be base64 of an image), an
  ``http(s)://`` URL (passed through) or a local path (``~`` expanded; must be an image file). Anything else is
  an :class:`~fsm_rollout.errors.ImageInputError` naming the sample and the image index.
* The render answer's ``features.kwargs_data["image"]`` items are decoded into training tensors with vLLM's codec
  when it is importable, else with :mod:`fsm_rollout.mm_codec` (same wire format, bit-identical tensors).
* The image placeholder tokens must number ``sum(t*h*w) / merge_size**2``. The placeholder token is configurable;
  a text-only sample never fails because the tokenizer lacks it. The merge size comes from the config or the
  processor (:func:`load_image_processor` finds one for checkpoints whose full processor does not load); when
  neither knows it, image features are an error that says so.
* Only content hashes of the images (:attr:`RenderMessages.image_hashes`) are meant for traces, never the images.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import importlib
import io
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm_rollout.errors import (
    FeatureCodecError,
    ImageFeaturesMissingError,
    ImageInputError,
    ImageMergeSizeUnknownError,
    ImageTokenMismatchError,
    MalformedFeaturesError,
    MultimodalError,
    PromptError,
)

IMAGE_PAD_TOKEN = "<|image_pad|>"
"""The default image placeholder token (Qwen-VL's)."""

IMAGE_GRID_DIMENSIONS = 3
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

_HASH_HEX_CHARS = 16
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")
# Base64 of the magic bytes of PNG, JPEG, GIF and WebP files.
_IMAGE_BASE64_PREFIXES = ("iVBORw0KGgo", "/9j/", "R0lGOD", "UklGR")
_MIN_BARE_BASE64_CHARS = 64


@dataclass(frozen=True, slots=True)
class RenderMessages:
    """Chat messages ready for the render request, and one content hash per image in them, in order.

    A hash is ``sha256:<16 hex>`` of the image bytes sent (PNG bytes for PIL images and files, the decoded
    payload for ``data:`` URLs), or ``url-sha256:<16 hex>`` of the URL text for ``http(s)`` URLs, whose content
    the rollout never sees.
    """

    messages: list[dict[str, Any]]
    image_hashes: tuple[str, ...]


def build_initial_messages(prompt: Any, images: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The first chat messages: a message-list prompt is copied; a string prompt becomes one user message.

    A string prompt gets one image part per image, then its text with every ``<image>`` removed and leading
    whitespace stripped.
    """
    if images is not None and not isinstance(images, list | tuple):
        raise ImageInputError(
            f"multimodal_inputs['images'] must be a list of images, got {type(images).__name__}"
        )
    if isinstance(prompt, list):
        if not prompt:
            raise PromptError("the prompt is an empty list of chat messages")
        for index, message in enumerate(prompt):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                raise PromptError(
                    f"prompt[{index}] must be a chat message with a 'role' and 'content': {message!r:.120}"
                )
        return [dict(message) for message in prompt]
    if not isinstance(prompt, str) or not prompt:
        raise PromptError(
            f"the prompt must be a non-empty string or a list of chat messages, got {type(prompt).__name__}"
        )
    markers = prompt.count("<image>")
    if images and markers and markers != len(images):  # no images: the markers are just removed, as in the seed
        raise ImageInputError(
            f"the prompt has {markers} <image> placeholder(s) but multimodal_inputs['images'] holds "
            f"{len(images or ())} image(s)"
        )
    content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images or ()]
    content.append({"type": "text", "text": prompt.replace("<image>", "").lstrip()})
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------------------------------------------- images


def encode_pil_image(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (converted to RGB first when needed)."""
    return _pil_image_url(image)[0]


def image_to_render_url(image: Any) -> str:
    """An image as a URL vLLM's render accepts: PIL image, ``data:`` URL, ``http(s)://`` URL or local path.

    Raises :class:`~fsm_rollout.errors.ImageInputError` with the reason for anything else.
    """
    return _render_url_and_hash(image)[0]


def image_content_hash(url: str) -> str:
    """The trace hash of an image URL: of the decoded bytes of a ``data:`` URL, else of the URL text."""
    if url.startswith("data:"):
        _, _, payload = url.partition(",")
        try:
            return _content_hash(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            pass
    return "url-" + _content_hash(url.encode("utf-8"))


def prepare_render_messages(messages: Sequence[dict[str, Any]], *, sample_id: Any = None) -> RenderMessages:
    """Copy messages for the render request, turning ``image`` parts into ``image_url`` parts, and hash images.

    Parts whose ``image`` is None, and all other parts, are copied as they are. Errors name the sample, the
    image's index among the image parts (for a string prompt, its index in ``multimodal_inputs["images"]``)
    and its place in the messages.
    """
    rendered: list[dict[str, Any]] = []
    hashes: list[str] = []
    image_index = 0
    for message_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(content):
            where = f"messages[{message_index}].content[{part_index}]"
            if not isinstance(part, dict):
                raise ImageInputError(f"{_sample_prefix(sample_id)}{where} must be a dict, got {type(part).__name__}")
            if part.get("type") == "image":
                index, image_index = image_index, image_index + 1
                if part.get("image") is not None:
                    try:
                        url, digest = _render_url_and_hash(part["image"])
                    except ImageInputError as error:
                        raise ImageInputError(f"{_sample_prefix(sample_id)}image {index} ({where}): {error}") from error
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                    hashes.append(digest)
                    continue
            elif part.get("type") == "image_url":
                image_index += 1
                given_url = _image_url_of_part(part)
                if given_url is not None:
                    hashes.append(image_content_hash(given_url))
            parts.append(dict(part))
        rendered.append({**message, "content": parts})
    return RenderMessages(messages=rendered, image_hashes=tuple(hashes))


def messages_for_render(messages: Sequence[dict[str, Any]], *, sample_id: Any = None) -> list[dict[str, Any]]:
    """The messages of :func:`prepare_render_messages` (without the image hashes)."""
    return prepare_render_messages(messages, sample_id=sample_id).messages


def is_image_part(part: Any) -> bool:
    """Whether a message content part carries an image (``image``/``image_url`` type or key)."""
    if not isinstance(part, dict):
        return False
    return part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part


def _image_url_of_part(part: dict[str, Any]) -> str | None:
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _render_url_and_hash(image: Any) -> tuple[str, str]:
    if isinstance(image, str):
        return _string_image_url(image)
    if isinstance(image, os.PathLike):
        return _file_image_url(Path(os.fspath(image)).expanduser(), str(image))
    if isinstance(image, bytes | bytearray | memoryview):
        raise ImageInputError(
            f"raw bytes ({len(image)} bytes) are not an accepted image; pass PIL.Image.open(io.BytesIO(data)) "
            "or a 'data:image/png;base64,...' URL"
        )
    if hasattr(image, "mode") and hasattr(image, "save"):
        return _pil_image_url(image)
    if isinstance(image, dict) and ("bytes" in image or "path" in image):
        raise ImageInputError(
            "an undecoded dataset image ({'bytes', 'path'} dict) is not accepted; decode it to a PIL image "
            "(datasets.Image(decode=True)) or pass its path"
        )
    hint = "; convert it with PIL.Image.fromarray" if hasattr(image, "__array_interface__") else ""
    raise ImageInputError(
        f"unsupported image type {type(image).__name__}: expected a PIL image, a data: URL, an http(s) URL or a "
        f"local path{hint}"
    )


def _pil_image_url(image: Any) -> tuple[str, str]:
    if not hasattr(image, "mode") or not hasattr(image, "save"):
        raise ImageInputError(f"expected a PIL image, got {type(image).__name__}")
    try:
        if image.mode != "RGB":
            image = image.convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
    except (OSError, ValueError) as error:
        raise ImageInputError(f"cannot encode the PIL image as PNG: {error}") from error
    data = buffer.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii"), _content_hash(data)


def _string_image_url(image: str) -> tuple[str, str]:
    if image.startswith("data:"):
        return _data_url(image)
    if image.startswith(("http://", "https://")):
        return image, "url-" + _content_hash(image.encode("utf-8"))
    if not image.strip():
        raise ImageInputError("the image string is empty")
    scheme = _URL_SCHEME.match(image)
    if scheme is not None:
        hint = "; pass the local path itself" if scheme.group(1).lower() == "file" else ""
        raise ImageInputError(
            f"unsupported URL scheme {scheme.group(1)!r} in {image[:80]!r}: only data: and http(s) URLs are "
            f"accepted{hint}"
        )
    return _file_image_url(Path(image).expanduser(), image)


def _data_url(url: str) -> tuple[str, str]:
    url = url.replace("data:image/None;", "data:image/png;", 1)
    header, separator, payload = url[len("data:") :].partition(",")
    if not separator:
        raise ImageInputError(f"the data: URL has no ',' before its payload: {url[:60]!r}")
    if header.rpartition(";")[2] != "base64":
        raise ImageInputError(f"only base64 data: URLs are accepted (like vLLM), got {('data:' + header)[:60]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageInputError(f"the data: URL payload is not valid base64: {error}") from error
    _check_image_bytes(data, "the data: URL payload")
    return url, _content_hash(data)


def _file_image_url(path: Path, given: str) -> tuple[str, str]:
    try:
        is_file = path.is_file()
        exists = is_file or path.exists()
    except OSError:  # e.g. a file name too long: a long base64 string, most likely
        is_file = exists = False
    if not is_file:
        if exists:
            raise ImageInputError(f"{given[:80]!r} is not a file")
        if _looks_like_bare_base64(given):
            raise ImageInputError(
                f"{given[:40]!r}... looks like raw base64 without a data: prefix; pass "
                "'data:image/png;base64,' + the base64 text"
            )
        raise ImageInputError(
            f"unsupported image string {given[:80]!r}: not a data: URL, an http(s) URL, or an existing file"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as loaded:
            return _pil_image_url(loaded)
    except UnidentifiedImageError as error:
        raise ImageInputError(f"{str(path)!r} is not an image file PIL can read") from error
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageInputError(f"cannot read image file {str(path)!r}: {error}") from error


def _check_image_bytes(data: bytes, what: str) -> None:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageInputError(f"{what} is empty")
    try:
        with Image.open(io.BytesIO(data)):
            pass
    except UnidentifiedImageError as error:
        raise ImageInputError(f"{what} is not an image PIL can read") from error
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageInputError(f"{what} cannot be read as an image: {error}") from error


def _looks_like_bare_base64(text: str) -> bool:
    compact = "".join(text.split())
    if compact.startswith(_IMAGE_BASE64_PREFIXES):
        return True
    return len(compact) >= _MIN_BARE_BASE64_CHARS and _BASE64_TEXT.fullmatch(compact) is not None


def _content_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:_HASH_HEX_CHARS]


def _sample_prefix(sample_id: Any) -> str:
    return "" if sample_id is None else f"sample {sample_id}: "


# ---------------------------------------------------------------------------------------------------- features


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
    built-in :func:`fsm_rollout.mm_codec.decode_item`. Both return an object with ``get_data()``."""
    decoder = _vllm_item_decoder()
    if decoder is not None:
        return decoder
    from fsm_rollout.mm_codec import decode_item

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
    prefix = _sample_prefix(sample_id)
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


# ---------------------------------------------------------------------------------------------------- tokens


def image_pad_token_id(tokenizer: Any, token: str = IMAGE_PAD_TOKEN) -> int | None:
    """The id of the image placeholder ``token``, or None when the tokenizer does not know it."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if token_id is None or isinstance(token_id, bool) or not isinstance(token_id, int):
        return None
    if token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id


def processor_merge_size(processor: Any) -> int | None:
    """``merge_size`` of a processor's image processor (or of the processor itself), or None."""
    if processor is None:
        return None
    image_processor = getattr(processor, "image_processor", processor)
    return _positive_int(getattr(image_processor, "merge_size", None))


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class CheckpointImageConfig:
    """What the image-token check needs of an image processor, read from a checkpoint's preprocessor config."""

    merge_size: int
    source: str


PREPROCESSOR_CONFIG = "preprocessor_config.json"


def checkpoint_merge_size(path: str | os.PathLike[str]) -> int | None:
    """``merge_size`` from ``preprocessor_config.json`` in a local checkpoint directory, or None."""
    config_file = Path(path).expanduser() / PREPROCESSOR_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _positive_int(config.get("merge_size")) if isinstance(config, dict) else None


def load_image_processor(path: str) -> Any:
    """An object with the checkpoint's image ``merge_size``, for when its full processor cannot be loaded.

    Qwen2-VL's ``AutoProcessor`` also builds a video processor that needs torchvision; its image processor does
    not. Tried in order: ``AutoImageProcessor``, then ``merge_size`` from a local ``preprocessor_config.json``
    (as a :class:`CheckpointImageConfig`). None when neither exists, as for a text-only checkpoint.
    """
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path, trust_remote_code=True)  # type: ignore[no-untyped-call]
    except Exception:  # any failure (missing files, backends, remote code): the config file is read next
        pass
    merge_size = checkpoint_merge_size(path)
    if merge_size is None:
        return None
    return CheckpointImageConfig(merge_size=merge_size, source=str(Path(path).expanduser() / PREPROCESSOR_CONFIG))


def validate_image_tokens(
    tokens: Sequence[int],
    tokenizer: Any,
    processor: Any,
    train_inputs: dict[str, Any] | None,
    *,
    placeholder_token: str = IMAGE_PAD_TOKEN,
    merge_size: int | None = None,
    prompt_length: int | None = None,
    sample_id: Any = None,
) -> None:
    """Check that the image placeholder tokens match the image grids of the training features (contract §9).

    The placeholders in all of ``tokens`` must number ``sum(t*h*w) // merge_size**2`` over
    ``train_inputs["image_grid_thw"]``. ``merge_size`` (the config's) and the processor's must agree when both
    are known; with neither, image grids are an :class:`~fsm_rollout.errors.ImageMergeSizeUnknownError` (no
    merge size is guessed). A sample without image features and without placeholders passes, whether or not the
    tokenizer knows ``placeholder_token``. ``prompt_length`` only refines the error message.
    """
    prefix = _sample_prefix(sample_id)
    image_token_id = image_pad_token_id(tokenizer, placeholder_token)
    if image_token_id is None:
        if train_inputs:
            raise MultimodalError(
                f"{prefix}the prompt has image features, but the tokenizer does not define the image placeholder "
                f"token {placeholder_token!r}; set the model's placeholder token in the rollout config"
            )
        return
    image_tokens = (
        tokens.count(image_token_id)
        if isinstance(tokens, list)
        else sum(1 for token in tokens if token == image_token_id)
    )
    grid = None if not train_inputs else train_inputs.get("image_grid_thw")
    if grid is None:
        if image_tokens == 0:
            return
        if not train_inputs:
            raise ImageFeaturesMissingError(
                f"{prefix}Found {image_tokens} image tokens, but multimodal render features are missing."
            )
        raise MultimodalError(
            f"{prefix}Found {image_tokens} image tokens, but the image features have no image_grid_thw to check "
            f"them against (features: {sorted(train_inputs)}); the check needs Qwen-VL-style (t, h, w) grids"
        )
    effective_merge = _merge_size(merge_size, processor, prefix)
    try:
        grid = grid.reshape(-1, IMAGE_GRID_DIMENSIONS)
    except RuntimeError as error:
        raise MalformedFeaturesError(
            f"{prefix}image_grid_thw of shape {tuple(grid.shape)} is not a list of (t, h, w) rows"
        ) from error
    if effective_merge is None:
        raise ImageMergeSizeUnknownError(
            f"{prefix}the prompt has image features (image_grid_thw={grid.tolist()}, {image_tokens} "
            f"{placeholder_token!r} tokens), but the image merge size is unknown: "
            f"{'no processor was given' if processor is None else 'the processor has no merge_size'} and the "
            "config sets no image_merge_size. Pass the checkpoint's processor or image processor, or set "
            f"image_merge_size{_matching_merge_hint(grid, image_tokens)}"
        )
    expected = int((grid.prod(dim=1) // (effective_merge * effective_merge)).sum().item())
    if image_tokens != expected:
        where = ""
        if prompt_length is not None:
            in_prompt = sum(1 for token in tokens[:prompt_length] if token == image_token_id)
            where = f" ({in_prompt} in the prompt, {image_tokens - in_prompt} after it)"
        raise ImageTokenMismatchError(
            f"{prefix}Image token count does not match multimodal render features: "
            f"image_tokens={image_tokens}{where}, expected_image_tokens={expected}, "
            f"image_grid_thw={grid.tolist()}, merge_size={effective_merge}, placeholder={placeholder_token!r}",
            image_tokens=image_tokens,
            expected=expected,
        )


def _merge_size(configured: int | None, processor: Any, prefix: str) -> int | None:
    from_processor = processor_merge_size(processor)
    if configured is not None and from_processor is not None and configured != from_processor:
        raise MultimodalError(
            f"{prefix}merge_size {configured} from the config differs from the processor's {from_processor}"
        )
    return configured or from_processor


def _matching_merge_hint(grid: Any, image_tokens: int) -> str:
    """Which merge size the placeholder count fits, as a hint (the grids alone do not determine it)."""
    fitting = [merge for merge in range(1, 9)
               if int((grid.prod(dim=1) // (merge * merge)).sum().item()) == image_tokens]
    return f" (the placeholder count fits merge_size {fitting[0]})" if len(fitting) == 1 and image_tokens else ""
