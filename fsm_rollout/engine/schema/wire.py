"""vLLM's token-in/token-out wire format: the endpoint paths, the JSON records each endpoint receives and answers,
and the small facts both directions share (finish reasons, request ids, token-id checks, error bodies).

The records are :class:`~typing.TypedDict` shapes of vLLM 0.32's JSON, for the servers that build them; what a
client receives is untrusted and parsed by :mod:`fsm_rollout.engine.schema.answers` instead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final, Literal, NotRequired, TypedDict, TypeGuard, get_args

from fsm_rollout.types import Finish

# ---------------------------------------------------------------------------------------------------- endpoints

RENDER_PATH: Final = "/v1/chat/completions/render"
GENERATE_PATH: Final = "/inference/v1/generate"
ABORT_PATH: Final = "/inference/v1/abort_requests"
HEALTH_PATH: Final = "/health"
MODELS_PATH: Final = "/v1/models"

# Weight-update endpoints (vLLM serves them with VLLM_SERVER_DEV_MODE=1).
PAUSE_PATH: Final = "/pause"
"""``POST /pause?mode=abort|wait|keep`` answers ``{"status": "paused"}``."""
RESUME_PATH: Final = "/resume"
"""``POST /resume`` answers ``{"status": "resumed"}``."""
IS_PAUSED_PATH: Final = "/is_paused"
"""``GET /is_paused`` answers ``{"is_paused": bool}``."""
UPDATE_WEIGHT_VERSION_PATH: Final = "/update_weight_version"
"""``POST /update_weight_version {"new_version": str}`` answers ``{"success": true, "new_version": str}``."""
WEIGHT_INFO_PATH: Final = "/weight_info"
"""``GET /weight_info`` answers ``{"weight_version": str}``."""
UPDATE_WEIGHTS_PATH: Final = "/update_weights"
"""``POST /update_weights {"update_info": {...}}``: the payload is the weight-transfer backend's; the embedded engine
takes ``{"path": <local .safetensors file>, "weight_version": str | None}``."""

PauseMode = Literal["abort", "wait", "keep"]
"""How ``/pause`` treats requests in flight: abort them (they answer ``abort`` with their tokens so far), let them
finish, or freeze them until ``/resume``."""

PAUSE_MODES: Final[tuple[PauseMode, ...]] = get_args(PauseMode)
"""The :data:`PauseMode` values, in vLLM's order; ``abort`` is vLLM's default."""

DEFAULT_WEIGHT_VERSION: Final = "default"
"""The weight version vLLM reports until ``/update_weight_version`` sets one."""

# ---------------------------------------------------------------------------------------------------- finish reasons

FINISH_REASONS: Final[frozenset[str]] = frozenset(get_args(Finish))
"""The finish reasons a server sends: ``stop``, ``length`` and ``abort`` (:data:`~fsm_rollout.types.Finish`)."""

ABORT_FINISH_REASONS: Final = frozenset({"abort", "cancelled"})
"""The finish reasons a client reads as an abort: vLLM versions say either."""

# ---------------------------------------------------------------------------------------------------- request ids

GENERATE_REQUEST_ID_PREFIX: Final = "generate-tokens-"
"""vLLM registers a generate request, and answers it, under ``generate-tokens-<request_id>``."""


def server_request_id(request_id: str) -> str:
    """The id vLLM answers a generate request under (``generate-tokens-<request_id>``)."""
    return GENERATE_REQUEST_ID_PREFIX + request_id


def server_request_ids(request_id: str) -> tuple[str, str]:
    """The ids a generate request may be known by at the server: as sent, and vLLM's prefixed internal id."""
    return (request_id, server_request_id(request_id))


def sent_request_id(name: str) -> str:
    """The id a client sent, from either name an abort request may use for it."""
    return name.removeprefix(GENERATE_REQUEST_ID_PREFIX)


# ---------------------------------------------------------------------------------------------------- token ids

_INT_ONLY: Final = frozenset({int})


def is_int(value: Any) -> TypeGuard[int]:
    """An integer as JSON decodes one: exactly ``int``, so not a bool (``true`` is an int to Python)."""
    return type(value) is int


def is_number(value: Any) -> TypeGuard[int | float]:
    """A number: an :func:`is_int` integer or a float (so not a bool)."""
    return type(value) is int or isinstance(value, float)


def is_int_list(value: Any) -> TypeGuard[list[int]]:
    """A flat list of integers (:func:`is_int` items: no bools, floats or nested lists); empty is fine."""
    # set(map(type, ...)) loops in C: a third of the time of a generator over the items
    return isinstance(value, list) and (not value or set(map(type, value)) == _INT_ONLY)


def is_token_id_list(value: Any) -> TypeGuard[list[int]]:
    """A flat list of non-negative integer token ids; empty is fine."""
    return is_int_list(value) and (not value or min(value) >= 0)


# ---------------------------------------------------------------------------------------------------- records


class GenerateRequest(TypedDict, total=False):
    """The body of ``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``), which is also what
    ``POST /v1/chat/completions/render`` answers: the client sends the render answer back, minus ``request_id``."""

    request_id: str
    token_ids: list[int]
    token_offsets: Any
    features: Any
    content_parts: Any
    sampling_params: dict[str, Any]
    model: str
    reasoning_ended: Any
    reasoning_parser_kwargs: Any
    return_token_ids: Any
    output_mode: str
    stream: bool
    stream_options: Any
    cache_salt: str | None
    priority: int
    kv_transfer_params: Any
    ec_transfer_params: Any


RenderAnswer = GenerateRequest
"""The render endpoint's answer: a :class:`GenerateRequest` for the conversation."""


class WeightVersionSpan(TypedDict):
    """Which weight version produced the output tokens ``[start, end)`` of a choice."""

    version: str
    start: int
    end: int


class TopLogprob(TypedDict):
    """One candidate of a token's ``top_logprobs``. For ``sampling_params.logprobs = k`` vLLM lists ``max(k, 1)``
    of them in the engine's order: the sampled token first, then the likeliest others by rank."""

    token_id: int
    logprob: float
    rank: int


class LogprobEntry(TypedDict, total=False):
    """One generated token in ``choices[0].logprobs.content``: vLLM names the token by ``token_id`` or, in its
    other entry shape, by ``token`` as ``"token_id:<id>"`` (see :func:`token_text`)."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(TypedDict):
    """``choices[0].logprobs``: one entry per generated token."""

    content: list[LogprobEntry]


class GenerateChoice(TypedDict, total=False):
    """``choices[0]`` of a generate answer; ``routed_experts`` is base64 ``.npy`` text, ``sampling_mask`` the ids
    top-p kept per generated token."""

    index: int
    finish_reason: Finish
    stop_reason: int | str | None
    token_ids: list[int]
    routed_experts: str | None
    sampling_mask: list[list[int]] | None
    weight_versions: list[WeightVersionSpan]
    logprobs: ChoiceLogprobs | None


class Usage(TypedDict, total=False):
    """A generate answer's token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None
    completion_tokens_details: dict[str, Any] | None


class GenerateAnswer(TypedDict, total=False):
    """vLLM's non-streaming ``GenerateResponse`` (``output_mode="tokens"``); some servers (vime) add a top-level
    ``weight_version``."""

    request_id: str
    model: str
    created: int
    usage: Usage
    prompt_logprobs: Any
    prompt_token_id_logprobs: Any
    prompt_token_ids: Any
    mm_placeholders: Any
    metrics: dict[str, Any] | None
    kv_transfer_params: Any
    ec_transfer_params: Any
    output_mode: str
    weight_version: str
    choices: list[GenerateChoice]


class AbortRequest(TypedDict):
    """The body of ``POST /inference/v1/abort_requests``; unknown ids are ignored."""

    request_ids: list[str]


class ErrorDetail(TypedDict):
    """What an error body says: the message, the error ``type`` (see :func:`error_type`), the offending request
    field (or None) and the HTTP status again."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(TypedDict):
    """vLLM's (and OpenAI's) error answer."""

    error: ErrorDetail


class ModelCard(TypedDict):
    """One served model in ``GET /v1/models``.

    ``tokenizer`` and ``image_merge_size`` are the embedded engine's additions, so that a client can take them from
    the engine instead of its flags; a real vLLM sends neither (its ``root`` is the model path it loaded).
    """

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    tokenizer: NotRequired[str]
    image_merge_size: NotRequired[int]


class ModelList(TypedDict):
    """The answer of ``GET /v1/models``."""

    object: str
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------------- building records

TOKEN_TEXT_PREFIX: Final = "token_id:"


def token_text(token_id: int) -> str:
    """``"token_id:<id>"``, how a logprobs entry of vLLM's ``token`` shape names its token."""
    return f"{TOKEN_TEXT_PREFIX}{token_id}"


def weight_version_spans(version: str, token_count: int) -> list[WeightVersionSpan]:
    """The spans of an output made with one weight version throughout: one span, or none for no tokens."""
    return [{"version": version, "start": 0, "end": token_count}] if token_count else []


def model_list(
    name: str, *, root: str, max_model_len: int, tokenizer: str | None = None, image_merge_size: int | None = None
) -> ModelList:
    """The ``GET /v1/models`` answer of a server with one model (``tokenizer`` and ``image_merge_size`` only when
    given: see :class:`ModelCard`)."""
    card: ModelCard = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
    }
    if tokenizer is not None:
        card["tokenizer"] = tokenizer
    if image_merge_size is not None:
        card["image_merge_size"] = image_merge_size
    return {"object": "list", "data": [card]}


def error_type(status: int) -> str:
    """The OpenAI/vLLM error ``type`` of an HTTP status (``400`` → ``BadRequestError``)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else f"{name}Error"


def error_body(status: int, message: str, param: str | None = None) -> ErrorBody:
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` for that status."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


# ---------------------------------------------------------------------------------------------------- render sampling

# Chat-request fields that render copies into the GenerateRequest's sampling_params unchanged.
RENDER_SAMPLING_FIELDS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
# The fields vLLM's render always writes (its SamplingParams defaults); render also fills in max_tokens.
RENDER_DEFAULT_SAMPLING: Final[Mapping[str, Any]] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "stop": [],
    "stop_token_ids": [],
}


def render_sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sampling_params`` vLLM's render writes for a chat request ``body``."""
    sampling = dict(RENDER_DEFAULT_SAMPLING)
    for name in RENDER_SAMPLING_FIELDS:
        if body.get(name) is not None:
            sampling[name] = body[name]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if body.get("logprobs") is True:  # chat's boolean + top_logprobs become SamplingParams.logprobs
        sampling["logprobs"] = body.get("top_logprobs") or 0
    return sampling
