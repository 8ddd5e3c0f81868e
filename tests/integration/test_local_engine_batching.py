"""The embedded engine's continuous batching: one forward pass per decode step, and tokens that do not depend on it.

Requests are made concurrent without timing: they are submitted while the engine is paused (``keep``, nothing in
flight), so they are all held, and the resume admits them together, first come first served up to ``max_num_seqs``;
later ones join as earlier ones finish. The references run each request alone: on the same batched engine (bit for
bit the same tokens and logprobs), and on the one-at-a-time engine (``batched=False``), whose single-row matrix
products may sum in another order (greedy tokens equal, logprobs within 1e-5).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch
from engine_http import generate, logprob_values

from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.batch import ROW_MULTIPLE, DecodeBatch
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.engine.local.model import Generation, load_model
from fsm_rollout.engine.local.scheduler import GenerateJob, Scheduler
from fsm_rollout.engine.local.tiny import tiny_model_dir
from fsm_rollout.engine.serving import SamplingSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 512
BOUND = 1e-5  # logprobs against the one-at-a-time engine


def mixed_requests(count: int, seed: int) -> list[tuple[list[int], dict[str, Any]]]:
    """Prompts of 2 to 60 ids and lengths of 3 to 30 tokens, half greedy, the others sampled with assorted filters."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        prompt = [rng.randrange(0, 20_000) for _ in range(rng.randint(2, 60))]
        sampling: dict[str, Any] = {"max_tokens": rng.randint(3, 30), "seed": 1000 + index}
        if index % 2 == 0:
            sampling["temperature"] = 0.0
        else:
            sampling.update(rng.choice([{}, {"top_p": 0.9}, {"top_k": 50}, {"temperature": 0.7, "min_p": 0.01}]))
        requests.append((prompt, sampling))
    return requests


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def together(
    engine: LocalEngine, http: aiohttp.ClientSession, requests: list[tuple[list[int], dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run ``requests`` concurrently: submitted while paused, released at once by the resume."""
    await engine.pause("keep")
    try:
        tasks = [
            asyncio.create_task(generate(http, engine, prompt, request_id=f"r{index}", **sampling))
            for index, (prompt, sampling) in enumerate(requests)
        ]
        for _ in range(6000):  # until every request has reached the engine (a minute at most)
            if len(engine.live_request_ids()) == len(requests):
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.resume()
    return list(await asyncio.gather(*tasks))


async def alone(
    engine: LocalEngine, http: aiohttp.ClientSession, requests: list[tuple[list[int], dict[str, Any]]]
) -> list[dict[str, Any]]:
    return [await generate(http, engine, prompt, request_id=f"a{i}", **s) for i, (prompt, s) in enumerate(requests)]


@pytest.mark.parametrize("model", ["tiny-random", "default"])
async def test_concurrent_mixed_requests_give_the_tokens_and_logprobs_they_give_alone(
    http: aiohttp.ClientSession, model: str
) -> None:
    model_dir = tiny_model_dir() if model == "tiny-random" else default_model_dir()
    requests = mixed_requests(14, seed=34)
    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "torch_threads": 1}
    async with LocalEngine(model_dir, max_num_seqs=6, **common) as batched:
        concurrent = await together(batched, http, requests)
        single = await alone(batched, http, requests)
    async with LocalEngine(model_dir, batched=False, **common) as one_at_a_time:
        reference = await alone(one_at_a_time, http, requests)

    assert [choice["token_ids"] for choice in concurrent] == [choice["token_ids"] for choice in single]
    assert [logprob_values(choice) for choice in concurrent] == [logprob_values(choice) for choice in single]
    assert [len(choice["token_ids"]) for choice in concurrent] == [sampling["max_tokens"] for _, sampling in requests]

    assert [choice["token_ids"] for choice in concurrent] == [choice["token_ids"] for choice in reference]
    gaps = [
        abs(mine - theirs)
        for choice, ref in zip(concurrent, reference, strict=True)
        for mine, theirs in zip(logprob_values(choice), logprob_values(ref), strict=True)
    ]
    assert max(gaps) <= BOUND


def settings(max_tokens: int, seed: int) -> SamplingSettings:
    return SamplingSettings(max_tokens=max_tokens, seed=seed, ignore_eos=True)


async def test_one_batch_step_advances_every_request_with_one_forward_pass() -> None:
    loaded = load_model(tiny_model_dir(), max_model_len=MAX_MODEL_LEN)
    passes: list[int] = []
    hook = loaded.model.base_model.register_forward_hook(lambda module, args, output: passes.append(1))
    try:
        with torch.inference_mode():
            batch = DecodeBatch(loaded)
            generations = [Generation(loaded, list(range(5, 5 + length)), settings(10, length)) for length in (3, 9, 5)]
            for generation in generations:
                assert generation.step() is None  # the prefill, alone
                batch.add(generation)
            assert len(passes) == 3
            assert batch.step() == [None, None, None]
    finally:
        hook.remove()
    assert len(passes) == 4
    assert [len(generation.token_ids) for generation in generations] == [2, 2, 2]
    assert ROW_MULTIPLE > 1  # three rows ran padded to a multiple of it


async def test_the_scheduler_runs_one_forward_pass_per_step_for_all_running_requests() -> None:
    loaded = load_model(tiny_model_dir(), max_model_len=MAX_MODEL_LEN)
    passes: list[int] = []
    hook = loaded.model.base_model.register_forward_hook(lambda module, args, output: passes.append(1))
    scheduler = Scheduler(loaded, max_num_seqs=8, torch_threads=1)
    scheduler.start()
    try:
        loop = asyncio.get_running_loop()
        await scheduler.pause("keep")  # the jobs below are held, then admitted together by the resume
        lengths = [4, 7, 2, 7, 5, 3]
        jobs = [GenerateJob(f"j{i}", [11, 12, 13 + i], settings(n, i), loop) for i, n in enumerate(lengths)]
        for job in jobs:
            scheduler.submit(job)
        await scheduler.resume()
        outcomes = [await job.future for job in jobs]
    finally:
        scheduler.stop()
        hook.remove()
    assert [len(outcome.token_ids) for outcome in outcomes] == lengths
    # Six prefills, then one pass per step while any request runs (the longest needs six more tokens).
    assert len(passes) == len(lengths) + max(lengths) - 1


async def test_a_request_admitted_mid_run_joins_the_batch_and_gives_the_tokens_it_gives_alone() -> None:
    loaded = load_model(tiny_model_dir(), max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(loaded, max_num_seqs=2, torch_threads=1)
    scheduler.start()
    try:
        loop = asyncio.get_running_loop()
        await scheduler.pause("keep")
        jobs = [GenerateJob(f"j{i}", [21, 22, 23 + i], settings(n, i), loop) for i, n in enumerate([3, 9, 4])]
        for job in jobs:
            scheduler.submit(job)
        await scheduler.resume()
        outcomes = [await job.future for job in jobs]
        alone = []
        for i, n in enumerate([3, 9, 4]):
            job = GenerateJob(f"b{i}", [21, 22, 23 + i], settings(n, i), loop)
            scheduler.submit(job)
            alone.append(await job.future)
    finally:
        scheduler.stop()
    assert [outcome.token_ids for outcome in outcomes] == [outcome.token_ids for outcome in alone]
    assert [outcome.logprobs for outcome in outcomes] == [outcome.logprobs for outcome in alone]


async def test_the_default_engine_decodes_the_demo_s_samples_together() -> None:
    from fsm_rollout.cli import run, serve

    parsers = {module: argparse.ArgumentParser() for module in (run, serve)}
    for module, parser in parsers.items():
        module.add_arguments(parser)
    concurrency = parsers[run].parse_args([]).concurrency
    assert inspect.signature(LocalEngine).parameters["max_num_seqs"].default == concurrency
    assert inspect.signature(Scheduler).parameters["max_num_seqs"].default == concurrency
    assert parsers[serve].parse_args([]).max_num_seqs == concurrency


def run_alone(loaded: Any, prompt: list[int], sampling: SamplingSettings) -> Generation:
    """``prompt`` decoded alone: its prefill, then a batch of its own until it finishes."""
    generation = Generation(loaded, prompt, sampling)
    if generation.step() is None:
        batch = DecodeBatch(loaded)
        batch.add(generation)
        while batch.step() != ["length"]:
            pass
    return generation


@pytest.mark.parametrize("model", ["tiny-random", "default"])
async def test_requests_joining_and_leaving_a_long_running_batch_decode_as_they_do_alone(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows freed by finished requests are taken by joining ones whose caches fit, the others make the batch rebuild,
    and so does running out of spare columns; none of it changes a request's tokens or logprobs."""
    from fsm_rollout.engine.local import batch as batch_module

    loaded = load_model(
        tiny_model_dir() if model == "tiny-random" else default_model_dir(), max_model_len=MAX_MODEL_LEN
    )
    calls = {"place": 0, "rebuild": 0}

    def counted(name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(batch_module._GrowingLayer, "place", counted("place", batch_module._GrowingLayer.place))
    monkeypatch.setattr(DecodeBatch, "_rebuild", counted("rebuild", DecodeBatch._rebuild))
    rng = random.Random(7)
    # (step it joins at, prompt, settings): short prompts fit freed rows, long ones do not; a long-lived request
    # keeps the batch going past its spare columns
    plan = [
        (0, [rng.randrange(0, 20_000) for _ in range(40)], SamplingSettings(max_tokens=200, seed=1, ignore_eos=True))
    ]
    for index in range(1, 24):
        length = rng.choice([3, 8, 20, 120])
        sampling: dict[str, Any] = {"max_tokens": rng.randint(4, 40), "seed": 100 + index, "ignore_eos": True}
        if index % 3 == 0:
            sampling["temperature"] = 0.0
        plan.append(
            (rng.randrange(0, 150), [rng.randrange(0, 20_000) for _ in range(length)], SamplingSettings(**sampling))
        )
    plan.sort(key=lambda entry: entry[0])
    with torch.inference_mode():
        batch = DecodeBatch(loaded)
        together: list[Generation] = []
        waiting = list(plan)
        step = 0
        while waiting or len(batch):
            while waiting and waiting[0][0] <= step:
                _, prompt, sampling = waiting.pop(0)
                generation = Generation(loaded, prompt, sampling)
                together.append(generation)
                if generation.step() is None:
                    batch.add(generation)
            if len(batch):
                for generation, finish in zip(list(batch.generations), batch.step(), strict=True):
                    if finish is not None:
                        batch.discard(generation)
            step += 1
        rebuilds_together, places_together = calls["rebuild"], calls["place"]
        references = [run_alone(loaded, prompt, sampling) for _, prompt, sampling in plan]
    assert places_together > 0 and rebuilds_together > 0
    assert step > 64 + 40  # past a rebuilt cache's spare columns
    assert [g.token_ids for g in together] == [g.token_ids for g in references]
    assert [g.logprobs for g in together] == [g.logprobs for g in references]
    assert [len(g.token_ids) for g in together] == [sampling.max_tokens for _, _, sampling in plan]
