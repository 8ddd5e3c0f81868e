"""The image-token check: the placeholder tokens of a sample must match the image grids of its training features.

The placeholders must number ``sum(t*h*w) / merge_size**2``. The placeholder token is configurable; a text-only
sample never fails because the tokenizer lacks it. When neither the config nor the processor knows the merge size,
image features are an error that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsm_rollout.errors import (
    ImageFeaturesMissingError,
    ImageMergeSizeUnknownError,
    ImageTokenMismatchError,
    MalformedFeaturesError,
    MultimodalError,
)
from fsm_rollout.multimodal._prefix import sample_prefix
from fsm_rollout.multimodal.merge_size import processor_merge_size

IMAGE_PAD_TOKEN = "<|image_pad|>"
"""The default image placeholder token (Qwen-VL's)."""

IMAGE_GRID_DIMENSIONS = 3


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
    """Check that the image placeholder tokens match the image grids of the training features.

    The placeholders in all of ``tokens`` must number ``sum(t*h*w) // merge_size**2`` over
    ``train_inputs["image_grid_thw"]``. ``merge_size`` (the config's) and the processor's must agree when both
    are known; with neither, image grids are an :class:`~fsm_rollout.errors.ImageMergeSizeUnknownError` (no
    merge size is guessed). A sample without image features and without placeholders passes, whether or not the
    tokenizer knows ``placeholder_token``. ``prompt_length`` only refines the error message.
    """
    prefix = sample_prefix(sample_id)
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
    fitting = [
        merge for merge in range(1, 9) if int((grid.prod(dim=1) // (merge * merge)).sum().item()) == image_tokens
    ]
    return f" (the placeholder count fits merge_size {fitting[0]})" if len(fitting) == 1 and image_tokens else ""
