"""OpenAI Chat Completions on the wire: the request a gateway session accepts, its answer, its stream, its errors.

Requests are checked strictly, because every message becomes tokens the model is trained on or conditioned on:
a malformed message, ``n > 1`` or an image part the gateway cannot carry is a 400 in OpenAI's error shape
``{"error": {"message", "type", "code"}}``, never a silent guess.

Messages are kept in two forms. The *checked* form is what the session compares: text parts joined into one
string and tool-call arguments decoded into objects. The *render* form is what the rollout sends the engine:
OpenAI's wire form again (arguments as JSON strings), which vLLM validates (:func:`render_message`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fsm_rollout.gateway.request_fields import (
    MAX_STOP_STRINGS,
    REQUEST_FIELDS,
    FieldError,
    check_fields,
    check_parallel_tool_calls,
    check_penalties,
    logit_bias,
    structured_outputs,
)
from fsm_rollout.tokens.chat_messages import wire_tool_call

__all__ = [
    "REQUEST_FIELDS",
    "ChatCall",
    "GatewayError",
    "TurnAnswer",
    "context_overflow",
    "error_body",
    "parse_chat_request",
    "public_error",
    "render_message",
    "without_stop_string",
]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SAMPLING_KEYS = ("temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty")


class GatewayError(Exception):
    """An HTTP error of the gateway, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, code: str, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code)


def error_body(message: str, *, type: str, code: str) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "code": code, "param": None}}


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>)]+", re.IGNORECASE)
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens[^.]*\.(?:\s*However,[^.]*\.)?", re.IGNORECASE)


def context_overflow(message: str) -> str | None:
    """The engine's "maximum context length" sentence in an error message, None when it is not an overflow."""
    found = _CONTEXT.search(message)
    return None if found is None else found.group(0)


def public_error(error: GatewayError) -> GatewayError:
    """The error as the agent may see it: no internal URL, no traceback (the caller traces the original).

    A rollout that failed because the prompt is over the engine's context length is the agent's request error:
    400 ``context_length_exceeded``, as OpenAI answers it (SDKs retry a 500, never a 400). Other server errors keep
    their status and code with the URLs cut out of the message and only its first line kept.
    """
    if error.status < 500:
        return error
    found = context_overflow(error.message)
    if error.code == "rollout_failed" and found is not None:
        message = f"the conversation is over the model's context length: {found}"
        return GatewayError(400, message, code="context_length_exceeded")
    first_line = error.message.strip().splitlines()[0] if error.message.strip() else "internal error"
    message = _URL.sub("<engine>", first_line)
    if message == error.message:
        return error
    return GatewayError(error.status, message, code=error.code, type=error.type)


def _bad(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code)


@dataclass(frozen=True)
class ChatCall:
    """One chat call, checked: its messages (wire form), tools, sampling settings and answer options."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    """``temperature``, ``top_p``, ``seed``, ``stop``, ``frequency_penalty``, ``presence_penalty``, ``logit_bias``,
    ``max_tokens``, ``top_logprobs`` (above 0) as given (absent when not), and ``structured_outputs`` (vLLM's
    constrained decoding) for a ``response_format`` or a ``tool_choice`` that forces a call."""
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tool_choice: str = "auto"
    """``"auto"`` (tool calls are parsed from the answer), ``"none"`` (they are not: the answer is all content;
    the default of a call without tools) or ``"required"`` (a call is forced by constrained decoding; a named
    function is ``"required"`` with :attr:`tool_name` set)."""
    tool_name: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)
    hints: Mapping[str, Any] = field(default_factory=dict)
    """What the client says about the call beyond its messages, read by its dialect from headers or fields (for
    example a harness's ``session_key``, ``parent_lineage``, ``agent``, ``request_kind`` or ``window``); never
    sent to the engine."""


def parse_chat_request(body: Any) -> ChatCall:
    """A chat completions request body, checked (:class:`GatewayError` 400 naming what is wrong)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(f"n={n!r} is not supported: a gateway session is one conversation, so one choice per call", "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of chat messages", "messages")
    checked = [_message(index, message) for index, message in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(tool) for tool in tools):
            raise _bad("'tools' must be a list of {'type': 'function', 'function': {'name': ...}} objects", "tools")
        tools = [dict(tool) for tool in tools] or None
    sampling: dict[str, Any] = {}
    for key in _SAMPLING_KEYS:
        if body.get(key) is not None:
            sampling[key] = body[key]
    for key in ("temperature", "top_p"):
        if key in sampling and (isinstance(sampling[key], bool) or not isinstance(sampling[key], int | float)):
            raise _bad(f"'{key}' must be a number", key)
    if "seed" in sampling and (isinstance(sampling["seed"], bool) or not isinstance(sampling["seed"], int)):
        raise _bad("'seed' must be an integer", "seed")
    stop = sampling.get("stop")
    if isinstance(stop, str):
        sampling["stop"] = [stop]
    elif stop is not None and not (isinstance(stop, list) and all(isinstance(item, str) for item in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(sampling.get("stop") or ()) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings", "stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _bad("'max_tokens' / 'max_completion_tokens' must be a positive integer", "max_tokens")
        sampling["max_tokens"] = limit
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    top_logprobs = _top_logprobs(body.get("top_logprobs"), bool(logprobs))
    if top_logprobs:
        sampling["top_logprobs"] = top_logprobs
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    try:
        check_fields(body)  # a field the gateway cannot honour is a 400 naming it
        check_penalties(sampling)
        bias = logit_bias(body.get("logit_bias"))
        check_parallel_tool_calls(body.get("parallel_tool_calls"), tool_choice)
        structured = structured_outputs(body.get("response_format"), tool_choice, tool_name, tools)
    except FieldError as error:
        raise _bad(error.message, error.code) from error
    if bias:
        sampling["logit_bias"] = bias
    if structured is not None:
        sampling["structured_outputs"] = structured
    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, Mapping) and bool(stream_options.get("include_usage"))
    model = body.get("model")
    return ChatCall(
        messages=checked,
        tools=tools,
        sampling=sampling,
        model=model if isinstance(model, str) else None,
        stream=bool(body.get("stream")),
        include_usage=include_usage,
        logprobs=bool(logprobs),
        tool_choice=tool_choice,
        tool_name=tool_name,
        raw=body,
    )


MAX_TOP_LOGPROBS = 20
"""OpenAI's (and vLLM's default ``--max-logprobs``) limit on ``top_logprobs``."""


def _top_logprobs(value: Any, logprobs: bool) -> int:
    """``top_logprobs`` checked: an integer in [0, 20], and only with ``logprobs: true`` when above 0, as OpenAI
    requires. The call's generate request then asks the engine for that many candidates per token."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise _bad(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value!r}", "top_logprobs")
    if value and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return value


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """``tool_choice`` checked, with the function a named choice forces. Missing, it is OpenAI's default: ``"auto"``
    with tools, ``"none"`` without (a call that offered no tools never gets a tool call back). ``"none"`` is enforced
    on the answer: its tool-call markup is left in the content and no call is returned (as vLLM answers without a
    tool parser), so the tokens stay the model's. ``"required"`` and a named function are enforced by constrained
    decoding (:func:`~fsm_rollout.gateway.request_fields.structured_outputs`)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(f"'tool_choice' {choice!r} is not one of 'auto', 'none', 'required'", "tool_choice")
        if choice == "required" and not tools:
            raise _bad("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        offered = [tool["function"]["name"] for tool in tools or ()]
        if not isinstance(name, str) or name not in offered:
            raise _bad(
                f"'tool_choice' names function {name!r}, which is not among the 'tools' {offered}", "tool_choice"
            )
        return "required", name
    if isinstance(choice, Mapping) and choice.get("type") == "allowed_tools":
        raise _bad("an 'allowed_tools' 'tool_choice' is not supported (send 'auto', 'required', 'none' or a function)")
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or a function object", "tool_choice")


def _is_tool(tool: Any) -> bool:
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return False
    function = tool.get("function")
    return isinstance(function, Mapping) and isinstance(function.get("name"), str)


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise _bad(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in _ROLES:
        raise _bad(f"{where} has role {role!r}; expected one of {sorted(_ROLES)}", "messages")
    out: dict[str, Any] = {"role": role, "content": _content(where, message.get("content"), role)}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{where} is a tool message without a 'tool_call_id' string", "messages")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls must be a list", "messages")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]
    elif out["content"] is None and role != "assistant":
        raise _bad(f"{where} has no content", "messages")
    return out


_IMAGE_ROLES = frozenset({"user", "tool"})


def _content(where: str, content: Any, role: str) -> str | list[dict[str, Any]] | None:
    """Text content: a string, or a list of text parts (joined). In a user or tool message, ``image_url`` parts
    with a ``data:`` URL are images the model sees: the content is then kept as its list of parts, in order (an
    image observation, :mod:`fsm_rollout.rollout.observation_images`). Other image, audio and file parts, and
    images behind http(s) URLs (a tape could not hold them), are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "messages")
    parts: list[dict[str, Any]] = []
    images = 0
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            parts.append(_image_part(where, part, role))
            images += 1
        elif kind in ("input_image", "image", "input_audio", "file", "video_url"):
            raise _bad(
                f"{where} has a {kind!r} part: the gateway accepts text, and images as 'image_url' parts with a "
                "data: URL in user and tool messages",
                "unsupported_content",
            )
        else:
            raise _bad(
                f"{where} has a content part that is not {{'type': 'text', 'text': str}}: {part!r:.80}", "messages"
            )
    if images:
        return parts
    return "".join(part["text"] for part in parts)


def _image_part(where: str, part: Mapping[str, Any], role: str) -> dict[str, Any]:
    if role not in _IMAGE_ROLES:
        raise _bad(f"{where} ({role}) has an image part: images are accepted in user and tool messages", "messages")
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url.startswith("data:image/"):
        raise _bad(
            f"{where} has an 'image_url' part whose url is not a data:image/... URL (http(s) images are refused: "
            "the session's tape could not hold their content)",
            "unsupported_content",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise _bad(f"{where}.function.arguments is not valid JSON ({error.msg})", "messages") from error
    else:
        decoded = arguments
    if not isinstance(decoded, dict):
        raise _bad(f"{where}.function.arguments must encode a JSON object", "messages")
    call_id = call.get("id")
    return {"id": call_id if isinstance(call_id, str) else "", "name": function["name"], "arguments": decoded}


def render_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A checked message as the rollout sends it to the engine's render: OpenAI's wire form, tool-call arguments as
    JSON strings (vLLM refuses objects; it decodes them for the template itself, as local renders do with
    :func:`fsm_rollout.tokens.chat_messages.template_messages`)."""
    out = {key: value for key, value in message.items() if key != "tool_calls"}
    if out.get("content") is None:
        out["content"] = ""
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [wire_tool_call(call["id"], call["name"], call["arguments"]) for call in calls]
    return out


@dataclass(frozen=True)
class TurnAnswer:
    """What the model answered to one call, read from the tokens it generated."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    """``{"id", "name", "arguments"}`` with decoded arguments."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    weight_version: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Each token's top candidates ``(token_id, logprob)`` in the engine's order, when the call asked for them."""
    reasoning: str | None = None
    """The model's thinking (the text before ``</think>`` when its template thinks), kept out of ``content``."""
    reasoning_tokens: int = 0
    """How many of the generated tokens are the thinking: its opening and closing tags included, up to the token
    that completes ``</think>`` (all of the turn's text tokens when it was cut inside its thinking)."""

    def message(self) -> dict[str, Any]:
        """The assistant message as the session holds it (checked form)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        return out


def without_stop_string(answer: TurnAnswer, stop: Sequence[str] | None) -> TurnAnswer:
    """The answer as OpenAI and vLLM return it: content without the stop string the generation stopped on. Only
    what the agent reads changes; the tokens (trained on) keep it."""
    content = answer.content
    if not stop or not content or answer.finish_reason not in ("stop", "tool_calls"):
        return answer
    for string in stop:
        if string and answer.text.endswith(string):
            kept = string.strip()  # the content was stripped of surrounding whitespace already
            if kept and content.endswith(kept):
                cut = content[: len(content) - len(kept)].rstrip()
                return replace(answer, content=cut if cut or not answer.tool_calls else None)
            return answer
    return answer
