"""The Responses API's stream of a ``response`` object: its events in OpenAI's grammar, numbered, as SSE bytes.

The answer arrives whole (the gateway does not stream tokens as they are generated), so each output item's text is
one delta. The events, each with its ``sequence_number``: ``response.created``, ``response.in_progress``, then per
output item ``response.output_item.added``, its parts (a reasoning item's ``response.reasoning_summary_part.*``
and ``response.reasoning_summary_text.*``; a message's ``response.content_part.*`` and
``response.output_text.*``; a function call's ``response.function_call_arguments.*``) and
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when the answer was cut).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

__all__ = ["sse_bytes", "stream_events"]

# an output item as it starts: in progress, its text still empty
_STARTED: Mapping[str, Mapping[str, Any]] = {
    "reasoning": {"summary": [], "status": "in_progress"},
    "message": {"content": [], "status": "in_progress"},
    "function_call": {"arguments": "", "status": "in_progress"},
}


def stream_events(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The events that stream ``response`` (a :func:`~fsm_rollout.gateway.responses_wire.response_object`)."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    # the lifecycle events carry the response as it starts: in progress, nothing output, no usage yet
    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        emit("response.output_item.added", output_index=index, item={**item, **_STARTED.get(kind, {})})
        if kind == "reasoning":
            for part_index, part in enumerate(item["summary"]):
                at = {**where, "summary_index": part_index}
                emit("response.reasoning_summary_part.added", **at, part={"type": "summary_text", "text": ""})
                emit("response.reasoning_summary_text.delta", **at, delta=part["text"])
                emit("response.reasoning_summary_text.done", **at, text=part["text"])
                emit("response.reasoning_summary_part.done", **at, part=dict(part))
        elif kind == "message":
            for part_index, part in enumerate(item["content"]):
                at = {**where, "content_index": part_index}
                emit("response.content_part.added", **at, part={**part, "text": ""})
                emit("response.output_text.delta", **at, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **at, text=part["text"], logprobs=[])
                emit("response.content_part.done", **at, part=copy.copy(part))
        elif kind == "function_call":
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    emit(final, response=response)
    return events


def sse_bytes(events: Iterable[Mapping[str, Any]]) -> bytes:
    """The events as server-sent events: ``event: TYPE`` and ``data: JSON`` lines, a blank line after each."""
    return b"".join(
        b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n" for event in events
    )
