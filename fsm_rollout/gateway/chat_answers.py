"""The Chat Completions answer on the wire: the ``chat.completion`` object and the ``chat.completion.chunk`` objects
that stream it, built from a :class:`~fsm_rollout.gateway.openai_wire.TurnAnswer` (the request side is
:mod:`fsm_rollout.gateway.openai_wire`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from fsm_rollout.gateway.openai_wire import GatewayError, TurnAnswer

__all__ = ["ChatChunks", "ChatEvents", "chat_completion", "stream_chunks"]


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


class ChatChunks:
    """The ``chat.completion.chunk`` objects of one streamed answer, in order: :meth:`start` (the role),
    :meth:`delta` for each piece of reasoning or content sent as it is generated, then :meth:`finish` (what was
    held back, the tool calls, the finish reason and, with ``include_usage``, a last chunk with no choices and the
    usage). The logprobs ride on the first chunk of :meth:`finish` that carries the answer: the rest of the content,
    else the tool calls, else an empty content delta."""

    def __init__(
        self,
        *,
        completion_id: str,
        model: str,
        include_usage: bool,
        want_logprobs: bool = False,
        decode: Any = None,
    ) -> None:
        self.completion_id = completion_id
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs and decode is not None
        self.decode = decode
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        if self.include_usage:
            item["usage"] = None
        return item

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        return [self._chunk({"reasoning_content" if kind == "reasoning" else "content": text})]

    def finish(self, answer: TurnAnswer, *, reasoning_sent: str = "", content_sent: str = "") -> list[dict[str, Any]]:
        chunks = []
        reasoning = answer.reasoning or ""
        if reasoning.startswith(reasoning_sent) and len(reasoning) > len(reasoning_sent):
            chunks.append(self._chunk({"reasoning_content": reasoning[len(reasoning_sent) :]}))
        logprobs = _logprobs(answer, self.decode) if self.want_logprobs else None
        content = answer.content or ""
        if content.startswith(content_sent) and len(content) > len(content_sent):
            chunks.append(self._chunk({"content": content[len(content_sent) :]}, logprobs=logprobs))
            logprobs = None
        if answer.tool_calls:
            chunks.append(
                self._chunk({"tool_calls": _wire_calls(answer.tool_calls, with_index=True)}, logprobs=logprobs)
            )
            logprobs = None
        if logprobs is not None and content_sent:  # the content went out as it came: the logprobs need a chunk
            chunks.append(self._chunk({"content": ""}, logprobs=logprobs))
        chunks.append(self._chunk({}, answer.finish_reason))
        if self.include_usage:
            chunks.append(
                {
                    "id": self.completion_id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": _usage(answer),
                }
            )
        return chunks


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks)


class ChatEvents:
    """:class:`ChatChunks` as Server-Sent Events (an :class:`~fsm_rollout.gateway.live_stream.EventWriter`); the
    stream ends with ``data: [DONE]``, after an error too (OpenAI's error body as an event)."""

    def __init__(self, chunks: ChatChunks) -> None:
        self.chunks = chunks

    def start(self, prompt_tokens: int) -> bytes:
        return _sse(self.chunks.start())

    def delta(self, kind: str, text: str) -> bytes:
        return _sse(self.chunks.delta(kind, text))

    def finish(self, answer: TurnAnswer, *, reasoning_sent: str, content_sent: str) -> bytes:
        return _sse(self.chunks.finish(answer, reasoning_sent=reasoning_sent, content_sent=content_sent)) + _DONE

    def error(self, error: GatewayError) -> bytes:
        return _sse([error.body()]) + _DONE


_DONE = b"data: [DONE]\n\n"


def stream_chunks(
    answer: TurnAnswer,
    *,
    completion_id: str,
    model: str,
    include_usage: bool,
    want_logprobs: bool = False,
    decode: Any = None,
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream a whole answer (:class:`ChatChunks` with nothing sent
    before the answer was complete)."""
    chunks = ChatChunks(
        completion_id=completion_id,
        model=model,
        include_usage=include_usage,
        want_logprobs=want_logprobs,
        decode=decode,
    )
    return [*chunks.start(), *chunks.finish(answer)]
