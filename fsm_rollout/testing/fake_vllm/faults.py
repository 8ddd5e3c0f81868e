"""Fault injection for the fake vLLM server: HTTP errors, malformed JSON and dropped connections."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from fsm_rollout.engine.endpoints import error_response
from fsm_rollout.engine.schema import server_request_id

# A 200 answer cut off in the middle of the token ids: valid JSON up to there, so only the end is wrong.
_MALFORMED_JSON_BODY = b'{"request_id": "%s", "choices": [{"index": 0, "token_ids": [1, 2' % (
    server_request_id("trunc").encode()
)


@dataclass(frozen=True)
class Fault:
    """One injected fault: an HTTP error ``status``, a malformed 200, or a reset connection, after ``delay``."""

    status: int
    malformed_json: bool
    reset: bool
    delay: float


def make_fault(*, status: int | None, malformed_json: bool, reset: bool, delay: float, times: int) -> Fault:
    """The fault ``FakeVLLMServer.fail_next`` queues ``times`` times; its arguments are checked here."""
    if sum((status is not None, malformed_json, reset)) > 1:
        raise ValueError("fail_next takes one of status=, malformed_json=, reset=")
    if times < 1:
        raise ValueError(f"fail_next times must be >= 1, got {times}")
    if status is not None and not 400 <= status <= 599:
        raise ValueError(f"fail_next status must be an HTTP error status, got {status}")
    return Fault(status=500 if status is None else status, malformed_json=malformed_json, reset=reset, delay=delay)


async def answer_fault(request: web.Request, fault: Fault) -> web.StreamResponse:
    """Answer ``request`` with ``fault`` instead of handling it."""
    if fault.delay > 0:
        await asyncio.sleep(fault.delay)
    if fault.reset:
        transport = request.transport
        if transport is not None:
            transport.abort()
        return web.Response(status=500)  # never sent: the connection is gone
    if fault.malformed_json:
        return web.Response(status=200, body=_MALFORMED_JSON_BODY, content_type="application/json")
    return error_response(fault.status, f"fake vLLM: injected fault ({fault.status})")
