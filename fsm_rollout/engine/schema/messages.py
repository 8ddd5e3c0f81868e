"""Chat messages as vLLM's render validates them: OpenAI's message schema, with vLLM's custom-role message beside it.

vLLM 0.32 reads ``messages`` as a list of ``ChatCompletionMessageParam``, a union of OpenAI's typed messages
(``developer``, ``system``, ``user``, ``assistant``, ``tool``, ``function``) and vLLM's
``CustomChatCompletionMessageParam`` (any string role; optional ``content``, ``name``, ``tool_call_id``,
``tool_calls``, ``reasoning``). pydantic accepts a message when one member of the union accepts it, and each member
ignores the keys it does not declare. So, in effect:

* a message is an object with a string ``role``; ``content`` is a string or a list of parts, and may be left out;
* the custom member takes any role, ``content`` not null, ``name`` a string, ``tool_call_id`` and ``reasoning``
  strings or null, ``tool_calls`` null or a list of function tool calls;
* OpenAI's member for the message's role takes what it declares: null ``content`` in an ``assistant`` or
  ``function`` message, a ``tool`` message's ``tool_call_id`` as a string, an ``assistant``'s ``tool_calls`` as a
  list of function (or custom) tool calls, and ignores ``reasoning`` and the rest;
* a function tool call is ``{"id": str, "type": "function", "function": {"name": str, "arguments": str}}``: the
  **arguments are a JSON string**. An object there is the 400 real clients meet when they send an engine the form a
  chat template takes (:mod:`fsm_rollout.tokens.chat_messages`). A tool call of another type passes the schema and is
  refused right after, when vLLM prepares the messages for the template.

A message no member accepts is a 400 in pydantic's words, naming the field the member for its role refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsm_rollout.engine.schema.requests import RequestError

__all__ = ["check_chat_message"]

_Failure = tuple[str, str] | None
"""Where a member refused the message (a dotted path after ``messages.<index>``) and pydantic's words, or None."""

_STRING = "Input should be a valid string"
_MEMBERS = {
    "developer": "ChatCompletionDeveloperMessageParam",
    "system": "ChatCompletionSystemMessageParam",
    "user": "ChatCompletionUserMessageParam",
    "assistant": "ChatCompletionAssistantMessageParam",
    "tool": "ChatCompletionToolMessageParam",
    "function": "ChatCompletionFunctionMessageParam",
}
_CUSTOM = "CustomChatCompletionMessageParam"
_FUNCTION_CALL = "ChatCompletionMessageFunctionToolCallParam"


def check_chat_message(message: Any, index: int) -> None:
    """Check ``messages[index]`` as vLLM's request model does (:class:`RequestError` 400 otherwise)."""
    where = f"messages.{index}"
    if not isinstance(message, Mapping):
        raise _error(f"{where}.{_CUSTOM}", f"Input should be a valid dictionary [input_type={type(message).__name__}]")
    role = message.get("role")
    if "role" not in message:
        raise _error(f"{where}.{_CUSTOM}.role", "Field required")
    if not isinstance(role, str):
        raise _error(f"{where}.{_CUSTOM}.role", f"{_STRING} [input_type={type(role).__name__}]")
    custom = _custom(message)
    member = _MEMBERS.get(role)
    if custom is not None:
        if member is None:
            raise _error(f"{where}.{_CUSTOM}.{custom[0]}", custom[1])
        typed = _typed(role, message)
        if typed is not None:
            raise _error(f"{where}.{member}.{typed[0]}", typed[1])
    # the schema passed; vLLM then prepares the messages for the template and refuses other call types
    calls = message.get("tool_calls")
    if role == "assistant" and isinstance(calls, list) and any(_not_function(call) for call in calls):
        raise RequestError(400, "chat completions only support assistant tool_calls of type 'function'.", "tool_calls")


def _not_function(call: Any) -> bool:
    return isinstance(call, Mapping) and call.get("type", "function") != "function"


def _error(location: str, what: str) -> RequestError:
    return RequestError(400, f"1 validation error for ChatCompletionRequest\n{location}\n  {what}", "messages")


def _kind(value: Any) -> str:
    return f"[input_type={type(value).__name__}]"


def _custom(message: Mapping[str, Any]) -> _Failure:
    """vLLM's custom member: any role, every field optional, the declared ones typed."""
    if "content" in message and not isinstance(message["content"], str | list):
        return "content", f"Input should be a valid string or a valid list {_kind(message['content'])}"
    if "name" in message and not isinstance(message["name"], str):
        return "name", f"{_STRING} {_kind(message['name'])}"
    for key in ("tool_call_id", "reasoning"):
        if message.get(key) is not None and not isinstance(message[key], str):
            return key, f"{_STRING} {_kind(message[key])}"
    calls = message.get("tool_calls")
    if calls is not None:
        return _tool_calls(calls, custom_calls=False)
    return None


def _typed(role: str, message: Mapping[str, Any]) -> _Failure:
    """OpenAI's member for ``role`` (one of :data:`_MEMBERS`); keys it does not declare are ignored."""
    nullable = role in ("assistant", "function")
    if "content" not in message and role != "assistant":
        return "content", "Field required"
    content = message.get("content")
    if not (isinstance(content, str | list) or (content is None and nullable)):
        return "content", f"Input should be a valid string or a valid list {_kind(content)}"
    if role == "function" and not isinstance(message.get("name"), str):
        return "name", "Field required" if "name" not in message else f"{_STRING} {_kind(message['name'])}"
    if "name" in message and not isinstance(message["name"], str):
        return "name", f"{_STRING} {_kind(message['name'])}"
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        missing = "tool_call_id" not in message
        return "tool_call_id", "Field required" if missing else f"{_STRING} {_kind(message['tool_call_id'])}"
    if role == "assistant" and "tool_calls" in message:
        return _tool_calls(message["tool_calls"], custom_calls=True)
    return None


def _tool_calls(calls: Any, *, custom_calls: bool) -> _Failure:
    if not isinstance(calls, list):
        return "tool_calls", f"Input should be a valid list {_kind(calls)}"
    for number, call in enumerate(calls):
        at = f"tool_calls.{number}.{_FUNCTION_CALL}"
        if not isinstance(call, Mapping):
            return at, f"Input should be a valid dictionary {_kind(call)}"
        if custom_calls and call.get("type") == "custom" and _custom_call_ok(call):
            continue
        failure = _function_call(call)
        if failure is not None:
            return f"{at}.{failure[0]}", failure[1]
    return None


def _function_call(call: Mapping[str, Any]) -> _Failure:
    if not isinstance(call.get("id"), str):
        return "id", "Field required" if "id" not in call else f"{_STRING} {_kind(call['id'])}"
    if call.get("type") != "function":
        return "type", "Field required" if "type" not in call else "Input should be 'function'"
    function = call.get("function")
    if not isinstance(function, Mapping):
        return "function", "Field required" if "function" not in call else "Input should be a valid dictionary"
    for key in ("name", "arguments"):
        if key not in function:
            return f"function.{key}", "Field required"
        if not isinstance(function[key], str):
            return f"function.{key}", f"{_STRING} [type=string_type, {_kind(function[key])[1:]}"
    return None


def _custom_call_ok(call: Mapping[str, Any]) -> bool:
    custom = call.get("custom")
    return (
        isinstance(call.get("id"), str)
        and isinstance(custom, Mapping)
        and isinstance(custom.get("name"), str)
        and isinstance(custom.get("input"), str)
    )
