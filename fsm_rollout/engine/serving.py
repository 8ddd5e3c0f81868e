"""The serving frame every vLLM-speaking server of this project shares: request parsing, answers and errors, once.

The embedded engine (:mod:`fsm_rollout.engine.local.server`), the fake test server
(:mod:`fsm_rollout.testing.fake_vllm`) and the bench's canned server (:mod:`fsm_rollout.cli.bench.server`) differ
only in how they render a conversation and produce tokens. What a request must hold, and what each endpoint answers
(and with which error), is decided here, to vLLM's rules as ``vllm serve --enable-scale-out`` (0.32) applies them:

* ``POST /v1/chat/completions/render``: :func:`parse_render_request` and :func:`render_answer` (the 17 fields of
  vLLM's ``GenerateRequest``; ``sampling_params.max_tokens`` is the rest of the context when the request names none,
  and left out when it names vLLM's default of 16, as vLLM serialises it);
* ``POST /inference/v1/generate``: :func:`parse_generate_request` (vLLM's field checks and ``SamplingParams``
  limits) and :func:`generate_answer` (every field of vLLM's non-streaming ``GenerateResponse``);
* ``POST /inference/v1/abort_requests``: :func:`~fsm_rollout.engine.schema.abort_request_ids`, answered by an
  empty 200 (unknown ids are ignored);
* the weight-update endpoints (``VLLM_SERVER_DEV_MODE=1``): :func:`pause_query` (``mode`` as vLLM's ``PauseMode``,
  the deprecated ``wait_for_inflight_requests=true`` meaning ``wait``, and ``clear_cache`` checked as a boolean),
  ``{"status": "paused"}``, ``{"status": "resumed"}``, ``{"is_paused": bool}``, ``{"success": true,
  "new_version": str}``, ``{"weight_version": str}`` and ``{"message": "Weights updated"}``;
* ``GET /health`` (an empty 200) and ``GET /v1/models``.

A bad request raises :class:`~fsm_rollout.engine.schema.RequestError`, answered with :func:`error_answer` (vLLM's
``{"error": {"message", "type", "param", "code"}}``); an unknown path or method gets FastAPI's ``{"detail": ...}``.

Everything here is synchronous and transport-free, so the bench's raw-socket server uses it as the aiohttp servers
do (:mod:`fsm_rollout.engine.endpoints` binds it to aiohttp). Sampling limits that only one server has (the embedded
engine implements fewer features than vLLM) stay with that server.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Literal

import orjson

from fsm_rollout.engine.schema import (
    PAUSE_MODES,
    GenerateAnswer,
    GenerateChoice,
    LogprobEntry,
    ModelList,
    PauseMode,
    RenderAnswer,
    RequestError,
    WeightVersionSpan,
    boolean_field,
    check_chat_message,
    check_model,
    check_prompt_room,
    check_single_prompt_extra,
    decode_json_object,
    error_body,
    generate_request_id,
    integer_field,
    logit_bias,
    message_list,
    model_list,
    number_field,
    render_sampling_params,
    render_template_kwargs,
    render_tools,
    request_sampling_params,
    request_token_ids,
    resolve_max_tokens,
    server_request_id,
    stop_strings,
    stop_token_ids,
    structured_outputs,
)
from fsm_rollout.tokens.chat_messages import template_messages
from fsm_rollout.types import Finish

__all__ = [
    "MAX_LOGPROBS",
    "NOT_FOUND",
    "PAUSED",
    "RESUMED",
    "UPDATED_WEIGHTS",
    "VLLM_DEFAULT_MAX_TOKENS",
    "GenerateOutcome",
    "GenerateRequest",
    "RenderRequest",
    "SamplingSettings",
    "error_answer",
    "generate_answer",
    "is_paused_answer",
    "method_not_allowed",
    "models_answer",
    "parse_generate_request",
    "parse_render_request",
    "parse_sampling_params",
    "pause_query",
    "read_json",
    "render_answer",
    "update_info",
    "update_weight_version_answer",
    "weight_info_answer",
    "weight_version_of",
]

MAX_LOGPROBS: Final = 20
"""The most ``logprobs`` (top candidates per token) a request may ask for, as vLLM's default ``max_logprobs``."""

VLLM_DEFAULT_MAX_TOKENS: Final = 16
"""``SamplingParams.max_tokens``'s default, which vLLM's render leaves out of the ``sampling_params`` it answers."""

PAUSED: Final = {"status": "paused"}
RESUMED: Final = {"status": "resumed"}
UPDATED_WEIGHTS: Final = {"message": "Weights updated"}
NOT_FOUND: Final = {"detail": "Not Found"}
"""FastAPI's answer to a path no route serves (404)."""

_METHOD_NOT_ALLOWED: Final = {"detail": "Method Not Allowed"}
# FastAPI reads these query values as true or false; anything else fails validation.
_TRUE: Final = frozenset({"1", "true", "on", "yes", "t", "y"})
_FALSE: Final = frozenset({"0", "false", "off", "no", "f", "n"})


# ---------------------------------------------------------------------------------------------------- common


def read_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (400 otherwise, as vLLM answers a body that fails to parse)."""
    return decode_json_object(raw)


def error_answer(error: RequestError) -> tuple[int, bytes]:
    """The status and body of vLLM's answer to a bad request."""
    return error.status, orjson.dumps(error_body(error.status, error.message, error.param))


def method_not_allowed() -> tuple[int, bytes]:
    """FastAPI's answer (405) to a known path asked with another method."""
    return HTTPStatus.METHOD_NOT_ALLOWED, orjson.dumps(_METHOD_NOT_ALLOWED)


def models_answer(
    name: str, *, root: str, max_model_len: int, tokenizer: str | None = None, image_merge_size: int | None = None
) -> ModelList:
    """``GET /v1/models``: one model card (``tokenizer`` and ``image_merge_size`` are the embedded engine's own)."""
    return model_list(
        name, root=root, max_model_len=max_model_len, tokenizer=tokenizer, image_merge_size=image_merge_size
    )


# ---------------------------------------------------------------------------------------------------- render


@dataclass(frozen=True)
class RenderRequest:
    """A checked ``POST /v1/chat/completions/render`` body: what a chat template needs and the sampling fields that
    render writes back (``sampling_params``, without ``max_tokens`` when the request names none)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    sampling_params: dict[str, Any]
    mm_payload: Literal["tensors", "none"]
    body: Mapping[str, Any]


def parse_render_request(body: Mapping[str, Any], served_model_name: str) -> RenderRequest:
    """Check a render body (an OpenAI ``ChatCompletionRequest``): the model, the messages (OpenAI's message schema
    as vLLM validates it: tool-call arguments are JSON strings), ``tools``, ``chat_template_kwargs``, the
    generation-prompt flags and ``mm_payload``. The messages come back in the template form vLLM hands its chat
    template (tool-call arguments decoded: :func:`~fsm_rollout.tokens.chat_messages.template_messages`)."""
    check_model(body, served_model_name)
    messages = message_list(body)
    for index, message in enumerate(messages):
        check_chat_message(message, index)
    tools = render_tools(body)
    template_kwargs = render_template_kwargs(body)
    add_generation_prompt = boolean_field(body, "add_generation_prompt", True)
    continue_final_message = boolean_field(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise RequestError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "messages"
        )
    mm_payload = body.get("mm_payload")
    if mm_payload is not None and mm_payload not in ("tensors", "none"):
        raise RequestError(400, f"mm_payload: Input should be 'tensors' or 'none', got {mm_payload!r}", "mm_payload")
    return RenderRequest(
        messages=template_messages(messages),
        tools=tools,
        template_kwargs=template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        sampling_params=render_sampling_params(body),
        mm_payload="none" if mm_payload == "none" else "tensors",
        body=body,
    )


def render_answer(
    request: RenderRequest, token_ids: list[int], features: Any, *, model: str, max_model_len: int
) -> RenderAnswer:
    """vLLM's render answer for a prompt of ``token_ids``: a ``GenerateRequest`` with all 17 fields.

    A prompt that leaves no room for an output token is refused (400), as vLLM refuses it.
    """
    if len(token_ids) >= max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your messages resulted in "
            f"{len(token_ids)} input tokens. Please reduce the length of the messages.",
            "messages",
        )
    sampling = dict(request.sampling_params)
    asked = sampling.pop("max_tokens", None)
    if asked is None:
        sampling["max_tokens"] = max_model_len - len(token_ids)
    elif asked != VLLM_DEFAULT_MAX_TOKENS:  # vLLM serialises SamplingParams without the fields at their default
        sampling["max_tokens"] = asked
    return {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "token_ids": token_ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": sampling,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": False,
        "stream_options": None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


# ---------------------------------------------------------------------------------------------------- generate


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """The checked sampling parameters of one generate request (vLLM ``SamplingParams`` semantics).

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``max_tokens`` is always resolved: a request without it gets the rest of the context, as in vLLM.
    ``logprobs`` is None (no logprobs in the answer) or how many top candidates to list beside the sampled token.
    ``skip_special_tokens`` decides how the output is decoded for the stop-string check.

    There is no ``include_stop_str_in_output``: in token-out mode vLLM always returns the tokens that complete a
    stop string (only a text answer would be trimmed), whatever the flag says.
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
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token_id, bias)`` added to the logits before the penalties and filters."""
    structured: Mapping[str, Any] | None = None
    """vLLM's ``structured_outputs``, checked (:func:`~fsm_rollout.engine.schema.structured_outputs`): the grammar
    every token is sampled under (None: unconstrained)."""

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax (vLLM treats temperatures below 1e-5 as greedy)."""
        return self.temperature < 1e-5


@dataclass(frozen=True)
class GenerateRequest:
    """A checked ``POST /inference/v1/generate`` body (``request_id`` is a new one when the body names none)."""

    request_id: str
    token_ids: list[int]
    settings: SamplingSettings
    body: Mapping[str, Any]

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


def parse_generate_request(
    body: Mapping[str, Any], served_model_name: str, *, max_model_len: int, vocab_size: int | None = None
) -> GenerateRequest:
    """Check a generate body as vLLM does: the model (404 for another), ``token_ids`` (each below ``vocab_size``
    when given), not both ``features`` and ``content_parts``, ``request_id``, ``sampling_params`` and the room the
    prompt leaves in the context."""
    check_model(body, served_model_name)
    token_ids = request_token_ids(body, vocab_size=vocab_size)
    check_single_prompt_extra(body)
    request_id = generate_request_id(body, "") or uuid.uuid4().hex  # a given id is never empty
    sampling = request_sampling_params(body)
    check_prompt_room(len(token_ids), max_model_len)
    settings = parse_sampling_params(sampling, prompt_len=len(token_ids), max_model_len=max_model_len)
    if settings.logit_bias and vocab_size is not None:
        logit_bias(sampling.get("logit_bias"), vocab_size=vocab_size)  # out-of-vocab ids, as vLLM's processor checks
    return GenerateRequest(request_id=request_id, token_ids=token_ids, settings=settings, body=body)


def parse_sampling_params(sampling: Mapping[str, Any], *, prompt_len: int, max_model_len: int) -> SamplingSettings:
    """Check vLLM ``sampling_params`` against ``SamplingParams``' limits (unknown keys are ignored)."""
    n = integer_field(sampling, "n", 1)
    if n < 1:
        raise RequestError(400, f"n must be at least 1, got {n}.", "n")
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
        raise RequestError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}.", "logprobs")
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
        logit_bias=logit_bias(sampling.get("logit_bias")),
        structured=structured_outputs(sampling.get("structured_outputs")),
    )


@dataclass(frozen=True)
class GenerateOutcome:
    """What a backend produced for one generate request.

    ``logprobs`` holds one ``logprobs.content`` entry per token (None: the request asked for none, and the answer
    says ``"logprobs": null``); ``weight_versions`` None leaves the key out, as a server that does not label its
    tokens. ``stop_reason`` is the stop string or stop token id that ended a ``stop`` (None for EOS).
    """

    token_ids: list[int]
    finish: Finish
    logprobs: list[LogprobEntry] | None
    weight_versions: list[WeightVersionSpan] | None
    stop_reason: str | int | None = None


def generate_answer(request_id: str, prompt_len: int, outcome: GenerateOutcome, *, model: str) -> GenerateAnswer:
    """vLLM 0.32's non-streaming ``GenerateResponse`` (``output_mode="tokens"``) with every field it sends, under
    vLLM's id for the request (``generate-tokens-<request_id>``)."""
    completion = len(outcome.token_ids)
    choice: GenerateChoice = {
        "index": 0,
        "finish_reason": outcome.finish,
        "stop_reason": outcome.stop_reason if outcome.finish == "stop" else None,
        "token_ids": outcome.token_ids,
        "routed_experts": None,
        "sampling_mask": None,
    }
    if outcome.weight_versions is not None:
        choice["weight_versions"] = outcome.weight_versions
    choice["logprobs"] = None if outcome.logprobs is None else {"content": outcome.logprobs}
    return {
        "request_id": server_request_id(request_id),
        "model": model,
        "created": int(time.time()),
        "usage": {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice],
    }


# ---------------------------------------------------------------------------------------------------- weight updates


def pause_query(query: Mapping[str, str]) -> PauseMode:
    """The pause mode of ``POST /pause``'s query: ``mode`` (vLLM's ``PauseMode``, ``abort`` when missing), or
    ``wait`` for the deprecated ``wait_for_inflight_requests=true``; ``clear_cache`` must be a boolean too."""
    mode = query.get("mode")
    wait = _query_boolean(query, "wait_for_inflight_requests", default=False)
    _query_boolean(query, "clear_cache", default=True)  # vLLM ignores it in every mode this project uses
    if mode is None:
        return "wait" if wait else "abort"
    for known in PAUSE_MODES:
        if mode == known:
            return known
    expected = ", ".join(repr(item) for item in PAUSE_MODES)
    raise RequestError(400, f"mode: Input should be one of {expected}, got {mode!r}", "mode")


def _query_boolean(query: Mapping[str, str], name: str, *, default: bool) -> bool:
    value = query.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise RequestError(400, f"{name}: Input should be a valid boolean, unable to interpret input {value!r}", name)


def is_paused_answer(paused: bool) -> dict[str, bool]:
    return {"is_paused": paused}


def weight_version_of(body: Mapping[str, Any]) -> str:
    """The ``new_version`` of ``POST /update_weight_version``: a string (required)."""
    version = body.get("new_version")
    if not isinstance(version, str):
        raise RequestError(400, f"new_version: Field required (a string), got {version!r}", "new_version")
    return version


def update_weight_version_answer(version: str) -> dict[str, Any]:
    return {"success": True, "new_version": version}


def weight_info_answer(version: str) -> dict[str, str]:
    return {"weight_version": version}


def update_info(body: Mapping[str, Any]) -> Any:
    """The ``update_info`` of ``POST /update_weights``, required; its shape is the weight-transfer backend's."""
    info = body.get("update_info")
    if info is None:
        raise RequestError(400, "Missing 'update_info' in request body", "update_info")
    return info
