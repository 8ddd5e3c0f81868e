"""The first chat messages of a sample, built from its prompt and images, and which message parts are images."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsm_rollout.errors import ImageInputError, PromptError


def build_initial_messages(prompt: Any, images: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The first chat messages: a message-list prompt is copied; a string prompt becomes one user message.

    A string prompt gets one image part per image, then its text with every ``<image>`` removed and leading
    whitespace stripped.
    """
    if images is not None and not isinstance(images, list | tuple):
        raise ImageInputError(f"multimodal_inputs['images'] must be a list of images, got {type(images).__name__}")
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


def is_image_part(part: Any) -> bool:
    """Whether a message content part carries an image (``image``/``image_url`` type or key)."""
    if not isinstance(part, dict):
        return False
    return part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part
