"""RayRolloutPool against the embedded CPU engine (a real, tiny model): batches, streams, groups, abort and a weight
update through two worker actors. The model's text is random, so these tests assert what must hold whatever it
says."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from conftest import ONE_TURN, pool_config, samples

from fsm_rollout import Sample, Status
from fsm_rollout.distributed import RayRolloutPool
from fsm_rollout.engine.local import LocalEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "seed": 3}
ENDED_NORMALLY = {Status.COMPLETED, Status.TRUNCATED}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine() as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(ray_cluster: Any, engine: LocalEngine) -> AsyncIterator[RayRolloutPool]:
    config = pool_config(engine.url, str(engine.model_dir), model=engine.served_model_name)
    async with RayRolloutPool(config, sampling_params=SAMPLING, num_workers=2) as started:
        yield started


async def until(predicate: Callable[[], bool], within: float = 60.0) -> None:
    """Poll the engine's state (it has no event to wait on) until ``predicate`` holds."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < within, "the engine never reached the expected state"
        await asyncio.sleep(0.01)


def aligned(sample: Sample) -> bool:
    return len(sample.loss_mask or []) == len(sample.rollout_log_probs or []) == sample.response_length > 0


async def test_batches_streams_and_groups_run_on_the_real_model(pool: RayRolloutPool) -> None:
    two_turns = {"scripted_env": {"steps": [["go on", False], ["ok", True]]}}
    batch = await pool.run_batch(samples("local-batch", 4, **two_turns))
    assert [sample.index for sample in batch] == [0, 1, 2, 3]
    streamed = [sample async for sample in pool.stream(samples("local-stream", 3))]
    group = await pool.run_group(Sample(prompt="Find x.", index=9, metadata=dict(ONE_TURN)), 3)
    assert sorted(sample.index for sample in streamed) == [0, 1, 2]
    assert [sample.metadata["group_member"] for sample in group] == [0, 1, 2]
    for sample in [*batch, *streamed, *group]:
        assert sample.status in ENDED_NORMALLY, sample.metadata.get("rollout_error")
        assert aligned(sample)


async def test_abort_ends_the_requests_at_the_engine(pool: RayRolloutPool, engine: LocalEngine) -> None:
    await engine.pause("keep")  # requests arriving now wait at the engine: only the abort can end them
    try:
        stream = pool.stream(samples("local-abort", 2))
        await until(lambda: len([rid for rid in engine.live_request_ids() if "local-abort" in rid]) == 2)
        await pool.abort("cancelled")
        done = [sample async for sample in stream]
    finally:
        await engine.resume()
    assert [sample.status for sample in done] == [Status.ABORTED, Status.ABORTED]
    assert {sample.metadata["rollout_reason"] for sample in done} == {"cancelled"}
    await until(lambda: not [rid for rid in engine.live_request_ids() if "local-abort" in rid])


async def test_a_weight_update_through_the_pool_labels_the_new_tokens(
    pool: RayRolloutPool, engine: LocalEngine
) -> None:
    await engine.pause("keep")
    try:
        batch = asyncio.ensure_future(pool.run_batch(samples("local-weights", 2)))
        await until(lambda: len([rid for rid in engine.live_request_ids() if "local-weights" in rid]) == 2)
        async with pool.weight_update(version="3"):
            await engine.resume()  # the trainer's weight push; the rollouts stay suspended until the block ends
    finally:
        await engine.resume()
    done = await batch
    assert engine.weight_version == "3"
    for sample in done:
        assert sample.status in ENDED_NORMALLY, sample.metadata.get("rollout_error")
        assert aligned(sample)
        assert {span["version"] for span in sample.metadata["weight_version_spans"]} == {"3"}
