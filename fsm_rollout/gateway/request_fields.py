"""The Chat Completions request fields a gateway call may carry, and what each becomes: sampling parameters of the
call's generate request (vLLM's, ``structured_outputs`` for a ``response_format`` or a forcing ``tool_choice``), or a
400 naming it. Nothing a client sends is silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_STOP_STRINGS",
    "REQUEST_FIELDS",
    "TOOL_CALL_ARGUMENTS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "FieldError",
    "capped_sampling",
    "check_fields",
    "check_parallel_tool_calls",
    "check_penalties",
    "logit_bias",
    "structured_outputs",
]


class FieldError(ValueError):
    """A request field the gateway answers with a 400; ``code`` names the field."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


REQUEST_FIELDS: Mapping[str, str] = {
    # reach the call's generate request (its sampling_params)
    "temperature": "sampling",
    "top_p": "sampling",
    "seed": "sampling",
    "stop": "sampling",
    "frequency_penalty": "sampling",
    "presence_penalty": "sampling",
    "logit_bias": "sampling",
    "max_tokens": "sampling",
    "max_completion_tokens": "sampling",
    "top_logprobs": "sampling",
    "response_format": "sampling",
    "tool_choice": "sampling",
    # shape the call itself
    "messages": "call",
    "tools": "call",
    "model": "call",
    "n": "call",
    "stream": "call",
    "stream_options": "call",
    "logprobs": "call",
    "parallel_tool_calls": "call",
    # bookkeeping of OpenAI's platform: no effect on the tokens, accepted so clients that always send them run
    "metadata": "bookkeeping",
    "store": "bookkeeping",
    "user": "bookkeeping",
    "safety_identifier": "bookkeeping",
    "service_tier": "bookkeeping",
    "prompt_cache_key": "bookkeeping",
    "prompt_cache_retention": "bookkeeping",
    "prompt_cache_options": "bookkeeping",
    # would change what is generated and cannot be honoured: a 400 naming the field when set (null is absent)
    "audio": "refused",
    "modalities": "refused",
    "prediction": "refused",
    "web_search_options": "refused",
    "functions": "refused",
    "function_call": "refused",
    "reasoning_effort": "refused",
    "verbosity": "refused",
    "moderation": "refused",
}
"""What the gateway does with each Chat Completions request field: ``sampling`` fields reach the generate request's
``sampling_params`` (``response_format`` and a forcing ``tool_choice`` as vLLM's ``structured_outputs``), ``call``
fields shape the call, ``bookkeeping`` fields have no effect on the tokens, ``refused`` fields are a 400 naming them
when not null. A field in none of these is a 400 too, so nothing is silently dropped."""

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop``."""


def check_fields(body: Mapping[str, Any]) -> None:
    """Every field of the body is one the gateway handles (:data:`REQUEST_FIELDS`): a refused or unknown field that
    is not null is a 400 naming it, never dropped."""
    for key, value in body.items():
        kind = REQUEST_FIELDS.get(key)
        if kind is None and value is not None:
            raise FieldError(f"'{key}' is not a Chat Completions field the gateway knows; it would be ignored", key)
        if kind == "refused" and value is not None and not (key == "modalities" and value == ["text"]):
            raise FieldError(
                f"'{key}' is not supported by the gateway: it would change the answer in a way it cannot", key
            )


MAX_LOGIT_BIAS = 100
"""OpenAI's (and vLLM's) bound on a ``logit_bias`` value."""


def logit_bias(value: Any) -> dict[str, float]:
    """``logit_bias``: token ids (JSON object keys) to biases in [-100, 100], as OpenAI takes it."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise FieldError("'logit_bias' must be an object of token ids to numbers", "logit_bias")
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise FieldError(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise FieldError(
                f"'logit_bias' value for {key} must be a number from -100 to 100, got {bias!r}", "logit_bias"
            )
        out[str(int(key))] = float(bias)
    return out


TOOL_CALL_OPEN = '<tool_call>\n{"name": '
TOOL_CALL_ARGUMENTS = ', "arguments": '
TOOL_CALL_CLOSE = "}\n</tool_call>"
"""The Qwen / Hermes tool-call markup a forced call is generated in (what :mod:`fsm_rollout.tokens.tool_calls`
reads), around the function's name and its arguments' JSON."""


def structured_outputs(
    response_format: Any, tool_choice: str, tool_name: str | None, tools: list[dict[str, Any]] | None
) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` for the call: the JSON a ``response_format`` asks for, or the tool call a
    ``tool_choice`` forces. JSON whitespace is bounded (``disable_any_whitespace``): with unbounded whitespace a
    small model pads until its budget runs out."""
    fmt = _response_format(response_format)
    if tool_choice == "required":
        if fmt is not None:
            raise FieldError(
                "'response_format' and a forcing 'tool_choice' cannot both constrain one answer", "tool_choice"
            )
        chosen = [
            tool["function"] for tool in tools or () if tool_name is None or tool["function"]["name"] == tool_name
        ]
        calls = [_forced_call(function) for function in chosen]
        tag = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": tag})}
    return fmt


def _forced_call(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    schema = parameters if isinstance(parameters, Mapping) and parameters else {"type": "object"}
    name = json.dumps(function["name"], ensure_ascii=False)
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": TOOL_CALL_OPEN + name + TOOL_CALL_ARGUMENTS},
            {"type": "json_schema", "json_schema": dict(schema), "max_whitespace_cnt": 1},
            {"type": "const_string", "value": TOOL_CALL_CLOSE},
        ],
    }


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True, "disable_any_whitespace": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is None and isinstance(spec, Mapping):
            schema = {}  # OpenAI allows a json_schema without a schema: any JSON value
        if not isinstance(schema, Mapping):
            raise FieldError("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
        return {"json": dict(schema), "disable_any_whitespace": True}
    raise FieldError(
        "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format"
    )


def check_penalties(sampling: Mapping[str, Any]) -> None:
    """``frequency_penalty`` and ``presence_penalty``: numbers in [-2, 2], as OpenAI and vLLM take them."""
    for key in ("frequency_penalty", "presence_penalty"):
        value = sampling.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2
        ):
            raise FieldError(f"'{key}' must be a number from -2 to 2, got {value!r}", key)


def check_parallel_tool_calls(value: Any, tool_choice: str) -> None:
    """``parallel_tool_calls``: a boolean; ``false`` holds only where a forcing ``tool_choice`` makes one call."""
    if value is not None and not isinstance(value, bool):
        raise FieldError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if value is False and tool_choice == "auto":
        raise FieldError(
            "'parallel_tool_calls': false is enforced only with a forcing 'tool_choice' ('required' or a named "
            "function: one call); with 'auto' the model may answer several",
            "parallel_tool_calls",
        )


def capped_sampling(sampling: Mapping[str, Any], cap: int | None) -> dict[str, Any]:
    """A call's sampling with its ``max_tokens`` bounded by the gateway's per-call cap: ``min(client's, cap)``, the
    cap when the client sets none (Codex sends no ``max_output_tokens``). The answer then reports the cut as its
    dialect does (``length``, ``max_tokens``, an incomplete response), so a small model on CPU cannot spend one
    call on thousands of tokens. ``cap`` None leaves the sampling as the client asked."""
    out = dict(sampling)
    if cap is not None:
        asked = out.get("max_tokens")
        out["max_tokens"] = cap if asked is None else min(int(asked), cap)
    return out
