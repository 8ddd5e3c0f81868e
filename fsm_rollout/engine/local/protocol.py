"""The embedded engine's request bodies as typed records: vLLM's field checks
(:mod:`fsm_rollout.engine.schema.requests`) plus what this engine does not implement.

Everything here is pure Python (no torch, no aiohttp): a bad request becomes a
:class:`~fsm_rollout.engine.schema.RequestError` that the server answers with vLLM's error body, a good one a frozen
record the model code can trust.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from fsm_rollout.engine.schema import (
    RequestError,
    boolean_field,
    check_message,
    check_prompt_room,
    generate_request_id,
    integer_field,
    is_int,
    message_list,
    number_field,
    render_sampling_params,
    render_template_kwargs,
    render_tools,
    request_sampling_params,
    request_token_ids,
    resolve_max_tokens,
    stop_strings,
    stop_token_ids,
)

MAX_LOGPROBS: Final = 20
"""The most ``logprobs`` (top candidates per token) a request may ask for, as vLLM's default ``max_logprobs``."""

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
_MM_PAYLOADS: Final = ("tensors", "none")

# Sampling fields the engine does not implement, with the values that mean "off". Any other value is refused
# rather than silently ignored, so a request never gets a different distribution than it asked for.
_UNSUPPORTED_SAMPLING: Final[Mapping[str, tuple[Any, ...]]] = {
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
}


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """The validated sampling parameters of one generate request (vLLM ``SamplingParams`` semantics).

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``max_tokens`` is always resolved: a request without it gets the rest of the context, as in vLLM.
    ``logprobs`` is None (no logprobs in the answer) or how many top candidates to list beside the sampled token.
    ``skip_special_tokens`` decides how the output is decoded for the stop-string check.

    There is no ``include_stop_str_in_output``: in token-out mode vLLM always returns the tokens that complete a
    stop string (only a text answer would be trimmed), and so does this engine, whatever the flag says.
    """

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax (vLLM treats temperatures below 1e-5 as greedy)."""
        return self.temperature < 1e-5


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
class GenerateInput:
    """A validated ``POST /inference/v1/generate`` body; ``features`` is None for a text-only prompt."""

    request_id: str
    token_ids: list[int]
    settings: SamplingSettings
    features: ImageFeatures | None = None


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


def parse_update_weights(body: Mapping[str, Any]) -> UpdateWeightsInput:
    """``{"update_info": {"path": str, "weight_version": str | null}}``, the embedded engine's weight-transfer
    payload (vLLM's ``update_info`` is whatever its weight-transfer backend takes)."""
    info = body.get("update_info")
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


def parse_generate(
    body: Mapping[str, Any], *, max_model_len: int, vocab_size: int, new_request_id: str
) -> GenerateInput:
    """Validate a generate body; ``new_request_id`` is used when the body names none."""
    token_ids = request_token_ids(body, vocab_size=vocab_size)
    if body.get("content_parts") is not None:
        raise RequestError(
            400,
            "content_parts (raw media for the server to fetch and process) is not supported by the embedded engine; "
            "render the messages first and send the features render returned",
            "content_parts",
        )
    features = parse_features(body.get("features"), prompt_len=len(token_ids))
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported by the embedded engine; send stream=false", "stream")
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in (None, "tokens"):
        raise RequestError(
            400, f"output_mode {output_mode!r} is not supported by the embedded engine; use 'tokens'", "output_mode"
        )
    request_id = generate_request_id(body, new_request_id)
    sampling = request_sampling_params(body)
    prompt_len = len(token_ids)
    check_prompt_room(prompt_len, max_model_len)
    settings = parse_sampling_params(sampling, prompt_len=prompt_len, max_model_len=max_model_len)
    return GenerateInput(request_id=request_id, token_ids=token_ids, settings=settings, features=features)


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


def parse_sampling_params(sampling: Mapping[str, Any], *, prompt_len: int, max_model_len: int) -> SamplingSettings:
    """Validate vLLM ``sampling_params`` (unknown keys are ignored, unsupported features refused)."""
    for name, neutral in _UNSUPPORTED_SAMPLING.items():
        if name in sampling and sampling[name] not in neutral:
            raise RequestError(400, f"sampling_params.{name} is not supported by the embedded engine", name)
    n = integer_field(sampling, "n", 1)
    if n != 1:
        raise RequestError(400, f"n must be 1 on the embedded engine, got {n}.", "n")

    max_tokens = resolve_max_tokens(sampling, prompt_len=prompt_len, max_model_len=max_model_len)
    min_tokens = integer_field(sampling, "min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise RequestError(400, f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}.", "min_tokens")

    temperature = number_field(sampling, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(400, f"temperature must be non-negative, got {temperature}.", "temperature")
    top_p = number_field(sampling, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = integer_field(sampling, "top_k", 0)
    if top_k < -1:
        raise RequestError(400, f"top_k must be 0 or -1 (disabled) or at least 1, got {top_k}.", "top_k")
    min_p = number_field(sampling, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise RequestError(400, f"min_p must be in [0, 1], got {min_p}.", "min_p")
    repetition_penalty = number_field(sampling, "repetition_penalty", 1.0)
    if repetition_penalty <= 0:
        raise RequestError(
            400, f"repetition_penalty must be greater than zero, got {repetition_penalty}.", "repetition_penalty"
        )
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = number_field(sampling, name, 0.0)
        if not -2 <= penalties[name] <= 2:
            raise RequestError(400, f"{name} must be in [-2, 2], got {penalties[name]}.", name)

    boolean_field(sampling, "include_stop_str_in_output", False)  # checked only: see SamplingSettings
    seed = integer_field(sampling, "seed", None)
    logprobs = integer_field(sampling, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(
            400, f"logprobs must be in [0, {MAX_LOGPROBS}] on the embedded engine, got {logprobs}.", "logprobs"
        )
    return SamplingSettings(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=min_p,
        seed=seed,
        stop=stop_strings(sampling.get("stop")),
        stop_token_ids=stop_token_ids(sampling.get("stop_token_ids")),
        ignore_eos=boolean_field(sampling, "ignore_eos", False),
        skip_special_tokens=boolean_field(sampling, "skip_special_tokens", True),
        logprobs=logprobs,
        repetition_penalty=repetition_penalty,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
    )


def parse_render(body: Mapping[str, Any]) -> RenderInput:
    """Validate a chat render body (an OpenAI ``ChatCompletionRequest``).

    Image parts (``image_url``/``input_image``) must carry ``data:`` URLs: ``http(s)`` and ``file`` URLs, other
    schemes and other media parts (video, audio, embeddings, unconverted ``image`` parts) are refused with 400.
    """
    messages = message_list(body)
    images: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        check_message(message, index)  # each message before its images, so the first fault is the one named
        images.extend(_image_urls(message.get("content"), f"messages[{index}]"))
    tools = render_tools(body)
    template_kwargs = render_template_kwargs(body)
    add_generation_prompt = boolean_field(body, "add_generation_prompt", True)
    continue_final_message = boolean_field(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise RequestError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "messages"
        )
    mm_payload = body.get("mm_payload")
    if mm_payload is not None and mm_payload not in _MM_PAYLOADS:
        raise RequestError(400, f"mm_payload: Input should be 'tensors' or 'none', got {mm_payload!r}", "mm_payload")
    return RenderInput(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        sampling_params=render_sampling_params(body),
        image_urls=tuple(url for url, _ in images),
        image_places=tuple(place for _, place in images),
        with_tensors=mm_payload != "none",
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
