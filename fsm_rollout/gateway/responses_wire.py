"""OpenAI Responses on the wire: a request read into a chat call, and the ``response`` object of an answer.

A Responses request is converted into the Chat Completions form the session machinery already holds
(:func:`~fsm_rollout.gateway.openai_wire.parse_chat_request` then checks it as it checks chat):

* ``instructions`` is a leading system message; ``input`` (a string: one user message, or items) follows:
  ``message`` items by role (``developer`` becomes ``system``: chat templates such as Qwen's render no other role
  and would drop it silently), ``input_text``/``output_text`` parts joined, ``input_image`` parts with a data URL
  as chat ``image_url`` parts;
* consecutive assistant ``message`` and ``function_call`` items form one assistant message (its content and tool
  calls), and a ``function_call_output`` is a tool message answering its ``call_id``;
* ``reasoning`` items are dropped: they echo the model's thinking, which the session holds in its tokens, so an
  echoed reasoning item is no fork;
* ``tools`` of type ``function`` (Responses' flat form) become chat's nested form, and the functions of a
  ``namespace`` tool (Codex's subagent tools) flat functions named ``<namespace>__<name>``, whose calls go back
  with their ``namespace`` (:mod:`fsm_rollout.gateway.responses_tools`); other tool types (hosted tools,
  ``custom`` freeform tools, ``local_shell``) cannot be called through chat markup, so they are dropped from the
  prompt and reported (:attr:`ResponsesRequest.dropped_tools`, the session's ``metadata["dropped_tools"]``).

The answer becomes a ``response`` object (:func:`response_object`) and, streamed, the events of
:mod:`fsm_rollout.gateway.responses_events`; errors are OpenAI's, naming the field."""

from __future__ import annotations

import base64
import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer, parse_chat_request
from fsm_rollout.gateway.responses_tools import Toolset, call_name, parse_tools, tool_choice

__all__ = [
    "RESPONSES_FIELDS",
    "ResponsesRequest",
    "StoredResponses",
    "assistant_message",
    "parse_responses_request",
    "response_object",
]

RESPONSES_FIELDS: Mapping[str, str] = {
    # shape the call (converted to the chat call's fields)
    "model": "call",
    "input": "call",
    "instructions": "call",
    "tools": "call",
    "tool_choice": "call",
    "parallel_tool_calls": "call",
    "max_output_tokens": "call",
    "temperature": "call",
    "top_p": "call",
    "text": "call",
    "stream": "call",
    "store": "call",
    "include": "call",
    "previous_response_id": "call",
    # no effect on the tokens: accepted (and echoed where the response has the field) so harnesses run unchanged
    "reasoning": "bookkeeping",
    "prompt_cache_key": "bookkeeping",
    "prompt_cache_retention": "bookkeeping",
    "metadata": "bookkeeping",
    "client_metadata": "bookkeeping",
    "stream_options": "bookkeeping",
    "truncation": "bookkeeping",
    "user": "bookkeeping",
    "safety_identifier": "bookkeeping",
    "service_tier": "bookkeeping",
    # would change the answer in a way the gateway cannot honour: a 400 naming the field when set
    "background": "refused",
    "conversation": "refused",
    "prompt": "refused",
    "max_tool_calls": "refused",
    "top_logprobs": "refused",
}
"""What the gateway does with each Responses request field; a field in none of these is a 400 when not null."""

ENCRYPTED_PREFIX = "fsm-rollout.reasoning.v1:"
"""The prefix of our ``encrypted_content``: the reasoning text, base64 encoded. Accepted back as any reasoning item
is (dropped: the session holds the model's thinking in its tokens)."""

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"system": "system", "developer": "system", "user": "user"}


def _bad(message: str, code: str) -> GatewayError:
    return GatewayError(400, message, code=code)


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request, checked, with its conversation in chat's wire form (:meth:`chat_call` builds the call)."""

    body: Mapping[str, Any] = field(repr=False)
    instructions: str | None
    messages: list[dict[str, Any]]
    """The ``input`` as chat messages (without ``instructions``)."""
    toolset: Toolset
    """The tools as the prompt holds them (``function`` tools and the functions of ``namespace`` tools)."""
    chat_fields: dict[str, Any]
    stream: bool
    store: bool
    encrypted_reasoning: bool
    previous_response_id: str | None

    def chat_call(self, prior: Sequence[Mapping[str, Any]] = (), hints: Mapping[str, Any] | None = None) -> ChatCall:
        """The chat call: ``instructions``, then ``prior`` (a stored response's conversation), then ``input``."""
        messages: list[Any] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [*prior, *self.messages]
        if not messages:
            raise _bad("the request has no 'input' (and no 'instructions')", "input")
        body: dict[str, Any] = {"messages": messages, **self.chat_fields}
        if self.toolset.tools:
            body["tools"] = self.toolset.tools
        call = parse_chat_request(body)
        return replace(call, stream=self.stream, hints=dict(hints or {}), raw=self.body)

    def conversation(self, prior: Sequence[Mapping[str, Any]], answer: TurnAnswer) -> list[dict[str, Any]]:
        """What a stored response continues: ``prior``, this request's ``input`` and the answer (no instructions:
        a request that continues it states its own, as OpenAI's ``previous_response_id`` does)."""
        return [*(dict(message) for message in prior), *self.messages, assistant_message(answer)]

    @property
    def dropped_tools(self) -> list[dict[str, Any]]:
        """``{"type", "name"?, "namespace"?}`` of each tool left out of the prompt."""
        return self.toolset.dropped


def parse_responses_request(body: Any) -> ResponsesRequest:
    """A Responses request body, checked (:class:`GatewayError` 400 naming what is wrong). JSON objects are
    ``dict`` (as the body's decoder gives them): checked as such, which is cheaper than an abstract ``Mapping``."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "invalid_json")
    for key, value in body.items():
        kind = RESPONSES_FIELDS.get(key)
        if kind is None and value is not None:
            raise _bad(f"'{key}' is not a Responses field the gateway knows; it would be ignored", key)
        if kind == "refused" and value not in (None, False, 0):
            raise _bad(f"'{key}' is not supported by the gateway: it would change the answer in a way it cannot", key)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    toolset = parse_tools(body.get("tools"))
    chat: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = limit
    choice = tool_choice(body.get("tool_choice"), toolset)
    if choice is not None:
        chat["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if parallel is False and choice not in (None, "auto", "none"):
        # enforced only where a forcing choice makes one call; with "auto" it is the client's preference, which
        # Codex always states: accepted, as the model's answer cannot be changed after the fact
        chat["parallel_tool_calls"] = False
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(item, str) for item in include)):
        raise _bad("'include' must be a list of strings", "include")
    for key in ("stream", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be a boolean", key)
    for key in ("metadata", "reasoning"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _bad(f"'{key}' must be an object", key)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("'previous_response_id' must be a string", "previous_response_id")
    return ResponsesRequest(
        body=body,
        instructions=instructions or None,
        messages=_input(body.get("input")),
        toolset=toolset,
        chat_fields=chat,
        stream=bool(body.get("stream")),
        store=body.get("store") is not False,  # OpenAI's default is to store
        encrypted_reasoning="reasoning.encrypted_content" in (include or ()),
        previous_response_id=previous,
    )


# ---------------------------------------------------------------------------------------------------- input


def _input(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being gathered from consecutive items
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "reasoning":
            continue  # the model's own thinking echoed back: held in the session's tokens
        if kind == "message" and item.get("role") == "assistant":
            turn = turn or _open_turn(out)
            text = _content(where, item.get("content"), "assistant")
            turn["content"] = (turn["content"] or "") + str(text)
            continue
        if kind == "function_call":
            turn = turn or _open_turn(out)
            turn.setdefault("tool_calls", []).append(_function_call(where, item))
            continue
        turn = None
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise _bad(
                    f"{where} has role {item.get('role')!r}; expected developer, system, user or assistant", "input"
                )
            out.append({"role": role, "content": _content(where, item.get("content"), role)})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{where} is a function_call_output without a 'call_id' string", "input")
            output = item.get("output")
            if output is None:
                raise _bad(f"{where} is a function_call_output without an 'output'", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _content(where, output, "tool")})
        else:
            raise _bad(
                f"{where} has type {kind!r}: the gateway accepts message, function_call, function_call_output and "
                "reasoning items",
                "input",
            )
    return out


def _open_turn(out: list[dict[str, Any]]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    out.append(turn)
    return turn


def _function_call(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise _bad(f"{where} is a function_call without 'name' and 'call_id' strings", "input")
    name = call_name(where, item, "input")  # a namespaced function's call: the flat name the model wrote
    if not isinstance(arguments, str):
        raise _bad(f"{where}.arguments must be a JSON string", "input")
    try:
        decoded = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError as error:
        raise _bad(f"{where}.arguments is not valid JSON ({error})", "input") from error
    if not isinstance(decoded, dict):
        raise _bad(f"{where}.arguments must encode a JSON object", "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _content(where: str, content: Any, role: str) -> str | list[dict[str, Any]]:
    """A message's (or tool output's) content in chat's form: text parts joined, or the list of parts when it holds
    an image (a data URL, in user messages and tool outputs: what chat accepts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    parts: list[dict[str, Any]] = []
    images = False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if role not in ("user", "tool"):
                raise _bad(f"{where} ({role}) has an image: images are accepted in user messages and outputs", "input")
            if not isinstance(url, str) or not url.startswith("data:image/"):
                raise _bad(
                    f"{where} has an 'input_image' without a data:image/... 'image_url' (file ids and http(s) images "
                    "are refused: the session's tape could not hold their content)",
                    "unsupported_content",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
            images = True
        else:
            raise _bad(f"{where} has a content part the gateway does not accept: {part!r:.80}", "input")
    if images:
        return parts
    return "".join(part["text"] for part in parts)


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``text.verbosity`` is a hint to OpenAI's models: ignored)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("'text.format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": spec}


# ---------------------------------------------------------------------------------------------------- output


def assistant_message(answer: TurnAnswer) -> dict[str, Any]:
    """The answer as an assistant message in chat's wire form (what a stored response continues from)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
            for call in answer.tool_calls
        ]
    return message


def _item_id(prefix: str, response_id: str, index: int) -> str:
    """An output item's id: the response's, numbered (unique, and stable for the stream's events)."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{index}"


def output_items(
    answer: TurnAnswer, *, response_id: str, encrypted: bool, toolset: Toolset | None = None
) -> list[dict[str, Any]]:
    """The response's ``output``: the reasoning, the message (when there is text, or nothing else) and the calls
    (a namespaced function's call by its ``name`` and ``namespace``, as the request's ``toolset`` offered it)."""
    incomplete = answer.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    items: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        item: dict[str, Any] = {
            "type": "reasoning",
            "id": _item_id("rs", response_id, len(items)),
            "summary": [{"type": "summary_text", "text": answer.reasoning}] if answer.reasoning else [],
            "status": status if not answer.content and not answer.tool_calls else "completed",
        }
        if encrypted:
            item["encrypted_content"] = ENCRYPTED_PREFIX + base64.b64encode(answer.reasoning.encode()).decode()
        items.append(item)
    if answer.content or not answer.tool_calls:
        text = {"type": "output_text", "text": answer.content or "", "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": _item_id("msg", response_id, len(items)),
                "role": "assistant",
                "status": status,
                "content": [text],
            }
        )
    for call in answer.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": _item_id("fc", response_id, len(items)),
                "call_id": call["id"],  # what the client sends back in its function_call_output
                **(toolset.wire_name(call["name"]) if toolset is not None else {"name": call["name"]}),
                "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                "status": "completed",
            }
        )
    return items


def response_object(
    answer: TurnAnswer,
    request: ResponsesRequest,
    *,
    response_id: str,
    model: str,
    created_at: float | None = None,
) -> dict[str, Any]:
    """The ``response`` object of an answer, echoing the request's fields clients read back."""
    body = request.body
    incomplete = answer.finish_reason == "length"
    reasoning = body.get("reasoning") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": "incomplete" if incomplete else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output_items(
            answer, response_id=response_id, encrypted=request.encrypted_reasoning, toolset=request.toolset
        ),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": request.store,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or ()),
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        },
        "user": body.get("user"),
        "metadata": dict(body.get("metadata") or {}),
    }


class StoredResponses:
    """A session's stored responses (``store: true``), by id, each as the conversation it continues; the oldest
    are forgotten past ``limit``, so a long session's store stays bounded."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._kept[response_id] = conversation
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The stored conversation ``response_id`` continues (none: empty); unknown: 404 in OpenAI's shape."""
        if response_id is None:
            return []
        kept = self._kept.get(response_id)
        if kept is None:
            raise GatewayError(
                404,
                f"Previous response with id '{response_id}' not found (unknown, not stored, or forgotten)",
                code="previous_response_not_found",
            )
        return kept
