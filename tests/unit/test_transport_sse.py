"""AiohttpTransport.post_sse reads Server-Sent Events however the bytes are cut into reads."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from fsm_rollout.engine.transport import AiohttpTransport

# A comment, blank separators, CRLF line ends, a non-JSON payload and a last line without its newline.
STREAM = b': hello\n\ndata: {"a": 1}\n\ndata:{"b": [2, 3]}\r\n\r\ndata: [DONE]\n\ndata: {"c": "x\\u00e9"}'
EXPECTED: list[Any] = [{"a": 1}, {"b": [2, 3]}, "[DONE]", {"c": "x\u00e9"}]


async def _serve(pieces: list[bytes]) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0)  # let each piece go out on its own where the loop allows
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def _read(pieces: list[bytes]) -> list[Any]:
    runner, url = await _serve(pieces)
    transport = AiohttpTransport(url)
    try:
        return [data async for data in transport.post_sse("/stream", {"x": 1})]
    finally:
        await transport.close()
        await runner.cleanup()


async def test_events_whole_and_cut_anywhere_read_the_same() -> None:
    assert await _read([STREAM]) == EXPECTED
    assert await _read([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED  # a byte per write
    for cut in (3, 10, 19, 20, 31, 40):  # inside a line, at its newline, between CR and LF
        assert await _read([STREAM[:cut], STREAM[cut:]]) == EXPECTED
