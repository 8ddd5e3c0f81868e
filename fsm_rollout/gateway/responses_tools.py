"""Internal: a Responses request's ``tools`` and ``tool_choice`` in chat's form, namespaces flattened.

Chat templates know one flat list of functions, so:

* a ``function`` tool (Responses' flat form, or chat's nested form sent by mistake) becomes chat's nested form;
* a ``namespace`` tool (functions grouped under a name: how Codex offers its subagent tools, ``multi_agent_v1``)
  gives one function per member, named ``<namespace>__<name>`` (:func:`flat_name`: the flat name Codex itself uses
  where a namespace cannot be kept, so the model sees the name Codex would show it). The answer's call of such a
  function goes back as ``{"name": <name>, "namespace": <namespace>}``, as OpenAI's API returns it and Codex
  dispatches it, and the call echoed back is read as the flat name again (:func:`call_name`);
* other tool types (hosted tools, ``custom`` freeform tools, ``local_shell``, also inside a namespace) cannot be
  called through chat markup: they are left out of the prompt and reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsm_rollout.gateway.openai_wire import GatewayError

__all__ = ["NAMESPACE_SEPARATOR", "Toolset", "call_name", "flat_name", "parse_tools", "tool_choice"]

NAMESPACE_SEPARATOR = "__"


def _bad(message: str, code: str) -> GatewayError:
    return GatewayError(400, message, code=code)


def flat_name(namespace: str, name: str) -> str:
    """A namespaced function's name in the prompt: ``<namespace>__<name>``, stray underscores at the join dropped
    (``mcp__cal__`` and ``__create`` give ``mcp__cal__create``), so there is exactly one separator."""
    return f"{namespace.rstrip('_')}{NAMESPACE_SEPARATOR}{name.lstrip('_')}"


@dataclass(frozen=True)
class Toolset:
    """The request's tools as the prompt holds them."""

    tools: list[dict[str, Any]] | None
    """The callable functions in chat's nested form (namespaced ones by their flat names)."""
    dropped: list[dict[str, Any]]
    """``{"type", "name"?, "namespace"?}`` of each tool left out of the prompt."""
    namespaced: Mapping[str, tuple[str, str]]
    """A namespaced function's flat name to its ``(namespace, name)``."""

    def wire_name(self, name: str) -> dict[str, str]:
        """The ``name`` (and ``namespace``) fields of a ``function_call`` item for the model's call of ``name``."""
        split = self.namespaced.get(name)
        if split is None:
            return {"name": name}
        return {"name": split[1], "namespace": split[0]}


def call_name(where: str, item: Mapping[str, Any], code: str) -> str:
    """The function a ``function_call`` item (or a forcing ``tool_choice``) names, as the prompt names it."""
    name, namespace = item.get("name"), item.get("namespace")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where} has no 'name' string", code)
    if namespace is None or namespace == "":
        return name
    if not isinstance(namespace, str):
        raise _bad(f"{where}.namespace must be a string", code)
    return flat_name(namespace, name)


def _function(where: str, tool: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    nested = tool.get("function")
    spec = nested if isinstance(nested, dict) and "name" not in tool else tool  # chat's form, sent by mistake
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad(f"{where} is a function without a 'name'", "tools")
    function: dict[str, Any] = {"name": name or spec["name"]}
    for key in ("description", "parameters", "strict"):
        if spec.get(key) is not None:
            function[key] = spec[key]
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise _bad(f"{where}.parameters must be a JSON schema object", "tools")
    return {"type": "function", "function": function}


def parse_tools(value: Any) -> Toolset:
    """The request's ``tools`` (:class:`GatewayError` 400 naming what is wrong)."""
    if value is None:
        return Toolset(None, [], {})
    if not isinstance(value, list):
        raise _bad("'tools' must be a list of tools", "tools")
    tools: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _bad(f"{where} must be an object with a 'type'", "tools")
        if tool["type"] == "function":
            tools.append(_function(where, tool))
        elif tool["type"] == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
                raise _bad(f"{where} is a namespace without a 'name' and a 'tools' list", "tools")
            for number, member in enumerate(members):
                inner = f"{where}.tools[{number}]"
                if not isinstance(member, dict) or not isinstance(member.get("name"), str) or not member["name"]:
                    raise _bad(f"{inner} must be an object with a 'name'", "tools")
                if member.get("type", "function") != "function":
                    dropped.append({"type": member.get("type"), "name": member["name"], "namespace": namespace})
                    continue
                flat = flat_name(namespace, member["name"])
                namespaced[flat] = (namespace, member["name"])
                tools.append(_function(inner, member, flat))
        else:
            name = tool.get("name")
            dropped.append({"type": tool["type"], **({"name": name} if isinstance(name, str) else {})})
    names = [tool["function"]["name"] for tool in tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise _bad(f"'tools' names a function twice (namespaces flattened as <namespace>__<name>): {twice}", "tools")
    return Toolset(tools or None, dropped, namespaced)


def tool_choice(choice: Any, toolset: Toolset) -> Any:
    """Responses' ``tool_choice`` in chat's form (chat checks it against the tools). A forced function may be
    named with its ``namespace``, by its flat name, or, when that is unambiguous, by its name alone."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict):
        raise _bad("'tool_choice' must be 'auto', 'none', 'required' or a tool object", "tool_choice")
    if choice.get("type") == "function":
        name = call_name("tool_choice", choice, "tool_choice")
        members = [flat for flat, (_, inner) in toolset.namespaced.items() if inner == name]
        listed = {tool["function"]["name"] for tool in toolset.tools or ()}
        if name not in listed and len(members) == 1:
            name = members[0]
        return {"type": "function", "function": {"name": name}}
    if choice.get("type") == "allowed_tools":
        raise _bad("an 'allowed_tools' 'tool_choice' is not supported", "tool_choice")
    names = [tool.get("name", tool["type"]) for tool in toolset.dropped]
    raise _bad(
        f"'tool_choice' forces a {choice.get('type')!r} tool, which the gateway drops from the prompt ({names}): "
        "only function tools can be called",
        "tool_choice",
    )
