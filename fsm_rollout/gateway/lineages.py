"""Internal: which lineage of a session a call belongs to, and whether a rewrite is a compaction.

A session may hold several chains of calls (lineages): the main agent's, a subagent's, a title or summary side
request, a guardrail's. Each runs as its own rollout (:class:`~fsm_rollout.gateway.lineage.Lineage`). A call goes to:

1. the lineage its harness names (the ``lineage_key`` hint; a key not seen before opens a new lineage, or names an
   unnamed lineage the call continues);
2. else the lineage whose conversation it continues (extends, or repeats as a retry), compared by meaning on the
   messages alone (a continuation with other tools is that chain's rewrite, as before lineages; a continuation of a
   chain that ended is refused by it);
3. else the lineage with the same system prompt and tools (the most recently called live one): the call rewrites
   that chain, which forks (``history_rewritten``) or, for a compaction, ends its sequence ``compacted``;
4. else a new lineage (a different system prompt or tool set: another agent's chain).

A rewrite is a **compaction** when its harness says so (a ``window`` hint that changed on the lineage), else when the
call keeps the lineage's system prompt and tools and one of its new non-assistant messages holds the text of an
earlier answer of the session (the summary). The call that answered that text is the **summary call**, marked on its
sequence; so is a call whose ``request_kind`` hint names a compaction or a summary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsm_rollout.gateway.conversation import Extension, compare_history, same_message
from fsm_rollout.gateway.lineage import AnsweredCall, Lineage
from fsm_rollout.gateway.openai_wire import ChatCall

__all__ = [
    "MIN_SUMMARY_CHARS",
    "SUMMARY_KINDS",
    "Route",
    "find_summary",
    "hint",
    "is_compaction",
    "is_summary_request",
    "route",
    "signature",
]

SUMMARY_KINDS = ("compact", "summar")
"""A ``request_kind`` hint holding one of these (``compact``, ``compaction``, ``summary``, ``summarize``, …) asks
for a compaction's summary."""

MIN_SUMMARY_CHARS = 24
"""An earlier answer shorter than this is not looked for in a later prompt: short texts ("ok", "Done.") recur by
chance."""


@dataclass(frozen=True)
class Route:
    """Where a call goes: an existing ``lineage`` (None: a new one, keyed ``key``) and, for a lineage already
    called, how the call relates to its conversation (``found``)."""

    lineage: Lineage | None
    found: Extension | None = None
    key: str | None = None


def hint(call: ChatCall, name: str) -> Any:
    """A hint of the call (None when its dialect gave none)."""
    hints = call.hints if isinstance(call.hints, Mapping) else {}
    value = hints.get(name)
    return None if value is None or value == "" else value


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, Mapping))
    return str(content)


def signature(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> tuple[Any, ...]:
    """What tells chains apart: the leading system (or developer) messages' text and the tools."""
    system: list[str] = []
    for message in messages:
        if message.get("role") not in ("system", "developer"):
            break
        system.append(_text(message.get("content")))
    return tuple(system), repr(list(tools or ()))


def _compare(lineage: Lineage, call: ChatCall, *, tools: bool) -> Extension:
    held_tools, sent_tools = (lineage.tools, call.tools) if tools else (None, None)
    return compare_history(lineage.held, held_tools, call.messages, sent_tools, last_answered=lineage.last_answered)


def _continues(lineage: Lineage, call: ChatCall) -> bool:
    """The call continues the lineage's conversation (its messages alone, by meaning): it extends it or retries its
    last call; while a call is in flight, it extends or repeats that call's messages."""
    if not lineage.started:
        return False
    found = _compare(lineage, call, tools=False)
    if lineage.state == "answering":
        return found.kind == "extends"
    return found.kind in ("extends", "retry")


def _latest(candidates: Sequence[Lineage]) -> Lineage:
    """The lineage holding the longest conversation, then the most recently called."""
    return max(candidates, key=lambda lineage: (len(lineage.held), lineage.last_called))


def route(call: ChatCall, lineages: Sequence[Lineage]) -> Route:
    """Where ``call`` goes among ``lineages`` (the first is the main one, unstarted until the session's first call)."""
    key = hint(call, "lineage_key")
    key = None if key is None else str(key)
    main = lineages[0]
    chosen: Lineage | None = None
    if key is not None:
        chosen = next((lineage for lineage in lineages if lineage.key == key), None)
        if chosen is None:
            unnamed = [lineage for lineage in lineages if lineage.key is None and _continues(lineage, call)]
            if unnamed:
                chosen = _latest(unnamed)
            elif not main.started and main.key is None:
                chosen = main
            if chosen is None:
                return Route(None, key=key)
            chosen.key = key
    elif not main.started:
        chosen = main
    else:
        continued = [lineage for lineage in lineages if _continues(lineage, call)]
        if continued:
            chosen = _latest(continued)
        else:
            own = signature(call.messages, call.tools)
            alike = [
                lineage for lineage in lineages if lineage.started and signature(lineage.held, lineage.tools) == own
            ]
            if not alike:
                return Route(None)
            # a live chain first; a chain that ended (its agent idle, say) refuses the call as before lineages
            chosen = max(alike, key=lambda lineage: (not lineage.terminal, lineage.last_called))
    if not chosen.started or chosen.state == "answering":
        return Route(chosen)
    return Route(chosen, _compare(chosen, call, tools=True))


def is_summary_request(call: ChatCall) -> bool:
    """The harness says the call asks for a compaction's summary (its ``request_kind`` hint)."""
    kind = hint(call, "request_kind")
    return kind is not None and any(word in str(kind).lower() for word in SUMMARY_KINDS)


def find_summary(call: ChatCall, lineage: Lineage, lineages: Sequence[Lineage]) -> tuple[Lineage, AnsweredCall] | None:
    """The earlier answer of the session (the latest first) whose text one of the call's non-assistant messages
    holds where the lineage's conversation is rewritten: the summary a compaction put in place of earlier turns."""
    held = lineage.held
    start = 0
    while start < min(len(held), len(call.messages)) and same_message(held[start], call.messages[start]):
        start += 1
    texts = [_text(message.get("content")) for message in call.messages[start:] if message.get("role") != "assistant"]
    if not texts:
        return None
    answered = [(other, each) for other in lineages for each in other.answered_calls]
    for other, each in sorted(answered, key=lambda pair: (pair[1].order, pair[1].end), reverse=True):
        if len(each.content) >= MIN_SUMMARY_CHARS and any(each.content in text for text in texts):
            return other, each
    return None


def is_compaction(
    call: ChatCall, lineage: Lineage, lineages: Sequence[Lineage]
) -> tuple[bool, tuple[Lineage, AnsweredCall] | None]:
    """Whether the call's rewrite of ``lineage`` is a compaction, and the summary it found (None if none): the
    harness's ``window`` hint decides when it gives one on both calls; else the system prompt and tools are kept
    and a summary of the session's is found."""
    window = hint(call, "window")
    summary = find_summary(call, lineage, lineages)
    if window is not None and lineage.window is not None:
        return str(window) != str(lineage.window), summary
    same = signature(call.messages, call.tools) == signature(lineage.held, lineage.tools)
    return same and summary is not None, summary
