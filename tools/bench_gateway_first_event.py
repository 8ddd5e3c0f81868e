"""The gateway's ``first_event`` figure (:mod:`tools.bench_gateway`): the time from the engine's first token to the
agent's first text event, in each dialect, streamed.

Each call's engine (the fake vLLM server, in this process so both ends read one clock) sends the answer's first
token and then holds the request (``ScriptedTurn(hang=True, held_after=1)``). The engine's time is taken when the
server reports the request held, which is after that token was written and before the gateway can have read it;
the agent's time when the first event carrying answer text arrives. The held request is then released and the
call read to its end. Medians and maxima over ``repeats`` calls per dialect, after one call each to warm up.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson

TEXT = "Hello there, this answer streams one token at a time.<|im_end|>"
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    "responses": ("responses", {"input": "Hi", "stream": True}),
    "messages": ("messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 256, "stream": True}),
}


def _text(event: Any) -> str:
    """The answer text one event of any of the three dialects carries."""
    if not isinstance(event, dict):
        return ""
    if event.get("choices"):
        return str(event["choices"][0].get("delta", {}).get("content") or "")
    if event.get("type") == "response.output_text.delta":
        return str(event.get("delta") or "")
    delta = event.get("delta") if event.get("type") == "content_block_delta" else None
    return str(delta.get("text") or "") if isinstance(delta, dict) else ""


async def _call(server: Any, gateway: Any, http: Any, path: str, body: dict[str, Any]) -> float:
    """One streamed call; the seconds from the engine holding its request after the first token to the first text."""
    from fsm_rollout.testing.fake_vllm import ScriptedTurn

    session = await gateway.open_session()
    server.script([ScriptedTurn(text=TEXT, hang=True, held_after=1)], session=session.session_id)
    engine_at: list[float] = []
    held = asyncio.ensure_future(server.wait_until_waiting(1))
    held.add_done_callback(lambda _: engine_at.append(time.perf_counter()))
    first: float | None = None
    async with http.post(f"{session.base_url}/{path}", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"bench: {path} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data: ") and _text(orjson.loads(line[6:])):
                first = time.perf_counter()
                await held
                (request_id,) = server.held_request_ids
                server.release(request_id)
    await session.close()
    if first is None or not engine_at:
        raise RuntimeError(f"bench: {path}: no answer text was streamed")
    return first - engine_at[0]


async def bench_first_event(tokenizer: Any, repeats: int, gateway_for: Any) -> dict[str, float]:
    """``first_event``'s figures (module docstring); ``gateway_for(url, tokenizer)`` builds the gateway."""
    import aiohttp

    from fsm_rollout.testing.fake_vllm import FakeVLLMServer

    figures: dict[str, float] = {}
    async with (
        FakeVLLMServer(tokenizer, model="fake-model") as server,
        gateway_for(server.url, tokenizer) as gateway,
        aiohttp.ClientSession() as http,
    ):
        for dialect, (path, body) in CALLS.items():
            await _call(server, gateway, http, path, body)  # warm up
            lags = [await _call(server, gateway, http, path, body) * 1e3 for _ in range(repeats)]
            figures[f"{dialect}_first_event_ms_median"] = statistics.median(lags)
            figures[f"{dialect}_first_event_ms_max"] = max(lags)
    return figures
