"""Images in prompts: initial chat messages, images as render URLs, training features and image-token checks."""

from __future__ import annotations

import base64
import importlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_rollout.errors import ImageInputError, MultimodalError

IMAGE_PAD_TOKEN = "<|image_pad|>"
IMAGE_GRID_DIMENSIONS = 3
_VLLM_MM_SERDE_MODULES = (
    "vllm.entrypoints.scale_out.token_in_token_out.mm_serde",
    "vllm.frontend.entrypoints.scale_out.token_in_token_out.mm_serde",
    "vllm.entrypoints.serve.disagg.mm_serde",
)


def build_initial_messages(prompt: Any, images: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The first chat messages: a message-list prompt is copied; a string prompt becomes one user message.

    A string prompt gets one image part per image, then its text with every ``<image>`` removed and leading
    whitespace stripped.
    """
    if isinstance(prompt, list):
        return [dict(message) for message in prompt]
    content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images or ()]
    content.append({"type": "text", "text": str(prompt).replace("<image>", "").lstrip()})
    return [{"role": "user", "content": content}]


def encode_pil_image(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (converted to RGB first when needed)."""
    if not hasattr(image, "mode") or not hasattr(image, "save"):
        raise ImageInputError(f"expected a PIL image, got {type(image).__name__}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_to_render_url(image: Any) -> str:
    """An image as a URL vLLM's render accepts: PIL image, ``data:`` URL, ``http(s)://`` URL or local path."""
    if not isinstance(image, str):
        return encode_pil_image(image)
    if image.startswith("data:"):
        return image.replace("data:image/None;", "data:image/png;", 1)
    if image.startswith(("http://", "https://")):
        return image
    path = Path(image).expanduser()
    if not path.is_file():
        raise ImageInputError(
            f"Unsupported image string for vLLM render: {image[:80]!r} (not a data: URL, an http(s) URL, or an "
            "existing file)"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as loaded:
            return encode_pil_image(loaded)
    except (UnidentifiedImageError, OSError) as error:
        raise ImageInputError(f"cannot read image file {str(path)!r}: {error}") from error


def messages_for_render(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages for the render request, turning ``image`` parts into ``image_url`` parts."""
    rendered: list[dict[str, Any]] = []
    for message_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict):
                raise ImageInputError(
                    f"messages[{message_index}].content[{part_index}] must be a dict, got {type(part).__name__}"
                )
            if part.get("type") == "image" and part.get("image") is not None:
                try:
                    url = image_to_render_url(part["image"])
                except ImageInputError as error:
                    raise ImageInputError(f"messages[{message_index}].content[{part_index}]: {error}") from error
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                parts.append(dict(part))
        rendered.append({**message, "content": parts})
    return rendered


def _vllm_decoder() -> Any:
    for name in _VLLM_MM_SERDE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        decoder = getattr(module, "decode_mm_kwargs_item", None)
        if decoder is not None:
            return decoder
    raise MultimodalError(
        "render features carry image items, but vLLM's decode_mm_kwargs_item is not importable here; install "
        "the 'vllm' extra in the trainer process"
    )


def decode_train_features(features: Any) -> dict[str, Any] | None:
    """Decode render ``features.kwargs_data["image"]`` into training tensors (``pixel_values``, ``image_grid_thw``).

    Returns None when there are no image features. Several images are concatenated along dim 0; a 1-D
    ``image_grid_thw`` is reshaped to ``(1, 3)``.
    """
    if not features:
        return None
    decoded = json.loads(features) if isinstance(features, str) else features
    if not isinstance(decoded, dict):
        raise MultimodalError(f"vLLM features must decode to a dictionary, got {type(decoded).__name__}")
    kwargs_data = decoded.get("kwargs_data")
    if not isinstance(kwargs_data, dict) or "image" not in kwargs_data:
        return None
    items = kwargs_data["image"]
    if not isinstance(items, list):
        raise MultimodalError("vLLM features.kwargs_data.image must be a list")
    for index, item in enumerate(items):
        if item is None:
            raise MultimodalError(
                f"features.kwargs_data.image[{index}] is null (vLLM's multimodal cache hit): start the server with "
                "--mm-processor-cache-gb 0 so render always sends the image features"
            )
    decode = _vllm_decoder()
    import torch

    parts_by_key: dict[str, list[Any]] = {}
    for encoded in items:
        for key, value in decode(encoded).get_data().items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "image_grid_thw" and value.dim() == 1:
                value = value.reshape(1, -1)
            parts_by_key.setdefault(key, []).append(value)
    return {key: values[0] if len(values) == 1 else torch.cat(values, dim=0) for key, values in parts_by_key.items()}


def image_pad_token_id(tokenizer: Any) -> int | None:
    """The id of ``<|image_pad|>``, or None when the tokenizer does not know it."""
    token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(token_id)


def validate_image_tokens(
    tokens: Sequence[int], tokenizer: Any, processor: Any, train_inputs: dict[str, Any] | None
) -> None:
    """Check that the image placeholder tokens match the image grids of the training features."""
    image_token_id = image_pad_token_id(tokenizer)
    if image_token_id is None:
        if train_inputs:
            raise MultimodalError(f"the tokenizer does not define {IMAGE_PAD_TOKEN}, but the prompt has images")
        return
    image_tokens = sum(1 for token in tokens if token == image_token_id)
    if image_tokens == 0:
        return
    grid = None if not train_inputs else train_inputs.get("image_grid_thw")
    if grid is None:
        raise MultimodalError(f"Found {image_tokens} image tokens, but multimodal render features are missing.")
    grid = grid.reshape(-1, IMAGE_GRID_DIMENSIONS)
    image_processor = getattr(processor, "image_processor", processor)
    merge_size = int(getattr(image_processor, "merge_size", 1) or 1)
    expected = int((grid.prod(dim=1) // (merge_size * merge_size)).sum().item())
    if image_tokens != expected:
        raise MultimodalError(
            "Image token count does not match multimodal render features: "
            f"image_tokens={image_tokens}, expected_image_tokens={expected}, image_grid_thw={grid.tolist()}"
        )
