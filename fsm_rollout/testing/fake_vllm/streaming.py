"""Internal: a scripted answer streamed as vLLM streams a generate (``"stream": true``): one chunk per token, the
last with the finish reason and the weight-version spans (:mod:`fsm_rollout.engine.token_stream`). A held turn with
``held_after`` sends its first tokens before it waits, so a test sees them arrive while the rest is held."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from fsm_rollout.engine.endpoints import open_event_stream, send_event
from fsm_rollout.engine.token_stream import DONE, stream_chunk, usage_chunk

__all__ = ["send_tokens", "stream_rest"]


def _parts(answer: Mapping[str, Any], start: int, end: int | None) -> tuple[list[int], list[Any] | None]:
    choice = answer["choices"][0]
    token_ids = list(choice.get("token_ids") or [])[start:end]
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    return token_ids, None if content is None else list(content)[start:end]


async def send_tokens(
    http: web.Request, response: web.StreamResponse | None, request_id: str, answer: Mapping[str, Any], end: int
) -> web.StreamResponse:
    """Open the stream (unless ``response`` is open) and send the answer's first ``end`` tokens, one per chunk."""
    if response is None:
        response = await open_event_stream(http)
    token_ids, content = _parts(answer, 0, end)
    for index, token_id in enumerate(token_ids):
        await send_event(response, stream_chunk(request_id, [token_id], None if content is None else [content[index]]))
    return response


async def stream_rest(
    http: web.Request,
    response: web.StreamResponse | None,
    request_id: str,
    answer: Mapping[str, Any],
    *,
    start: int = 0,
    include_usage: bool = False,
) -> web.StreamResponse:
    """Send the answer's tokens from ``start`` on, one per chunk, the last chunk carrying its finish (an answer
    without tokens left: one terminal chunk without tokens, as vLLM ends an abort), the usage chunk when asked,
    then ``[DONE]``."""
    choice = answer["choices"][0]
    token_ids, content = _parts(answer, start, None)
    response = await send_tokens(
        http,
        response,
        request_id,
        {
            "choices": [
                {**choice, "token_ids": token_ids, "logprobs": None if content is None else {"content": content}}
            ]
        },
        max(len(token_ids) - 1, 0),
    )
    last = token_ids[-1:]
    await send_event(
        response,
        stream_chunk(
            request_id,
            last,
            None if content is None else content[-1:],
            finish=choice["finish_reason"],
            stop_reason=choice.get("stop_reason"),
            weight_versions=choice.get("weight_versions"),
        ),
    )
    if include_usage:
        usage = answer.get("usage") or {}
        await send_event(
            response, usage_chunk(request_id, int(usage.get("prompt_tokens", 0)), len(choice["token_ids"]))
        )
    await send_event(response, DONE)
    await response.write_eof()
    return response
