"""Internal: the Responses API stream of an answer sent as it is generated, in the grammar of
:func:`~fsm_rollout.gateway.responses_events.stream_events` (an
:class:`~fsm_rollout.gateway.live_stream.EventWriter`).

``response.created`` and ``response.in_progress`` open the stream; the reasoning item (its summary text) and the
message item (its output text) are added when their first text comes and grow by deltas; the reasoning item is done
when the message starts. The finished answer completes the open item, adds the rest (function calls) whole, and
ends with ``response.completed`` (``response.incomplete``). The items' ids are those of the finished response's
items (they depend only on the response id and the item's place). With nothing sent before the answer, the events
are exactly :func:`stream_events`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fsm_rollout.gateway.openai_wire import GatewayError, TurnAnswer
from fsm_rollout.gateway.responses_events import STARTED, item_events, sse_bytes
from fsm_rollout.gateway.responses_wire import ResponsesRequest, output_items, response_object

__all__ = ["ResponseEvents"]


def _provisional(reasoning: str | None, content: str | None, prompt_tokens: int = 0) -> TurnAnswer:
    """An answer with only the text streamed so far: what the items being streamed look like."""
    return TurnAnswer(
        content=content,
        tool_calls=[],
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        token_ids=[],
        logprobs=[],
        text="",
        reasoning=reasoning,
    )


class ResponseEvents:
    """One streamed Responses answer's events, as SSE bytes (see the module docstring). ``on_body`` gets the
    finished ``response`` object (e.g. to store it) before the last events go out."""

    def __init__(
        self,
        request: ResponsesRequest,
        *,
        response_id: str,
        model: str,
        on_body: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.request = request
        self.response_id = response_id
        self.model = model
        self.on_body = on_body
        self.created_at = int(time.time())
        self._events: list[dict[str, Any]] = []
        self._count = 0
        self._open: tuple[int, str, dict[str, Any]] | None = None  # index, kind, item as added
        self._done: set[int] = set()
        self._streamed: dict[int, str] = {}  # index -> the text sent
        self._reasoning = ""

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append({"type": kind, "sequence_number": self._count, **fields})
        self._count += 1

    def _flush(self) -> bytes:
        events, self._events = self._events, []
        return sse_bytes(events)

    def _body(self, answer: TurnAnswer) -> dict[str, Any]:
        return response_object(
            answer, self.request, response_id=self.response_id, model=self.model, created_at=self.created_at
        )

    def start(self, prompt_tokens: int) -> bytes:
        body = self._body(_provisional(None, None, prompt_tokens))
        started = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
        self._emit("response.created", response=started)
        self._emit("response.in_progress", response=started)
        return self._flush()

    def _items(self, reasoning: str | None, content: str | None) -> list[dict[str, Any]]:
        return output_items(
            _provisional(reasoning, content), response_id=self.response_id, encrypted=self.request.encrypted_reasoning
        )

    def _add(self, index: int, kind: str, item: dict[str, Any]) -> None:
        # the encrypted reasoning is the whole reasoning's: the item's done event carries it
        added = {key: value for key, value in {**item, **STARTED.get(kind, {})}.items() if key != "encrypted_content"}
        self._emit("response.output_item.added", output_index=index, item=added)
        where = {"item_id": item["id"], "output_index": index}
        if kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            self._emit("response.reasoning_summary_part.added", **where, summary_index=0, part=part)
        else:
            part = {**item["content"][0], "text": ""}
            self._emit("response.content_part.added", **where, content_index=0, part=part)
        self._open = (index, kind, item)
        self._streamed[index] = ""

    def _text(self, text: str) -> None:
        assert self._open is not None
        index, kind, item = self._open
        where = {"item_id": item["id"], "output_index": index}
        if kind == "reasoning":
            self._emit("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text)
        else:
            self._emit("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
        self._streamed[index] += text

    def _complete(self, item: dict[str, Any]) -> None:
        """End the open item as ``item`` (its final form)."""
        assert self._open is not None
        index, kind, _ = self._open
        where = {"item_id": item["id"], "output_index": index}
        if kind == "reasoning":
            part = item["summary"][0] if item["summary"] else {"type": "summary_text", "text": ""}
            self._emit("response.reasoning_summary_text.done", **where, summary_index=0, text=part["text"])
            self._emit("response.reasoning_summary_part.done", **where, summary_index=0, part=dict(part))
        else:
            part = item["content"][0]
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        self._emit("response.output_item.done", output_index=index, item=item)
        self._done.add(index)
        self._open = None

    def delta(self, kind: str, text: str) -> bytes:
        if kind == "reasoning":
            self._reasoning += text
            if self._open is None:
                self._add(0, "reasoning", self._items(self._reasoning, None)[0])
        elif self._open is None or self._open[1] != "message":
            items = self._items(self._reasoning or None, text)
            if self._open is not None:  # the reasoning is whole once the message starts
                self._complete(items[0])
            self._add(len(items) - 1, "message", items[-1])
        self._text(text)
        return self._flush()

    def finish(self, answer: TurnAnswer, *, reasoning_sent: str, content_sent: str) -> bytes:
        body = self._body(answer)
        if self.on_body is not None:
            self.on_body(body)
        for index, item in enumerate(body["output"]):
            if index in self._done:
                continue
            if index not in self._streamed:
                if self._open is not None:  # the open item ends before the next begins
                    self._complete(body["output"][self._open[0]])
                item_events(self._emit, index, item)
                continue
            kind = item["type"]
            text = (item["summary"][0]["text"] if item["summary"] else "") if kind == "reasoning" else ""
            if kind == "message":
                text = item["content"][0]["text"]
            sent = self._streamed[index]
            if text.startswith(sent) and len(text) > len(sent):
                self._text(text[len(sent) :])
            self._complete(item)
        final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        self._emit(final, response=body)
        return self._flush()

    def error(self, error: GatewayError) -> bytes:
        self._emit("error", code=error.code, message=error.message, param=None)
        return self._flush()
