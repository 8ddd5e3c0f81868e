"""Internal: chat messages in the two forms they travel in: as an engine takes them, and as a template gets them.

* The *wire* form is OpenAI's: an assistant message's ``tool_calls[].function.arguments`` is a JSON **string**.
  vLLM validates every message it renders against OpenAI's schema, so a message built for an engine (a render
  request) must be in this form: an object there is a 400.
* The *template* form is what vLLM hands the chat template after parsing the request: each tool call's string
  ``arguments`` decoded into an object (templates write ``tool_call.arguments | tojson``), missing or empty
  arguments as ``{}``, and an empty ``tool_calls`` list dropped. Every local render of messages (the observation
  encoder's dummy prefix, the parity check, the embedded engine's and the fake server's render) goes through
  :func:`template_messages`, so its tokens are exactly the engine's.

A JSON string decoded by the template form and encoded again is the same object (key order kept), so the tokens of
a conversation do not depend on the form it was built in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["template_messages", "wire_arguments", "wire_messages", "wire_tool_call"]


def wire_arguments(arguments: Any) -> str:
    """A tool call's ``arguments`` as the JSON string OpenAI's schema wants (a string is kept as given)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def wire_tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """One assistant ``tool_calls`` item in the wire form."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": wire_arguments(arguments)}}


def wire_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool-call arguments are JSON strings (objects are encoded; the rest is kept)."""
    return [_map_calls(message, _wire_call) for message in messages]


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` as vLLM hands them to the chat template: each assistant tool call's ``arguments``
    decoded into an object (an object is kept; empty, null, malformed or non-object JSON becomes ``{}``, as vLLM
    coerces it), and an empty ``tool_calls`` list dropped."""
    out = []
    for message in messages:
        copied = _map_calls(message, _template_call)
        if copied.get("role") == "assistant" and copied.get("tool_calls") == []:
            del copied["tool_calls"]  # vLLM drops it, so the template takes its plain assistant path
        out.append(copied)
    return out


def _map_calls(message: Mapping[str, Any], convert: Any) -> dict[str, Any]:
    copied = dict(message)
    calls = copied.get("tool_calls")
    if copied.get("role") == "assistant" and isinstance(calls, list):
        copied["tool_calls"] = [convert(call) for call in calls]
    return copied


def _wire_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "arguments" not in function or isinstance(function["arguments"], str):
        return call
    return {**call, "function": {**function, "arguments": wire_arguments(function["arguments"])}}


def _template_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
