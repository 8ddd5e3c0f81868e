"""OpenAI Chat Completions on the wire: the request a gateway session accepts, its answer, its stream, its errors.

Requests are checked strictly, because every message becomes tokens the model is trained on or conditioned on:
a malformed message, ``n > 1`` or an image part is a 400 in OpenAI's error shape
``{"error": {"message", "type", "code"}}``, never a silent guess.

Messages are kept in two forms. The *wire* form is what the agent sent (tool-call ``arguments`` as JSON strings).
The *render* form is what a chat template is given, as vLLM gives it: text parts joined into one string and
tool-call arguments decoded into objects.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChatCall",
    "GatewayError",
    "TurnAnswer",
    "chat_completion",
    "error_body",
    "parse_chat_request",
    "render_message",
    "stream_chunks",
]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SAMPLING_KEYS = ("temperature", "top_p", "seed", "stop")


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


def _bad(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code)


@dataclass(frozen=True)
class ChatCall:
    """One chat call, checked: its messages (wire form), tools, sampling settings and answer options."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    """``temperature``, ``top_p``, ``seed``, ``stop`` and ``max_tokens``, as given (absent when not)."""
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)


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
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _bad("'max_tokens' / 'max_completion_tokens' must be a positive integer", "max_tokens")
        sampling["max_tokens"] = limit
    top_logprobs = body.get("top_logprobs")
    if top_logprobs:
        raise _bad(
            "top_logprobs > 0 is not supported: the engine is asked for the sampled token's logprob only "
            "(send logprobs=true for those)",
            "top_logprobs",
        )
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
        logprobs=bool(body.get("logprobs")),
        raw=body,
    )


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


def _content(where: str, content: Any, role: str) -> str | None:
    """Text content: a string, or a list of text parts (joined). Image, audio and file parts are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "image", "input_audio", "file", "video_url"):
            raise _bad(
                f"{where} has a {kind!r} part: the gateway accepts text content only (image observations are not "
                "supported yet)",
                "unsupported_content",
            )
        else:
            raise _bad(
                f"{where} has a content part that is not {{'type': 'text', 'text': str}}: {part!r:.80}", "messages"
            )
    return "".join(texts)


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
    """A checked message as a chat template is given it (tool-call arguments as objects, as vLLM passes them)."""
    out = {key: value for key, value in message.items() if key != "tool_calls"}
    if out.get("content") is None:
        out["content"] = ""
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in calls
        ]
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

    def message(self) -> dict[str, Any]:
        """The assistant message as the session holds it (checked form)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        return out


def _wire_calls(calls: Sequence[Mapping[str, Any]], *, with_index: bool = False) -> list[dict[str, Any]]:
    out = []
    for index, call in enumerate(calls):
        item: dict[str, Any] = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }
        if with_index:
            item = {"index": index, **item}
        out.append(item)
    return out


def _usage(answer: TurnAnswer) -> dict[str, int]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def _logprobs(answer: TurnAnswer, decode: Any) -> dict[str, Any]:
    content = []
    for token, logprob in zip(answer.token_ids, answer.logprobs, strict=False):
        text = decode([token])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def chat_completion(
    answer: TurnAnswer, *, completion_id: str, model: str, want_logprobs: bool = False, decode: Any = None
) -> dict[str, Any]:
    """The ``chat.completion`` object for an answer."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = _wire_calls(answer.tool_calls)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}
    if want_logprobs and decode is not None:
        choice["logprobs"] = _logprobs(answer, decode)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(answer),
    }


def stream_chunks(
    answer: TurnAnswer,
    *,
    completion_id: str,
    model: str,
    include_usage: bool,
    want_logprobs: bool = False,
    decode: Any = None,
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream an answer: the role, the content, the tool calls, the
    finish reason and, with ``include_usage``, a last chunk with no choices and the usage."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        if include_usage:
            item["usage"] = None
        return item

    chunks = [chunk({"role": "assistant", "content": ""})]
    if answer.content:
        logprobs = _logprobs(answer, decode) if want_logprobs and decode is not None else None
        chunks.append(chunk({"content": answer.content}, logprobs=logprobs))
    if answer.tool_calls:
        chunks.append(chunk({"tool_calls": _wire_calls(answer.tool_calls, with_index=True)}))
    chunks.append(chunk({}, answer.finish_reason))
    if include_usage:
        chunks.append(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(answer),
            }
        )
    return chunks
