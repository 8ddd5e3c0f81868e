"""The servers' side of the wire: validating the request bodies a vLLM-speaking server receives.

The serving frame (:mod:`fsm_rollout.engine.serving`) checks each field with these functions, for every server; the
embedded engine adds its own limits (:mod:`fsm_rollout.engine.local.protocol`). A bad field raises
:class:`RequestError`, which the server answers with vLLM's error body.
Bodies are decoded JSON, so "an integer" means :func:`~fsm_rollout.engine.schema.wire.is_int`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, overload

import orjson

from fsm_rollout.engine.schema.wire import is_int, is_int_list, is_number, is_token_id_list


class RequestError(Exception):
    """A request the server answers with a vLLM error body (``{"error": {message, type, param, code}}``)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise RequestError(400, f"The request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object")
    return body


def check_model(body: Mapping[str, Any], served_model_name: str) -> None:
    """Refuse (404, like vLLM) a request naming another model; a missing or null ``model`` is fine."""
    model = body.get("model")
    if model is not None and model != served_model_name:
        raise RequestError(404, f"The model `{model}` does not exist. Valid aliases: {served_model_name}.", "model")


# ---------------------------------------------------------------------------------------------------- fields


@overload
def integer_field(mapping: Mapping[str, Any], name: str, default: int) -> int: ...
@overload
def integer_field(mapping: Mapping[str, Any], name: str, default: None) -> int | None: ...
def integer_field(mapping: Mapping[str, Any], name: str, default: int | None) -> int | None:
    """``mapping[name]`` as an integer; missing or null gives ``default``."""
    value = mapping.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise RequestError(400, f"{name}: Input should be a valid integer, got {value!r}", name)
    return value


def number_field(mapping: Mapping[str, Any], name: str, default: float) -> float:
    """``mapping[name]`` as a finite number; missing or null gives ``default``."""
    value = mapping.get(name)
    if value is None:
        return default
    if not is_number(value) or not math.isfinite(value):
        raise RequestError(400, f"{name}: Input should be a finite number, got {value!r}", name)
    return float(value)


def boolean_field(mapping: Mapping[str, Any], name: str, default: bool) -> bool:
    """``mapping[name]`` as a boolean; missing or null gives ``default``."""
    value = mapping.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"{name}: Input should be a valid boolean, got {value!r}", name)
    return value


# ---------------------------------------------------------------------------------------------------- generate


def request_token_ids(body: Mapping[str, Any], *, vocab_size: int | None = None) -> list[int]:
    """The prompt's ``token_ids``: a non-empty list of non-negative integers, each below ``vocab_size`` if given."""
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise RequestError(400, "token_ids: List should have at least 1 item", "token_ids")
    if is_token_id_list(token_ids) and (vocab_size is None or max(token_ids) < vocab_size):
        return token_ids
    for token in token_ids:  # the first bad id, in order, is the one named
        if not is_int(token) or token < 0:
            raise RequestError(400, f"token_ids: every item must be a non-negative integer, got {token!r}", "token_ids")
        if vocab_size is not None and token >= vocab_size:
            raise RequestError(400, f"Token id {token} is out of vocabulary (vocab size {vocab_size})", "token_ids")
    return token_ids  # not reached: some id failed a check above


def generate_request_id(body: Mapping[str, Any], default: str) -> str:
    """The body's ``request_id`` (a non-empty string), or ``default`` when it names none."""
    request_id = body.get("request_id")
    if request_id is None:
        return default
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(400, "request_id: Input should be a non-empty string", "request_id")
    return request_id


def request_sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's ``sampling_params`` object (required)."""
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict):
        raise RequestError(400, "sampling_params: Field required (a JSON object)", "sampling_params")
    return sampling


def check_single_prompt_extra(body: Mapping[str, Any]) -> None:
    """A prompt brings its media as ``features`` (what render returned) or as ``content_parts``, not both."""
    if body.get("features") is not None and body.get("content_parts") is not None:
        raise RequestError(400, "Only one of features and content_parts may be given")


def check_prompt_room(prompt_len: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one output token."""
    if prompt_len >= max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens, which leaves no room for output tokens. Please reduce the length of the "
            "input.",
            "token_ids",
        )


def resolve_max_tokens(sampling: Mapping[str, Any], *, prompt_len: int, max_model_len: int) -> int:
    """``max_tokens`` checked against the context; missing or null gives the rest of the context, as in vLLM."""
    room = max_model_len - prompt_len
    max_tokens = integer_field(sampling, "max_tokens", None)
    if max_tokens is None:  # vLLM fills in the rest of the context, not the dataclass default of 16
        return room
    if max_tokens < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if max_tokens > room:
        raise RequestError(
            400,
            f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is {max_model_len} "
            f"tokens and your request has {prompt_len} input tokens ({max_tokens} > {max_model_len} - "
            f"{prompt_len}).",
            "max_tokens",
        )
    return max_tokens


def stop_strings(value: Any) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (empty ones dropped); null gives none."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RequestError(400, "stop: Input should be a string or a list of strings", "stop")
    return tuple(item for item in value if item)


def stop_token_ids(value: Any) -> frozenset[int]:
    """``stop_token_ids``: a list of integers; null gives none."""
    if value is None:
        return frozenset()
    if not is_int_list(value):
        raise RequestError(400, "stop_token_ids: Input should be a list of integers", "stop_token_ids")
    return frozenset(value)


# ---------------------------------------------------------------------------------------------------- abort


def abort_request_ids(body: Mapping[str, Any]) -> list[str]:
    """The ``request_ids`` of an abort request: a list of strings."""
    request_ids = body.get("request_ids")
    if not isinstance(request_ids, list) or not all(isinstance(rid, str) for rid in request_ids):
        raise RequestError(400, "request_ids: Input should be a valid list of strings", "request_ids")
    return request_ids


# ---------------------------------------------------------------------------------------------------- render


def message_list(body: Mapping[str, Any]) -> list[Any]:
    """A chat request's ``messages``: a non-empty list (each one checked by
    :func:`~fsm_rollout.engine.schema.messages.check_chat_message`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: Field required (a non-empty list of messages)", "messages")
    return messages


def render_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """A chat request's ``tools``: a list, or None."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(400, "tools: Input should be a valid list", "tools")
    return tools


def render_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat request's ``chat_template_kwargs``: an object; missing or null gives ``{}``."""
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict):
        raise RequestError(400, "chat_template_kwargs: Input should be a valid dictionary", "chat_template_kwargs")
    return template_kwargs


# ---------------------------------------------------------------------------------------------------- logit bias


LOGIT_BIAS_LIMIT = 100.0
"""vLLM clamps each ``logit_bias`` value into [-100, 100]."""


def logit_bias(value: Any, *, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (integer keys, or strings that read as integers, as JSON sends them) to
    finite numbers, clamped into [-100, 100] as vLLM does; ids at or above ``vocab_size`` are refused, as vLLM's input
    processor refuses them. Null gives none."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(400, "logit_bias: Input should be a valid dictionary", "logit_bias")
    out: dict[int, float] = {}
    bad_keys = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            bad_keys.append(key)
            continue
        if not is_number(bias) or not math.isfinite(bias):
            raise RequestError(400, f"logit_bias.{key}: Input should be a finite number, got {bias!r}", "logit_bias")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    if bad_keys:
        raise RequestError(
            400, f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad_keys!r}", "logit_bias"
        )
    outside = sorted(token for token in out if token < 0 or (vocab_size is not None and token >= vocab_size))
    if outside:
        raise RequestError(
            400,
            f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
            "logit_bias",
        )
    return tuple(sorted(out.items()))


# ---------------------------------------------------------------------------------------------------- structured


STRUCTURED_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The kinds of constraint of vLLM's ``StructuredOutputsParams``: a request names exactly one."""

_STRUCTURED_OPTIONS: Final = ("disable_any_whitespace", "disable_additional_properties")


def structured_outputs(value: Any) -> dict[str, Any] | None:
    """``structured_outputs`` (vLLM's ``StructuredOutputsParams``): an object naming exactly one constraint of
    :data:`STRUCTURED_CONSTRAINTS`, each of its type (``json`` a schema object or its JSON text, ``choice`` a list of
    strings, ``json_object`` a boolean, ``structural_tag`` the JSON text of a structural tag, the others strings),
    and boolean options. Null gives None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(400, "structured_outputs: Input should be a valid dictionary", "structured_outputs")
    named = [kind for kind in STRUCTURED_CONSTRAINTS if value.get(kind) is not None]
    if len(named) != 1:
        which = "only one kind of" if named else "one kind of"
        raise RequestError(
            400,
            f"You must use {which} structured outputs constraint but {len(named)} are specified: {named}",
            "structured_outputs",
        )
    kind = named[0]
    spec = value[kind]
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(spec, str):
            spec = _json_text(spec, where)
        if not isinstance(spec, dict | bool):
            raise RequestError(
                400, f"{where}: Input should be a JSON schema (object or its text)", "structured_outputs"
            )
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(item, str) for item in spec):
            raise RequestError(400, f"{where}: Input should be a non-empty list of strings", "structured_outputs")
    elif kind == "json_object":
        if not isinstance(spec, bool):
            raise RequestError(400, f"{where}: Input should be a valid boolean", "structured_outputs")
    elif not isinstance(spec, str):
        raise RequestError(400, f"{where}: Input should be a valid string", "structured_outputs")
    elif kind == "structural_tag" and not isinstance(_json_text(spec, where), dict):
        raise RequestError(400, f"{where}: Input should be the JSON text of an object", "structured_outputs")
    checked: dict[str, Any] = {kind: spec}
    for option in _STRUCTURED_OPTIONS:
        flag = value.get(option)
        if flag is not None and not isinstance(flag, bool):
            raise RequestError(
                400, f"structured_outputs.{option}: Input should be a valid boolean", "structured_outputs"
            )
        checked[option] = bool(flag)
    pattern = value.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise RequestError(400, "structured_outputs.whitespace_pattern: Input should be a string", "structured_outputs")
    checked["whitespace_pattern"] = pattern
    return checked


def _json_text(text: str, where: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise RequestError(400, f"{where}: not valid JSON ({error})", "structured_outputs") from error
