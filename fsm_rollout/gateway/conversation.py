"""Does a call extend the conversation a session holds? Compared by meaning, so re-serialised JSON is no change.

A session holds the conversation the model has seen: the first call's messages, then for each turn the assistant
message it answered and the agent's new messages. A later call extends it when its messages begin with the held
ones and its tools are unchanged. Messages are compared by meaning:

* roles must match;
* an assistant message the model wrote matches by its text (surrounding whitespace ignored: agents often strip it)
  and its tool calls by name and *decoded* arguments, so ``{"flag": false}`` re-serialised as ``{"flag":false}``,
  with other key order or spacing, is the same call; the call ids are the agent's bookkeeping and are not compared;
* every other message matches by its text (and a tool message by its ``name``, when both give one).

Anything else (an edited, dropped or compacted message, changed tools) is a rewritten history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Extension", "compare_history", "same_message"]


@dataclass(frozen=True)
class Extension:
    """How a call relates to the held conversation.

    ``kind`` is ``"extends"`` (``new`` holds the messages after the held ones), ``"retry"`` (the call repeats the
    previous one: its messages are the held ones without the last answer) or ``"rewritten"`` (``detail`` says
    where it first differs).
    """

    kind: str
    new: list[dict[str, Any]]
    detail: str = ""


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return "" if content is None else str(content)


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [(call["name"], call["arguments"]) for call in message.get("tool_calls") or ()]


def same_message(held: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """Whether ``sent`` says what ``held`` says (both in the checked form of
    :func:`fsm_rollout.gateway.openai_wire.parse_chat_request`)."""
    if held.get("role") != sent.get("role"):
        return False
    if held["role"] == "assistant":
        return _text(held).strip() == _text(sent).strip() and _calls(held) == _calls(sent)
    if _text(held) != _text(sent):
        return False
    names = (held.get("name"), sent.get("name"))
    return held["role"] != "tool" or None in names or names[0] == names[1]


def _first_difference(held: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]]) -> int | None:
    for index, message in enumerate(held):
        if index >= len(sent) or not same_message(message, sent[index]):
            return index
    return None


def compare_history(
    held: Sequence[Mapping[str, Any]],
    held_tools: Sequence[Mapping[str, Any]] | None,
    sent: Sequence[Mapping[str, Any]],
    sent_tools: Sequence[Mapping[str, Any]] | None,
    *,
    last_answered: bool,
) -> Extension:
    """How ``sent`` (a call's messages and tools) relates to the ``held`` conversation.

    ``last_answered``: the held conversation ends with the assistant answer to the previous call (so a call that
    sends the conversation without it is that call again, retried by the agent's client).
    """
    if list(held_tools or ()) != list(sent_tools or ()):
        return Extension("rewritten", [], "the tools changed")
    if last_answered and len(sent) == len(held) - 1 and _first_difference(held[:-1], sent) is None:
        return Extension("retry", [])
    index = _first_difference(held, sent)
    if index is not None:
        if index >= len(sent):
            return Extension(
                "rewritten", [], f"the call sends {len(sent)} messages where the session holds {len(held)}"
            )
        return Extension(
            "rewritten", [], f"messages[{index}] ({held[index].get('role')}) differs from what the model saw"
        )
    return Extension("extends", [dict(message) for message in sent[len(held) :]])
