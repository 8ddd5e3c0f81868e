"""What the embedded engine adds to the serving frame's request checks (:mod:`fsm_rollout.engine.serving`): the
features it does not implement are refused, image parts and ``features`` are checked, and the weight-transfer
payload of ``/update_weights`` is read.

Everything here is pure Python (no torch, no aiohttp): a bad request becomes a
:class:`~fsm_rollout.engine.schema.RequestError` that the server answers with vLLM's error body, a good one a frozen
record the model code can trust.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.engine.schema import RequestError, integer_field, is_int
from fsm_rollout.engine.serving import MAX_LOGPROBS, GenerateRequest, RenderRequest, SamplingSettings

__all__ = [
    "LOCAL_FILES_REFUSED",
    "MAX_LOGPROBS",
    "REMOTE_IMAGES_REFUSED",
    "ImageFeatures",
    "RenderInput",
    "SamplingSettings",
    "UpdateWeightsInput",
    "check_generate",
    "parse_features",
    "parse_update_weights",
    "render_input",
]

REMOTE_IMAGES_REFUSED: Final = (
    "fetching remote images is not supported by the embedded engine ({where}); send the image inline as a "
    "'data:image/png;base64,...' URL (the rollout client does this for PIL images, data: URLs and local paths)"
)
LOCAL_FILES_REFUSED: Final = (
    "local image files (file:// URLs) are not supported by the embedded engine ({where}); vLLM reads them only "
    "with --allowed-local-media-path. Send the image inline as a 'data:image/png;base64,...' URL"
)

# Content part types that carry an image URL (OpenAI chat's image_url, the Responses API's input_image).
_IMAGE_URL_PART_TYPES: Final = frozenset({"image_url", "input_image"})
# Media parts vLLM knows that the embedded engine does not serve (or that a client must convert first).
_OTHER_MEDIA_PART_TYPES: Final = frozenset(
    {
        "image",
        "image_pil",
        "image_embeds",
        "video",
        "video_url",
        "video_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "prompt_embeds",
    }
)

# Sampling fields the engine does not implement, with the values that mean "off". Any other value is refused
# rather than silently ignored, so a request never gets a different distribution than it asked for.
_UNSUPPORTED_SAMPLING: Final[Mapping[str, tuple[Any, ...]]] = {
    "best_of": (None, 1),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "guided_decoding": (None,),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
}


@dataclass(frozen=True)
class ImageFeatures:
    """The image part of a generate request's ``features``, structurally valid and inside ``token_ids``.

    One entry per image, in the order the request lists them: ``placeholders`` holds ``(offset, length)``,
    ``items`` the base64 ``kwargs_data`` item (None when not sent), ``metadata`` the ``mm_metadata`` item (None
    when not sent). The items are decoded and checked against the tokens by
    :meth:`fsm_rollout.engine.local.images.ImageSupport.check_features`.
    """

    placeholders: tuple[tuple[int, int], ...]
    items: tuple[str | None, ...]
    metadata: tuple[str | None, ...]


@dataclass(frozen=True)
class RenderInput:
    """A validated ``POST /v1/chat/completions/render`` body: what the chat template needs, the sampling
    fields to echo back, and the ``data:`` URLs of the image parts in message and part order (``image_places``
    names each one's part, ``messages[i].content[j]``, for error messages).

    ``with_tensors`` is vLLM's ``mm_payload``: True ("tensors", the default) sends the image tensors in
    ``features.kwargs_data``, False ("none") sends hashes and placeholders only.
    """

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    sampling_params: dict[str, Any]
    image_urls: tuple[str, ...] = ()
    image_places: tuple[str, ...] = ()
    with_tensors: bool = True


@dataclass(frozen=True)
class UpdateWeightsInput:
    """A validated ``POST /update_weights`` body: the local ``.safetensors`` file to load, and the weight version to
    set with it (None keeps the current one)."""

    path: str
    weight_version: str | None


def parse_update_weights(info: Any) -> UpdateWeightsInput:
    """``update_info`` of ``POST /update_weights``: ``{"path": str, "weight_version": str | null}``, the embedded
    engine's weight-transfer payload (vLLM's ``update_info`` is whatever its weight-transfer backend takes)."""
    if not isinstance(info, dict):
        raise RequestError(400, "update_info: Field required (an object with a 'path')", "update_info")
    path = info.get("path")
    if not isinstance(path, str) or not path:
        raise RequestError(
            400, f"update_info.path: Field required (a local .safetensors file), got {path!r}", "update_info"
        )
    version = info.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise RequestError(
            400, f"update_info.weight_version: Input should be a string or null, got {version!r}", "update_info"
        )
    return UpdateWeightsInput(path=path, weight_version=version)


def check_generate(request: GenerateRequest) -> ImageFeatures | None:
    """Refuse what the embedded engine does not implement in a generate request the frame accepted (raw media,
    text output, ``n > 1`` and the sampling features in ``_UNSUPPORTED_SAMPLING``); its image
    ``features`` placed inside the prompt (None for a text-only prompt)."""
    body = request.body
    if body.get("content_parts") is not None:
        raise RequestError(
            400,
            "content_parts (raw media for the server to fetch and process) is not supported by the embedded engine; "
            "render the messages first and send the features render returned",
            "content_parts",
        )
    features = parse_features(body.get("features"), prompt_len=request.prompt_len)
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in (None, "tokens"):
        raise RequestError(
            400, f"output_mode {output_mode!r} is not supported by the embedded engine; use 'tokens'", "output_mode"
        )
    sampling = body["sampling_params"]  # the frame checked it is an object
    for name, neutral in _UNSUPPORTED_SAMPLING.items():
        if name in sampling and sampling[name] not in neutral:
            raise RequestError(400, f"sampling_params.{name} is not supported by the embedded engine", name)
    n = integer_field(sampling, "n", 1)
    if n != 1:
        raise RequestError(400, f"n must be 1 on the embedded engine, got {n}.", "n")
    return features


def parse_features(value: Any, *, prompt_len: int) -> ImageFeatures | None:
    """Validate a generate request's ``features`` as vLLM's ``MultiModalFeatures`` does, and place them inside
    the ``prompt_len`` prompt tokens; None when there are none (or they name no image).

    Checked: ``mm_hashes`` and ``mm_placeholders`` name the same modalities with parallel lists; ``kwargs_data``
    and ``mm_metadata`` are null or parallel to them; offsets are ``>= 0``, lengths ``> 0``, the ranges sorted
    without overlap; every range ends within ``token_ids``; the only modality is ``image``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(400, f"features: Input should be a valid dictionary, got {type(value).__name__}", "features")
    hashes = _modality_lists(value, "mm_hashes")
    placeholders = _modality_lists(value, "mm_placeholders")
    payloads = {name: _modality_lists(value, name, nullable=True) for name in ("kwargs_data", "mm_metadata")}
    if hashes is None or placeholders is None:
        raise RequestError(400, "features: mm_hashes and mm_placeholders are required", "features")
    if set(placeholders) != set(hashes):
        raise RequestError(400, "features: mm_hashes and mm_placeholders must use the same modalities", "features")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for modality, modality_hashes in hashes.items():
        if not all(isinstance(item, str) for item in modality_hashes):
            raise RequestError(400, f"features.mm_hashes.{modality}: every hash must be a string", "features")
        if len(placeholders[modality]) != len(modality_hashes):
            raise RequestError(
                400, f"features: {modality} mm_hashes and mm_placeholders must have the same length", "features"
            )
        ranges[modality] = [
            _placeholder(entry, f"features.mm_placeholders.{modality}[{index}]")
            for index, entry in enumerate(placeholders[modality])
        ]
    for name, payload in payloads.items():
        if payload is None:
            continue
        if set(payload) != set(hashes):
            raise RequestError(400, f"features: {name} must use the same modalities as mm_hashes", "features")
        for modality, items in payload.items():
            if len(items) != len(hashes[modality]):
                raise RequestError(
                    400, f"features: {modality} {name} and mm_hashes must have the same length", "features"
                )
            if not all(item is None or isinstance(item, str) for item in items):
                raise RequestError(
                    400, f"features.{name}.{modality}: every item must be base64 text or null", "features"
                )
    spans = sorted((offset, offset + length) for entries in ranges.values() for offset, length in entries)
    for (_, end), (next_offset, _) in itertools.pairwise(spans):
        if next_offset < end:
            raise RequestError(400, "features: mm_placeholders must be globally non-overlapping and sorted", "features")
    if spans and spans[-1][1] > prompt_len:
        raise RequestError(
            400,
            f"features: the placeholder range [{spans[-1][0]}, {spans[-1][1]}) exceeds the {prompt_len} token_ids "
            "of the request",
            "features",
        )
    other = sorted(set(hashes) - {"image"})
    if other:
        raise RequestError(
            400, f"features carry {', '.join(other)} items: the embedded engine serves images only", "features"
        )
    if not ranges.get("image"):
        return None
    count = len(ranges["image"])
    kwargs_data, metadata = payloads["kwargs_data"], payloads["mm_metadata"]
    return ImageFeatures(
        placeholders=tuple(ranges["image"]),
        items=tuple(kwargs_data["image"]) if kwargs_data is not None else (None,) * count,
        metadata=tuple(metadata["image"]) if metadata is not None else (None,) * count,
    )


def render_input(request: RenderRequest) -> RenderInput:
    """What the engine renders for a render request the frame accepted, with the ``data:`` URLs of its image parts.

    Image parts (``image_url``/``input_image``) must carry ``data:`` URLs: ``http(s)`` and ``file`` URLs, other
    schemes and other media parts (video, audio, embeddings, unconverted ``image`` parts) are refused with 400.
    """
    images: list[tuple[str, str]] = []
    for index, message in enumerate(request.messages):
        images.extend(_image_urls(message.get("content"), f"messages[{index}]"))
    return RenderInput(
        messages=request.messages,
        tools=request.tools,
        template_kwargs=request.template_kwargs,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        sampling_params=request.sampling_params,
        image_urls=tuple(url for url, _ in images),
        image_places=tuple(place for _, place in images),
        with_tensors=request.mm_payload != "none",
    )


def _image_urls(content: Any, where: str) -> list[tuple[str, str]]:
    """The ``data:`` URLs of a message's image parts with their places, in order; other media and other URLs are
    refused."""
    if not isinstance(content, list):
        return []
    urls: list[tuple[str, str]] = []
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        place = f"{where}.content[{index}]"
        kind = part.get("type")
        if kind in _IMAGE_URL_PART_TYPES or (kind is None and "image_url" in part):
            urls.append((_image_url(part.get("image_url"), place), place))
        elif kind in _OTHER_MEDIA_PART_TYPES or (kind is None and any(key in part for key in _OTHER_MEDIA_PART_TYPES)):
            what = kind if isinstance(kind, str) else next(key for key in part if key in _OTHER_MEDIA_PART_TYPES)
            raise RequestError(
                400,
                f"{place} is a media part of type {what!r}: the embedded engine serves images only, as 'image_url' "
                "parts whose URL is a 'data:image/...;base64,...' URL",
                "messages",
            )
    return urls


def _image_url(value: Any, where: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(400, f"{where}: image_url must be {{'url': str}} or a URL string", "messages")
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return url
    if scheme in ("http", "https"):
        raise RequestError(400, REMOTE_IMAGES_REFUSED.format(where=where), "messages")
    if scheme == "file":
        raise RequestError(400, LOCAL_FILES_REFUSED.format(where=where), "messages")
    raise RequestError(
        400,
        f"The URL must be either a HTTP, data or file URL ({where}); the embedded engine reads 'data:' URLs only "
        "(send a local image as 'data:image/png;base64,...')",
        "messages",
    )


def _modality_lists(features: Mapping[str, Any], name: str, *, nullable: bool = False) -> dict[str, list[Any]] | None:
    """``features[name]`` as ``{modality: list}``; None when missing or null (an error unless ``nullable``)."""
    value = features.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(modality, str) and isinstance(items, list) for modality, items in value.items()
    ):
        kind = "a dictionary of modality to list" + (", or null" if nullable else "")
        raise RequestError(400, f"features.{name}: Input should be {kind}", "features")
    return value


def _placeholder(entry: Any, where: str) -> tuple[int, int]:
    """``(offset, length)`` of one ``{"offset", "length"}`` placeholder (vLLM's ``PlaceholderRangeInfo``)."""
    if isinstance(entry, dict):
        offset, length = entry.get("offset"), entry.get("length")
        if is_int(offset) and is_int(length) and offset >= 0 and length > 0:
            return offset, length
    raise RequestError(
        400, f"{where}: a placeholder must be {{'offset': int >= 0, 'length': int > 0}}, got {entry!r:.80}", "features"
    )
