"""A Qwen2-VL-like image render for the fake server: what ``vllm serve`` does to a conversation's images, simplified.

:class:`QwenLikeImageRender` is a ``render_features`` hook (:data:`~fsm_rollout.testing.fake_vllm.RenderFeaturesHook`):
it cuts each image into ``PATCH`` x ``PATCH`` patches (no resizing: sides must be multiples of ``PATCH * MERGE``),
expands every ``<|image_pad|>`` of the template's ids to ``t*h*w / MERGE**2`` placeholders, and answers the image
tensors in vLLM's wire format (:mod:`fsm_rollout.multimodal.codec`), as vLLM does for Qwen2-VL. Images may be in any
message of the conversation (a prompt's, an observation's after a dummy prefix). Options imitate vLLM's
processor cache: ``cache_hits`` leaves out the tensors of an image the hook has answered before (a null item, as
vLLM's render may), and ``null_item`` nulls one item of every answer.

numpy, torch and Pillow are imported when an image is rendered.
"""

from __future__ import annotations

import base64
import io
from typing import Any, Final

from fsm_rollout.multimodal.codec import qwen_vl_image_items, render_features

PATCH: Final = 8
"""Pixels per patch side."""
MERGE: Final = 2
"""Patches merged per side into one placeholder token (the processor's ``merge_size``)."""
PAD_TOKEN: Final = "<|image_pad|>"


def patchify(image: Any) -> tuple[Any, tuple[int, int, int]]:
    """Qwen2-VL-style pixel rows of a PIL image: one row of ``3 * PATCH * PATCH`` floats per patch, and its
    ``(t, h, w)`` grid. Each side must be a multiple of ``PATCH * MERGE``."""
    import numpy as np

    if image.width % (PATCH * MERGE) or image.height % (PATCH * MERGE):
        raise ValueError(f"image sides must be multiples of {PATCH * MERGE}, got {image.width}x{image.height}")
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    height, width = pixels.shape[0] // PATCH, pixels.shape[1] // PATCH
    patches = pixels.reshape(height, PATCH, width, PATCH, 3).transpose(0, 2, 4, 1, 3)
    return patches.reshape(height * width, 3 * PATCH * PATCH), (1, height, width)


def load_data_url(url: str) -> Any:
    """The PIL image of a base64 ``data:`` URL."""
    from PIL import Image

    header, _, payload = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError(f"only base64 data: URLs are rendered, got {url[:40]!r}")
    return Image.open(io.BytesIO(base64.b64decode(payload)))


class QwenLikeImageRender:
    """The fake server's ``render_features`` hook: what vLLM's Qwen2-VL processor does to a conversation.

    ``answers`` keeps every ``(ids, features)`` answered, in order.
    """

    def __init__(self, tokenizer: Any, *, null_item: int | None = None, cache_hits: bool = False) -> None:
        self.pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        self.null_item = null_item
        self.cache_hits = cache_hits
        self.answers: list[tuple[list[int], dict[str, Any] | None]] = []
        self._seen: set[str] = set()

    def __call__(self, messages: list[dict[str, Any]], ids: list[int]) -> tuple[list[int], dict[str, Any] | None]:
        import numpy as np
        import torch

        urls = [
            part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
            for message in messages
            if isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image_url"
        ]
        if not urls:
            self.answers.append((ids, None))
            return ids, None
        rows, grids = zip(*(patchify(load_data_url(url)) for url in urls), strict=True)
        counts = [t * h * w // MERGE**2 for t, h, w in grids]
        expanded: list[int] = []
        placeholders: list[tuple[int, int]] = []
        for token in ids:
            if token == self.pad_id:
                placeholders.append((len(expanded), counts[len(placeholders)]))
                expanded.extend([self.pad_id] * placeholders[-1][1])
            else:
                expanded.append(token)
        items = qwen_vl_image_items(torch.from_numpy(np.concatenate(rows)), torch.tensor(grids))
        features = render_features(items, placeholders)
        for index, digest in enumerate(features["mm_hashes"]["image"]):
            if self.cache_hits and digest in self._seen:
                features["kwargs_data"]["image"][index] = None
            self._seen.add(digest)
        if self.null_item is not None:
            features["kwargs_data"]["image"][self.null_item] = None
        self.answers.append((expanded, features))
        return expanded, features


__all__ = ["MERGE", "PAD_TOKEN", "PATCH", "QwenLikeImageRender", "load_data_url", "patchify"]
