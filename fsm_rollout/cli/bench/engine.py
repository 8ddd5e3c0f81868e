"""The decoding part of the ``engine`` workload (``--only engine``): the embedded engine decoding one request at a
time against continuous batching, side by side in one process (:mod:`.demo` is the other part).

Both engines serve the default model (the demo's) with the engine's defaults, one after the other, alternating
(``repeats`` times each, the batched one first in odd rounds); each run sends the same ``requests`` generate
requests, ``concurrency`` at a time, over HTTP, with the demo's sampling (temperature 1, top_p 1, its tool-call stop
string, a fixed seed per request). Figures: each side's tokens per second and wall (the median run), their ratio,
the machine's load average before and after, and the determinism check: greedy requests run concurrently on the
batched engine against each alone on the one-at-a-time engine (identical tokens: 1, else 0; and the largest logprob
gap).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

PROMPTS = (
    "Find x in the triangle with angles 50 and 60 degrees.",
    "A rectangle is 7 by 3. What is its area?",
    "Find the hypotenuse of a right triangle with legs 6 and 8.",
    "What is the measure of each angle of a regular hexagon?",
)
SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256, "stop": ["</tool_call>"]}
RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"


async def _render(session: Any, url: str, text: str) -> list[int]:
    async with session.post(url + RENDER, json={"messages": [{"role": "user", "content": text}]}) as response:
        response.raise_for_status()
        ids: list[int] = (await response.json())["token_ids"]
    return ids


async def _generate(session: Any, url: str, prompt: list[int], request_id: str, sampling: dict[str, Any]) -> Any:
    body = {"token_ids": prompt, "sampling_params": {"logprobs": 1, **sampling}, "request_id": request_id}
    async with session.post(url + GENERATE, json=body) as response:
        response.raise_for_status()
        return (await response.json())["choices"][0]


async def _load(url: str, requests: int, concurrency: int) -> tuple[float, int]:
    """Wall seconds and output tokens of ``requests`` demo-like generate calls, ``concurrency`` at a time."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        prompts = [await _render(session, url, text) for text in PROMPTS]
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> int:
            async with gate:
                sampling = {**SAMPLING, "seed": index}
                choice = await _generate(session, url, prompts[index % len(prompts)], f"bench-{index}", sampling)
                return len(choice["token_ids"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(index) for index in range(requests)))
        return time.perf_counter() - started, sum(tokens)


async def _greedy(url: str, *, together: bool) -> list[tuple[list[int], list[float]]]:
    """Greedy answers to every prompt (twice over, 64 tokens, EOS ignored): all at once, or one by one."""
    import aiohttp

    sampling = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        prompts = [await _render(session, url, text) for text in PROMPTS * 2]
        if together:
            calls = [_generate(session, url, prompt, f"greedy-{i}", sampling) for i, prompt in enumerate(prompts)]
            choices = await asyncio.gather(*calls)
        else:
            choices = [
                await _generate(session, url, prompt, f"greedy-{i}", sampling) for i, prompt in enumerate(prompts)
            ]
    return [(choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]) for choice in choices]


async def _bench(requests: int, concurrency: int, repeats: int) -> dict[str, float]:
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import default_model_dir

    model_dir = await asyncio.to_thread(default_model_dir)
    runs: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    load_before = os.getloadavg()[0]
    for round_index in range(repeats):
        for batched in (True, False) if round_index % 2 == 0 else (False, True):
            async with LocalEngine(model_dir, batched=batched) as engine:
                runs[batched].append(await _load(engine.url, requests, concurrency))
    async with LocalEngine(model_dir) as engine:
        together = await _greedy(engine.url, together=True)
    async with LocalEngine(model_dir, batched=False) as engine:
        alone = await _greedy(engine.url, together=False)
    load_after = os.getloadavg()[0]

    figures: dict[str, float] = {}
    for batched, name in ((False, "one_at_a_time"), (True, "batched")):
        rates = [tokens / wall for wall, tokens in runs[batched]]
        median = statistics.median_low(rates)
        wall, tokens = runs[batched][rates.index(median)]
        figures[f"{name}_tok_s"] = median
        figures[f"{name}_wall_s"] = wall
        figures[f"{name}_tokens"] = float(tokens)
    figures["batched_over_one_at_a_time_tok_s"] = figures["batched_tok_s"] / figures["one_at_a_time_tok_s"]
    figures["greedy_identical"] = float([ids for ids, _ in together] == [ids for ids, _ in alone])
    figures["greedy_max_logprob_gap"] = max(
        abs(mine - theirs)
        for (_, values), (_, reference) in zip(together, alone, strict=True)
        for mine, theirs in zip(values, reference, strict=False)
    )
    figures["load_average_before"] = load_before
    figures["load_average_after"] = load_after
    return figures


def bench_engine(quick: bool) -> dict[str, float]:
    """The workload's figures (``quick``: 16 requests and one run each, else 64 requests and two runs each)."""
    return asyncio.run(_bench(16 if quick else 64, concurrency=16, repeats=1 if quick else 2))
