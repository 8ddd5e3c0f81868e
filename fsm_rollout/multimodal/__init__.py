"""Images in prompts: initial chat messages, images as render URLs, training features and image-token checks.

The rules, with the seed's fragile spots made strict:

* A string prompt becomes one user message: one image part per image, then the text without ``<image>``
  (:mod:`~fsm_rollout.multimodal.messages`).
* Every image becomes a URL vLLM's render accepts, before any request is sent: a PIL image (PNG data URL), a
  ``data:`` URL (Geo3K's ``image/None`` fixed to ``image/png``; the payload must be base64 of an image), an
  ``http(s)://`` URL (passed through) or a local path (``~`` expanded; must be an image file). Anything else is
  an :class:`~fsm_rollout.errors.ImageInputError` naming the sample and the image index
  (:mod:`~fsm_rollout.multimodal.images`).
* The render answer's ``features.kwargs_data["image"]`` items are decoded into training tensors with vLLM's codec
  when it is importable, else with :mod:`fsm_rollout.multimodal.codec` (same wire format, bit-identical tensors)
  (:mod:`~fsm_rollout.multimodal.features`).
* The image placeholder tokens must number ``sum(t*h*w) / merge_size**2``. The placeholder token is configurable;
  a text-only sample never fails because the tokenizer lacks it (:mod:`~fsm_rollout.multimodal.image_tokens`).
  The merge size comes from the config or the processor (:func:`load_image_processor` finds one for checkpoints
  whose full processor does not load; :mod:`~fsm_rollout.multimodal.merge_size`); when neither knows it, image
  features are an error that says so.
* Images in observations are rendered by the engine after a dummy prefix; their features are placed in the
  sample's sequence and merged into its cumulative features, and their size is limited
  (:mod:`~fsm_rollout.multimodal.observations`).
* Only content hashes of the images (:attr:`RenderMessages.image_hashes`) are meant for traces, never the images.

Every public name of the submodules is importable from here.

Its modules are internal: import from this package.
"""

from fsm_rollout.multimodal.features import (
    NULL_ITEM_ADVICE,
    VLLM_MM_SERDE_MODULES,
    decode_train_features,
    feature_item_decoder,
)

# Tests clear this decoder cache through the package, as they did when it was one module.
from fsm_rollout.multimodal.image_tokens import (
    IMAGE_GRID_DIMENSIONS,
    IMAGE_PAD_TOKEN,
    image_pad_token_id,
    validate_image_tokens,
)
from fsm_rollout.multimodal.images import (
    RenderMessages,
    encode_pil_image,
    fast_png,
    image_content_hash,
    image_to_render_url,
    messages_for_render,
    prepare_render_messages,
    without_image_data,
)
from fsm_rollout.multimodal.merge_size import (
    PREPROCESSOR_CONFIG,
    CheckpointImageConfig,
    checkpoint_merge_size,
    load_image_processor,
    processor_merge_size,
)
from fsm_rollout.multimodal.messages import build_initial_messages, is_image_part
from fsm_rollout.multimodal.observations import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageLimits,
    check_encoded_sizes,
    check_image_limits,
    check_observation_parts,
    check_observation_tokens,
    fill_null_items,
    image_features,
    known_items,
    merge_features,
    observation_image_count,
    place_features,
)

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_GRID_DIMENSIONS",
    "IMAGE_PAD_TOKEN",
    "NULL_ITEM_ADVICE",
    "PREPROCESSOR_CONFIG",
    "VLLM_MM_SERDE_MODULES",
    "CheckpointImageConfig",
    "ImageLimits",
    "RenderMessages",
    "build_initial_messages",
    "check_encoded_sizes",
    "check_image_limits",
    "check_observation_parts",
    "check_observation_tokens",
    "checkpoint_merge_size",
    "decode_train_features",
    "encode_pil_image",
    "fast_png",
    "feature_item_decoder",
    "fill_null_items",
    "image_content_hash",
    "image_features",
    "image_pad_token_id",
    "image_to_render_url",
    "is_image_part",
    "known_items",
    "load_image_processor",
    "merge_features",
    "messages_for_render",
    "observation_image_count",
    "place_features",
    "prepare_render_messages",
    "processor_merge_size",
    "validate_image_tokens",
    "without_image_data",
]
