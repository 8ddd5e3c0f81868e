"""The Chat Completions answer on the wire: the ``chat.completion`` object and the ``chat.completion.chunk`` objects
that stream it, built from a :class:`~fsm_rollout.gateway.openai_wire.TurnAnswer` (the request side is
:mod:`fsm_rollout.gateway.openai_wire`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fsm_rollout.gateway.openai_wire import TurnAnswer

__all__ = ["chat_completion", "stream_chunks"]


def _wire_calls(calls: Sequence[Mapping[str, Any]], *, with_index: bool = False) -> list[dict[str, Any]]:
    out = []
    for index, call in enumerate(calls):
        item: dict[str, Any] = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }
        if with_index:
            item = {"index": index, **item}
        out.append(item)
    return out


def _usage(answer: TurnAnswer) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }
    if answer.reasoning is not None:  # a thinking template's turn: OpenAI's count of its thinking tokens
        usage["completion_tokens_details"] = {"reasoning_tokens": answer.reasoning_tokens}
    return usage


def _logprobs(answer: TurnAnswer, decode: Any) -> dict[str, Any]:
    """OpenAI's ``logprobs``: one entry per generated token, each with its top candidates when the call asked for
    them, in the engine's order (vLLM's: the sampled token first, then the likeliest others by rank, as vLLM's
    own chat endpoint answers)."""
    texts: dict[int, str] = {}

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = answer.top_logprobs
    content = []
    for index, (token_id, logprob) in enumerate(zip(answer.token_ids, answer.logprobs, strict=False)):
        entry = token(token_id, logprob)
        top = tops[index] if tops is not None and index < len(tops) else ()
        entry["top_logprobs"] = [token(candidate, value) for candidate, value in top]
        content.append(entry)
    return {"content": content}


def chat_completion(
    answer: TurnAnswer, *, completion_id: str, model: str, want_logprobs: bool = False, decode: Any = None
) -> dict[str, Any]:
    """The ``chat.completion`` object for an answer."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning  # vLLM's name with a reasoning parser
    if answer.tool_calls:
        message["tool_calls"] = _wire_calls(answer.tool_calls)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": None}
    if want_logprobs and decode is not None:
        choice["logprobs"] = _logprobs(answer, decode)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(answer),
    }


def stream_chunks(
    answer: TurnAnswer,
    *,
    completion_id: str,
    model: str,
    include_usage: bool,
    want_logprobs: bool = False,
    decode: Any = None,
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream an answer: the role, the content, the tool calls, the
    finish reason and, with ``include_usage``, a last chunk with no choices and the usage."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        if include_usage:
            item["usage"] = None
        return item

    chunks = [chunk({"role": "assistant", "content": ""})]
    if answer.reasoning:
        chunks.append(chunk({"reasoning_content": answer.reasoning}))
    # the logprobs ride on the first chunk that carries the answer: the content, else the tool calls
    logprobs = _logprobs(answer, decode) if want_logprobs and decode is not None else None
    if answer.content:
        chunks.append(chunk({"content": answer.content}, logprobs=logprobs))
        logprobs = None
    if answer.tool_calls:
        chunks.append(chunk({"tool_calls": _wire_calls(answer.tool_calls, with_index=True)}, logprobs=logprobs))
    chunks.append(chunk({}, answer.finish_reason))
    if include_usage:
        chunks.append(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(answer),
            }
        )
    return chunks
