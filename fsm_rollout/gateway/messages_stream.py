"""Internal: the Anthropic Messages stream of an answer sent as it is generated, in the same event grammar as
:func:`~fsm_rollout.gateway.messages_wire.message_events` (an
:class:`~fsm_rollout.gateway.live_stream.EventWriter`).

``message_start`` and a ``ping`` open the stream; the thinking block (``thinking_delta`` events, closed by its
``signature_delta``) and the text block (``text_delta`` events) grow as their text comes; what was held back, the
``tool_use`` blocks, ``message_delta`` (stop reason, usage) and ``message_stop`` follow the finished answer. With
nothing sent before the answer, the events are exactly :func:`message_events`'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fsm_rollout.gateway.messages_wire import message_object, messages_error_body, sse, thinking_signature
from fsm_rollout.gateway.openai_wire import GatewayError, TurnAnswer

__all__ = ["MessageEvents"]

_Event = tuple[str, dict[str, Any]]


class MessageEvents:
    """One streamed Messages answer's events, as SSE bytes (see the module docstring)."""

    def __init__(self, *, message_id: str, model: str, stop_sequences: Sequence[str] = ()) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences
        self._index = 0
        self._open: str | None = None  # the kind of the block being written
        self._thinking = ""

    def start(self, prompt_tokens: int) -> bytes:
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return sse([("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})])

    def _block(self, kind: str, opened: dict[str, Any]) -> list[_Event]:
        events = self._close(None)
        self._open = kind
        return [
            *events,
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": opened}),
        ]

    def _delta(self, delta: dict[str, Any]) -> _Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self, reasoning: str | None) -> list[_Event]:
        """End the open block (a thinking block with the signature of ``reasoning``, else of its streamed text)."""
        if self._open is None:
            return []
        events: list[_Event] = []
        if self._open == "thinking":
            signature = thinking_signature(reasoning if reasoning is not None else self._thinking)
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._index += 1
        self._open = None
        return events

    def _pieces(self, kind: str, text: str) -> list[_Event]:
        events: list[_Event] = []
        if kind == "reasoning":
            if self._open != "thinking":
                events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking += text
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        else:
            if self._open != "text":
                events += self._block("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def delta(self, kind: str, text: str) -> bytes:
        return sse(self._pieces(kind, text))

    def finish(self, answer: TurnAnswer, *, reasoning_sent: str, content_sent: str) -> bytes:
        final = message_object(answer, message_id=self.message_id, model=self.model, stop_sequences=self.stop_sequences)
        events: list[_Event] = []
        reasoning = answer.reasoning or ""
        if reasoning.startswith(reasoning_sent) and len(reasoning) > len(reasoning_sent) and not content_sent:
            events += self._pieces("reasoning", reasoning[len(reasoning_sent) :])
        content = answer.content or ""
        if content.startswith(content_sent) and len(content) > len(content_sent):
            if self._open == "thinking":
                events += self._close(reasoning)
            events += self._pieces("content", content[len(content_sent) :])
        events += self._close(reasoning)
        for block in final["content"]:
            if block["type"] != "tool_use":
                continue
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            events += self._block("tool_use", opened)
            events.append(self._delta({"type": "input_json_delta", "partial_json": _json(block["input"])}))
            events += self._close(None)
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": final["usage"]}))
        events.append(("message_stop", {"type": "message_stop"}))
        return sse(events)

    def error(self, error: GatewayError) -> bytes:
        return sse([("error", messages_error_body(error.status, error.message))])


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # as message_events writes a tool call's input
