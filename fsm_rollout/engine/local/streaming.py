"""Internal: the embedded engine's streamed generate answer (vLLM's chunk format,
:mod:`fsm_rollout.engine.token_stream`): each decode step's token goes out as it is sampled; the last chunk holds
the finish reason and the output's weight-version spans."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from fsm_rollout.engine.endpoints import open_event_stream, send_event
from fsm_rollout.engine.schema import LogprobEntry, error_body
from fsm_rollout.engine.token_stream import DONE, stream_chunk, usage_chunk

if TYPE_CHECKING:
    from fsm_rollout.engine.local.model import TokenLogprob
    from fsm_rollout.engine.local.scheduler import GenerateJob, GenerationOutcome

__all__ = ["TokenFeed", "serve_stream"]


class TokenFeed:
    """The tokens a job sampled and no chunk has carried yet (filled on the event loop by the job's ``on_token``)."""

    def __init__(self) -> None:
        self._items: list[tuple[int, TokenLogprob]] = []
        self.arrived = asyncio.Event()

    def push(self, token_id: int, logprob: TokenLogprob) -> None:
        self._items.append((token_id, logprob))
        self.arrived.set()

    def take(self) -> list[tuple[int, TokenLogprob]]:
        items, self._items = self._items, []
        self.arrived.clear()
        return items


async def serve_stream(
    http: web.Request,
    job: GenerateJob,
    feed: TokenFeed,
    *,
    prompt_len: int,
    include_usage: bool,
    entry: Callable[[TokenLogprob], LogprobEntry] | None,
) -> web.StreamResponse:
    """Stream ``job``'s tokens as they come (what arrived since the last chunk goes out in one), then its outcome.
    The job's tokens all reach the feed before its outcome does (both are scheduled on the loop in order)."""
    response = await open_event_stream(http)
    request_id = job.request_id

    def chunk(items: list[tuple[int, TokenLogprob]], outcome: GenerationOutcome | None = None) -> dict[str, Any]:
        logprobs = None if entry is None else [entry(logprob) for _, logprob in items]
        token_ids = [token for token, _ in items]
        if outcome is None:
            return stream_chunk(request_id, token_ids, logprobs)
        return stream_chunk(
            request_id,
            token_ids,
            logprobs,
            finish=outcome.finish_reason,
            stop_reason=outcome.stop_reason,
            weight_versions=outcome.weight_versions,
        )

    while not job.future.done():
        waiter: asyncio.Future[Any] = asyncio.ensure_future(feed.arrived.wait())
        pending: set[asyncio.Future[Any]] = {waiter, job.future}
        try:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if job.future.done():
            break
        items = feed.take()
        if items:
            await send_event(response, chunk(items))
    try:
        outcome = job.future.result()
    except Exception as error:  # a model failure mid-stream: vLLM's error body as an event, then the end
        await send_event(response, error_body(500, f"{type(error).__name__}: {error}"))
    else:
        await send_event(response, chunk(feed.take(), outcome))
        if include_usage:
            await send_event(response, usage_chunk(request_id, prompt_len, len(outcome.token_ids)))
    await send_event(response, DONE)
    await response.write_eof()
    return response
