"""The gateway's streaming workload (``--only streaming``): how long after the engine samples a turn's first token
the agent reads the first SSE event of its streamed answer.

The embedded engine (the tiny random model) serves a gateway on loopback; an aiohttp client makes streamed chat
calls. The clock starts when the engine's first sampled token reaches its event loop (the engine's
:class:`~fsm_rollout.engine.local.streaming.TokenFeed`, in this process) and stops when the client has read the
first ``data:`` event: the engine's chunk, the gateway's decoding and hold-back, and both HTTP hops.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

__all__ = ["bench_streaming"]


async def _measure(calls: int) -> list[float]:
    import aiohttp

    from fsm_rollout import RolloutConfig
    from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
    from fsm_rollout.engine.local.streaming import TokenFeed
    from fsm_rollout.gateway import AgentGateway
    from fsm_rollout.runtime.runner import RolloutRunner

    firsts: list[float] = []
    seen: dict[int, TokenFeed] = {}  # the feeds held, so an id is never reused while it keys
    push = TokenFeed.push

    def timed_push(feed: TokenFeed, token_id: int, logprob: Any) -> None:
        if seen.get(id(feed)) is not feed:
            seen[id(feed)] = feed
            firsts.append(time.perf_counter())
        push(feed, token_id, logprob)

    gaps: list[float] = []
    TokenFeed.push = timed_push  # type: ignore[method-assign,assignment]  # the bench's own process, restored below
    try:
        async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
            config = RolloutConfig(
                engine_url=engine.url, model="policy", tokenizer_path=str(engine.model_dir), max_turns=4
            )
            runner = RolloutRunner(config, sampling_params={"max_new_tokens": 64, "temperature": 1.0})
            async with AgentGateway(runner) as gateway, aiohttp.ClientSession() as http:
                for call in range(calls):
                    session = await gateway.open_session()
                    body = {
                        "messages": [{"role": "user", "content": f"Say something ({call})."}],
                        "stream": True,
                        "max_tokens": 32,
                        "seed": call,
                    }
                    before = len(firsts)
                    async with http.post(f"{session.base_url}/chat/completions", json=body) as response:
                        async for line in response.content:
                            if line.startswith(b"data: ") and len(firsts) > before:
                                gaps.append((time.perf_counter() - firsts[before]) * 1000.0)
                                break
                        await response.read()
                    await session.close()
    finally:
        TokenFeed.push = push  # type: ignore[method-assign]
    return gaps


def bench_streaming(quick: bool) -> dict[str, float]:
    """The median and worst time (ms) from the engine's first token to the agent's first SSE event."""
    gaps = asyncio.run(_measure(8 if quick else 40))
    return {
        "first_event_after_first_token_ms_median": statistics.median(gaps),
        "first_event_after_first_token_ms_max": max(gaps),
        "calls": float(len(gaps)),
    }
