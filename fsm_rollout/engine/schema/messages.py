"""Chat messages as vLLM's render validates them: OpenAI's message schema, with vLLM's custom-role message beside it.

vLLM 0.32 reads ``messages`` as a list of ``ChatCompletionMessageParam``, a union of OpenAI's typed messages
(``developer``, ``system``, ``user``, ``assistant``, ``tool``, ``function``) and vLLM's
``CustomChatCompletionMessageParam`` (any string role; optional ``content``, ``name``, ``tool_call_id``,
``tool_calls``, ``reasoning``). pydantic accepts a message when one member of the union does, so in effect:

* a message is an object with a string ``role``;
* ``content`` is a string or a list of parts (objects or strings); it may be left out, and may be null only in an
  ``assistant`` or ``function`` message;
* ``name`` is a string; ``tool_call_id`` and ``reasoning`` are strings or null, and a ``tool`` message's
  ``tool_call_id`` may be left out (the custom member takes it);
* ``tool_calls`` is a list (null outside ``assistant``) of ``{"id": str, "type": "function", "function":
  {"name": str, "arguments": str}}``: **arguments are a JSON string**. An object there is the 400 real clients
  meet when they hand the template form to an engine (:mod:`fsm_rollout.chat_messages`).

Keys the schema does not name are ignored, as pydantic ignores them in a typed dict. A message that fails is a 400
naming the first bad field, in pydantic's words (``Input should be a valid string``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsm_rollout.engine.schema.requests import RequestError

__all__ = ["check_chat_message"]

_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})
_TOOL_CALL = "ChatCompletionMessageFunctionToolCallParam"


def _fail(where: str, what: str) -> RequestError:
    return RequestError(400, f"1 validation error for ChatCompletionRequest\n{where}\n  {what}", "messages")


def check_chat_message(message: Any, index: int) -> None:
    """Check ``messages[index]`` as vLLM's request model does (:class:`RequestError` 400 otherwise)."""
    where = f"messages.{index}"
    if not isinstance(message, Mapping):
        raise _fail(where, "Input should be a valid dictionary or instance of ChatCompletionMessageParam")
    role = message.get("role")
    if "role" not in message:
        raise _fail(f"{where}.role", "Field required")
    if not isinstance(role, str):
        raise _fail(f"{where}.role", "Input should be a valid string")
    if "content" in message:
        _check_content(message["content"], role, f"{where}.content")
    if "name" in message and not isinstance(message["name"], str):
        raise _fail(f"{where}.name", "Input should be a valid string")
    for key in ("tool_call_id", "reasoning"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise _fail(f"{where}.{key}", "Input should be a valid string")
    if "tool_calls" in message:
        _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")


def _check_content(content: Any, role: str, where: str) -> None:
    if isinstance(content, str):
        return
    if content is None:
        if role in _NULL_CONTENT_ROLES:
            return
        raise _fail(where, "Input should be a valid string or a list of content parts (null is not)")
    if not isinstance(content, list):
        raise _fail(where, "Input should be a valid string or a valid list of content parts")
    for number, part in enumerate(content):
        if not isinstance(part, str | Mapping):
            raise _fail(f"{where}.{number}", "Input should be a valid dictionary or a valid string")


def _check_tool_calls(calls: Any, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _fail(where, "Input should be a valid list")
    for number, call in enumerate(calls):
        at = f"{where}.{number}.{_TOOL_CALL}"
        if not isinstance(call, Mapping):
            raise _fail(at, "Input should be a valid dictionary")
        if not isinstance(call.get("id"), str):
            raise _fail(f"{at}.id", "Field required" if "id" not in call else "Input should be a valid string")
        if call.get("type") != "function":
            raise _fail(f"{at}.type", "Field required" if "type" not in call else "Input should be 'function'")
        function = call.get("function")
        if not isinstance(function, Mapping):
            what = "Field required" if function is None else "Input should be a valid dictionary"
            raise _fail(f"{at}.function", what)
        for key in ("name", "arguments"):
            if key not in function:
                raise _fail(f"{at}.function.{key}", "Field required")
            if not isinstance(function[key], str):
                raise _fail(
                    f"{at}.function.{key}",
                    f"Input should be a valid string [type=string_type, input_type={type(function[key]).__name__}]",
                )
