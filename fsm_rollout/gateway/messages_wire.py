"""The Anthropic Messages API on the wire: a request read into a :class:`~fsm_rollout.gateway.openai_wire.ChatCall`
(chat's wire form, so one session machinery serves both dialects), the answer as a ``message`` object or its SSE
events, and errors in Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

How a request becomes chat messages:

* ``system`` (a string or text blocks) is one system message, its blocks' texts joined by a blank line (and so is
  a ``system`` message among the ``messages``);
* a user message's ``text`` and ``image`` blocks are a user message (text joined by a blank line; with images, its
  list of parts, each base64 image a ``data:`` URL ``image_url`` part; an image behind a URL is refused, as chat
  refuses http images); each ``tool_result`` block is a tool message with its ``tool_call_id``, in block order
  (the text around tool results becomes user messages in place). A result with ``is_error`` is shown to the model
  with :data:`ERROR_PREFIX` before its text;
* an assistant message's text blocks are its content, its ``tool_use`` blocks its tool calls (``input`` as the
  arguments); its ``thinking`` and ``redacted_thinking`` blocks are dropped: they echo the model's own thinking,
  which the session holds as generated tokens, and the session compares the answer without it, so an echoed
  thinking block is no change of history;
* ``tools`` with an ``input_schema`` are chat function tools; Anthropic's typed tools (``web_search_20250305``,
  ``bash_20250124``, ...) have no schema the model could call: they are left out of the prompt and named in
  :attr:`MessagesCall.dropped_tools`;
* ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` is chat's ``auto`` / ``required`` / the named function /
  ``none``; ``disable_parallel_tool_use`` holds where a forcing choice makes one call, and is not enforced under
  ``auto``.

Sampling: ``max_tokens`` (required, as Anthropic requires it), ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``; ``output_config.format`` (structured output) is chat's ``response_format``. ``thinking`` is accepted and
does not change the tokens: whether the model thinks is its chat template's (the runner's template kwargs).
Fields the API has that do not change the tokens (:data:`IGNORED_FIELDS`) are accepted and ignored; a field the
API does not have is a 400 naming it, as Anthropic answers it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer, parse_chat_request

__all__ = [
    "ERROR_PREFIX",
    "IGNORED_FIELDS",
    "MessagesCall",
    "error_type",
    "is_messages_path",
    "message_events",
    "message_object",
    "messages_error_body",
    "new_message_id",
    "parse_messages_request",
    "sse",
    "stop_reason",
    "thinking_signature",
]

ERROR_PREFIX = "Error: "
"""What a ``tool_result`` with ``is_error: true`` shows the model before its text, so the failure stays visible."""

# the Messages API's fields the gateway reads, and those with no effect on the tokens the model sees or generates
# (accepted, never a 400); Anthropic's error type of each status (409, which it does not use, is a request error)
# fmt: off
USED_FIELDS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "temperature", "top_p",
    "top_k", "stream", "metadata", "thinking", "output_config", "output_format",
})
IGNORED_FIELDS = frozenset({
    "context_management", "cache_control", "service_tier", "container", "mcp_servers", "inference_geo", "speed",
    "diagnostics", "betas", "user_profile_id", "workspace_id", "compaction", "billing_policy", "thread", "fallbacks",
    "fallback_credit_token",
})
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    529: "overloaded_error",
}
# fmt: on
_BLOCK_JOIN = "\n\n"
_ECHOED_THINKING = frozenset({"thinking", "redacted_thinking"})


def _bad(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code)


# ---------------------------------------------------------------------- errors and paths


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is a Messages API path (its errors are answered in Anthropic's shape)."""
    return path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (409, which Anthropic does not use, is a request error)."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def messages_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# ---------------------------------------------------------------------- the request


@dataclass(frozen=True)
class MessagesCall:
    """A Messages request, read: the chat call it is, and what it says that chat has no place for."""

    call: ChatCall
    stop_sequences: tuple[str, ...] = ()
    dropped_tools: tuple[str, ...] = ()
    """The names (else types) of Anthropic's typed tools, left out of the prompt."""


def parse_messages_request(
    body: Any, headers: Mapping[str, str] | None = None, *, count_only: bool = False
) -> MessagesCall:
    """A Messages request body (or a ``count_tokens`` one, without ``max_tokens``), checked (400 naming what is
    wrong). ``headers``: the request's, for the call's hints (``X-Claude-Code-Session-Id``)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for key, value in body.items():
        if key not in USED_FIELDS and key not in IGNORED_FIELDS and value is not None:
            raise _bad(f"{key}: Extra inputs are not permitted (not a Messages API field)", key)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text_of("system", system)})
    for index, message in enumerate(messages):
        chat.extend(_messages_of(index, message))
    tools, dropped = _tools(body.get("tools"))
    out: dict[str, Any] = {"messages": chat}
    if tools:
        out["tools"] = tools
    _tool_choice(body.get("tool_choice"), out)
    limit = body.get("max_tokens")
    if limit is None and not count_only:
        raise _bad("'max_tokens' is required", "max_tokens")
    if limit is not None and not count_only:
        out["max_tokens"] = limit
    for key in ("model", "temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stream") is not None and not count_only:
        out["stream"] = body["stream"]
    output = body.get("output_config")
    if output is not None and not isinstance(output, dict):
        raise _bad("'output_config' must be an object", "output_config")
    fmt = (output or {}).get("format") or body.get("output_format")
    if fmt is not None:
        out["response_format"] = _response_format(fmt)
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and isinstance(thinking.get("type"), str)):
        raise _bad("'thinking' must be an object with a 'type'", "thinking")
    call = parse_chat_request(out)
    sampling = dict(call.sampling)
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:  # set here: chat's limit of four stop strings is OpenAI's, not Anthropic's
        sampling["stop"] = list(stops)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise _bad("'top_k' must be a positive integer", "top_k")
        sampling["top_k"] = top_k
    return MessagesCall(
        call=replace(call, sampling=sampling, raw=body, hints=_hints(body.get("metadata"), headers or {})),
        stop_sequences=stops,
        dropped_tools=tuple(dropped),
    )


def _hints(metadata: Any, headers: Mapping[str, str]) -> dict[str, Any]:
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    hints: dict[str, Any] = {}
    session_key = headers.get("X-Claude-Code-Session-Id")
    if session_key:
        hints["session_key"] = session_key
    user = (metadata or {}).get("user_id")
    if user is not None:
        if not isinstance(user, str):
            raise _bad("'metadata.user_id' must be a string", "metadata")
        hints["user"] = user
    return hints


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise _bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    return tuple(value)


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": dict(fmt["schema"])}}


def _blocks(where: str, content: Any) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise _bad(f"{where}.content must be a string or a list of content blocks", "messages")
    return content


def _text(where: str, block: Mapping[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where} is a text block without a 'text' string", "messages")
    return text


def _text_of(where: str, content: Any) -> str:
    """Text-only content (``system``): a string, or text blocks joined."""
    texts = []
    for index, block in enumerate(_blocks(where, content)):
        if block.get("type") != "text":
            raise _bad(f"{where}[{index}] is a {block.get('type')!r} block; only text blocks are accepted here")
        texts.append(_text(f"{where}[{index}]", block))
    return _BLOCK_JOIN.join(texts)


def _image(where: str, block: Mapping[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind != "base64":
        raise _bad(
            f"{where} is an image whose source is {kind!r}: images are accepted as base64 sources (an image behind "
            "a URL is refused: the session's tape could not hold its content)",
            "unsupported_content",
        )
    assert isinstance(source, dict)
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
        raise _bad(f"{where} needs a base64 source with an image 'media_type' and 'data'", "messages")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _parts(where: str, blocks: Sequence[Mapping[str, Any]]) -> str | list[dict[str, Any]]:
    """Text and image blocks as chat content: the texts joined, or the list of parts when there are images."""
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(f"{where}[{index}]", block)})
        elif kind == "image":
            parts.append(_image(f"{where}[{index}]", block))
        else:
            raise _bad(
                f"{where}[{index}] is a {kind!r} block: the gateway accepts text, base64 images, tool_use, "
                "tool_result and (dropped) thinking blocks",
                "unsupported_content",
            )
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return _BLOCK_JOIN.join(part["text"] for part in parts)


def _messages_of(index: int, message: Any) -> list[dict[str, Any]]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object", "messages")
    role = message.get("role")
    blocks = _blocks(where, message.get("content"))
    if role == "assistant":
        return [_assistant(where, blocks)]
    if role == "system":
        return [{"role": "system", "content": _text_of(where, blocks)}]
    if role != "user":
        raise _bad(f"{where} has role {role!r}; expected 'user', 'assistant' or 'system'", "messages")
    out: list[dict[str, Any]] = []
    pending: list[Mapping[str, Any]] = []
    for number, block in enumerate(blocks):
        if block.get("type") != "tool_result":
            pending.append(block)
            continue
        if pending:  # the text before a tool result stays before it
            out.append({"role": "user", "content": _parts(f"{where}.content", pending)})
            pending = []
        out.append(_tool_message(f"{where}.content[{number}]", block))
    if pending or not out:
        out.append({"role": "user", "content": _parts(f"{where}.content", pending)})
    return out


def _tool_message(where: str, block: Mapping[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _bad(f"{where} is a tool_result without a 'tool_use_id' string", "messages")
    content = block.get("content")
    result: str | list[dict[str, Any]] = "" if content is None else _parts(f"{where}.content", _blocks(where, content))
    if block.get("is_error") and isinstance(result, str):
        result = ERROR_PREFIX + result
    elif block.get("is_error"):
        result = [{"type": "text", "text": ERROR_PREFIX}, *result]
    return {"role": "tool", "tool_call_id": call_id, "content": result}


def _assistant(where: str, blocks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(f"{where}.content[{index}]", block))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise _bad(f"{where}.content[{index}] is a tool_use without a 'name' or an 'input' object", "messages")
            call_id = block.get("id")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind not in _ECHOED_THINKING:  # the model's own thinking, echoed: held as its tokens already
            raise _bad(
                f"{where}.content[{index}] is a {kind!r} block: an assistant message holds text, tool_use and "
                "thinking blocks",
                "unsupported_content",
            )
    message: dict[str, Any] = {"role": "assistant", "content": _BLOCK_JOIN.join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise _bad("'tools' must be a list of tools", "tools")
    tools: list[dict[str, Any]] = []
    dropped: list[str] = []
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        name = tool.get("name") if isinstance(tool, dict) else None
        if kind in (None, "custom") and isinstance(tool, dict):
            schema = tool.get("input_schema")
            if not isinstance(name, str) or not isinstance(schema, dict):
                raise _bad(f"tools[{index}] needs a 'name' string and an 'input_schema' object", "tools")
            function: dict[str, Any] = {"name": name}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            function["parameters"] = dict(schema)
            tools.append({"type": "function", "function": function})
        elif isinstance(kind, str):  # Anthropic's typed tool: nothing the model could call by a schema
            dropped.append(name if isinstance(name, str) else kind)
        else:
            raise _bad(f"tools[{index}] must be a tool object with a 'name' and an 'input_schema'", "tools")
    return tools, dropped


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    assert kind is None or isinstance(choice, dict)
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name'}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True and kind in ("any", "tool"):
        out["parallel_tool_calls"] = False  # enforced: the forced call is one call


# ---------------------------------------------------------------------- the answer


def stop_reason(answer: TurnAnswer, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of an answer: ``max_tokens`` when cut by the limit, ``tool_use`` when it
    calls tools, ``stop_sequence`` when its text ends with one of the call's stop sequences, else ``end_turn``."""
    if answer.finish_reason == "length":
        return "max_tokens", None
    if answer.tool_calls:
        return "tool_use", None
    for sequence in stop_sequences:
        if answer.text.endswith(sequence):
            return "stop_sequence", sequence
    return "end_turn", None


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block of ours: opaque, stable for the text; clients send it back, and the
    gateway never checks it (the echoed block is dropped)."""
    return "fsm-rollout." + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(answer: TurnAnswer) -> dict[str, int]:
    return {
        "input_tokens": answer.prompt_tokens,
        "output_tokens": answer.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _content(answer: TurnAnswer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append(
            {"type": "thinking", "thinking": answer.reasoning, "signature": thinking_signature(answer.reasoning)}
        )
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        call_id = _tool_use_id(call["id"])
        blocks.append({"type": "tool_use", "id": call_id, "name": call["name"], "input": call["arguments"]})
    return blocks


def message_object(
    answer: TurnAnswer, *, message_id: str, model: str, stop_sequences: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``message`` object for an answer (its content blocks: thinking, text, tool_use)."""
    reason, sequence = stop_reason(answer, stop_sequences)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(answer),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(answer),
    }


def message_events(
    answer: TurnAnswer, *, message_id: str, model: str, stop_sequences: Sequence[str] = ()
) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, data)`` pairs that stream an answer: ``message_start``, a ``ping``, each content block's
    start, delta(s) and stop, ``message_delta`` (stop reason, usage) and ``message_stop``."""
    start = message_object(answer, message_id=message_id, model=model, stop_sequences=stop_sequences)
    reason, sequence = start["stop_reason"], start["stop_sequence"]
    blocks = start["content"]
    usage = start["usage"]
    start = {**start, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start}),
        ("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(blocks):
        kind = block["type"]
        if kind == "thinking":
            opened: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            opened = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}))
        events.extend(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}) for delta in deltas
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage},
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def sse(events: Sequence[tuple[str, Mapping[str, Any]]]) -> bytes:
    """Server-sent events, ``event: NAME`` and ``data: JSON`` each."""
    return b"".join(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n" for name, data in events)


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"
