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
    arrived: asyncio.Queue[tuple[list[int], bool, int]] = asyncio.Queue()
    call = asyncio.ensure_future(run(lambda *tokens: arrived.put_nowait(tokens)))
    response: web.StreamResponse | None = None

    async def begin(prompt_tokens: int) -> web.StreamResponse:
        opened = web.StreamResponse(headers=SSE_HEADERS)
        await opened.prepare(request)
        await opened.write(writer.start(prompt_tokens))
        return opened

    try:
        while not call.done():
            getter = asyncio.ensure_future(arrived.get())
            try:
                await asyncio.wait({getter, call}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                getter.cancel()
            if not getter.done() or getter.cancelled():
                continue
            token_ids, opened_thinking, prompt_tokens = getter.result()
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
