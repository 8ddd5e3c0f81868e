"""Internal: a streamed gateway answer sent as the engine generates it, for any dialect.

:func:`stream_answer` runs the session's call with a listener on its turn's tokens
(:class:`~fsm_rollout.gateway.stream_text.TokenFanout`), reads what of the text may be shown
(:class:`~fsm_rollout.gateway.stream_text.AnswerStream`) and sends it through the dialect's :class:`EventWriter` as
it comes; the HTTP answer starts with the first text (an error before it is an ordinary HTTP error), and the
finished answer completes the stream. A client that goes away cancels its call, which the session treats as any
disconnect (its answer waits for a retry, for the disconnect grace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from fsm_rollout.gateway.openai_wire import GatewayError, TurnAnswer, public_error
from fsm_rollout.gateway.stream_text import AnswerStream, Listener

__all__ = ["EventWriter", "stream_answer"]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EventWriter(Protocol):
    """A dialect's events, as bytes ready to write."""

    def start(self, prompt_tokens: int) -> bytes: ...

    def delta(self, kind: str, text: str) -> bytes: ...

    def finish(self, answer: TurnAnswer, *, reasoning_sent: str, content_sent: str) -> bytes: ...

    def error(self, error: GatewayError) -> bytes: ...


async def stream_answer(
    request: web.Request,
    run: Callable[[Listener], Awaitable[TurnAnswer]],
    text: AnswerStream,
    writer: EventWriter,
    *,
    on_answer: Callable[[TurnAnswer], Any] | None = None,
) -> web.StreamResponse:
    """Answer ``request`` with the events of ``run(listener)``'s answer as it is generated (module docstring).
    ``on_answer`` sees the finished answer before its last events go out (e.g. to store it)."""
    # tokens as the listener hands them over, and the one future the loop sleeps on: a task and an asyncio.wait per
    # token cost more than the rest of a token's way through the gateway
    arrived: list[tuple[list[int], bool, int]] = []
    waiter: asyncio.Future[None] | None = None

    def wake(_: Any = None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def listen(token_ids: list[int], opened_thinking: bool, prompt_tokens: int) -> None:
        arrived.append((token_ids, opened_thinking, prompt_tokens))
        wake()

    call = asyncio.ensure_future(run(listen))
    call.add_done_callback(wake)
    response: web.StreamResponse | None = None

    async def begin(prompt_tokens: int) -> web.StreamResponse:
        opened = web.StreamResponse(headers=SSE_HEADERS)
        await opened.prepare(request)
        await opened.write(writer.start(prompt_tokens))
        return opened

    try:
        # every token handed over before the call ended is streamed, whatever the order the loop ran things in
        while arrived or not call.done():
            if not arrived:
                waiter = asyncio.get_running_loop().create_future()
                await waiter
                waiter = None
                continue
            # what came since the last wake is read at once: one decode and one write however many chunks the
            # engine sent meanwhile (a client sees fewer, longer deltas when the gateway is behind)
            token_ids, opened_thinking, prompt_tokens = arrived[0]
            if len(arrived) > 1:
                token_ids = [token for handed, _, _ in arrived for token in handed]
            arrived.clear()
            pieces = text.feed(token_ids, opened=opened_thinking)
            if pieces:
                if response is None:
                    response = await begin(prompt_tokens)
                await response.write(b"".join(writer.delta(kind, piece) for kind, piece in pieces))
        try:
            answer = call.result()
        except GatewayError as error:
            if response is None:
                raise
            await response.write(writer.error(public_error(error)))
            await response.write_eof()
            return response
        if on_answer is not None:
            on_answer(answer)
        if response is None:
            response = await begin(answer.prompt_tokens)
        await response.write(writer.finish(answer, reasoning_sent=text.reasoning, content_sent=text.content))
        await response.write_eof()
        return response
    finally:
        if not call.done():  # the client went away: the session's call sees a disconnect
            call.cancel()
