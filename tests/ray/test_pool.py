"""RayRolloutPool on a local Ray cluster against the fake vLLM server: batches, streams, groups, abort, weight
updates and metrics through two worker actors, and the same results as one RolloutRunner.

One fake server and one pool serve the module (starting workers is the slow part); each test scripts its own
sessions, so tests do not see each other's turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from conftest import MODEL, ONE_TURN, SAMPLING, pool_config, samples

from fsm_rollout import RolloutRunner, Sample, Status
from fsm_rollout.distributed import RayRolloutPool
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, UPDATE_WEIGHT_VERSION_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(load_qwen_tokenizer(), model=MODEL) as fake:
        yield fake


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(ray_cluster: Any, server: FakeVLLMServer) -> AsyncIterator[RayRolloutPool]:
    config = pool_config(server.url, str(qwen_tokenizer_dir()))
    async with RayRolloutPool(config, sampling_params=SAMPLING, num_workers=2) as started:
        yield started
    assert ray_cluster.is_initialized(), "the pool shut down a cluster it did not start"


def script(server: FakeVLLMServer, prefix: str, n: int, **turn: Any) -> None:
    for i in range(n):
        server.script([ScriptedTurn(text=f"answer {prefix}{i}", **turn)], session=f"{prefix}{i}")


def sessions_seen(server: FakeVLLMServer, prefix: str) -> list[str]:
    return [request.headers.get("x-session-id", "") for request in server.requests_to(GENERATE_PATH)
            if request.headers.get("x-session-id", "").startswith(prefix)]  # fmt: skip


async def test_a_batch_comes_back_in_input_order_as_new_samples_from_both_workers(
    pool: RayRolloutPool, server: FakeVLLMServer
) -> None:
    script(server, "batch", 6)
    sent = samples("batch", 6)
    before = pool.metrics()
    done = await pool.run_batch(sent, concurrency=4)
    after = pool.metrics()
    assert [sample.index for sample in done] == list(range(6))
    assert [sample.response for sample in done] == [f"answer batch{i}" for i in range(6)]
    assert all(sample.status == Status.COMPLETED for sample in done)
    assert all(len(sample.loss_mask or []) == sample.response_length > 0 for sample in done)
    assert all(sample.status == Status.PENDING and not sample.response for sample in sent), "inputs were changed"
    per_worker = [a.samples_done - b.samples_done for a, b in zip(after.per_worker, before.per_worker, strict=True)]
    assert per_worker == [3, 3]
    assert after.samples_done - before.samples_done == 6


async def test_a_stream_yields_samples_as_they_finish(pool: RayRolloutPool, server: FakeVLLMServer) -> None:
    server.script([ScriptedTurn(text="slow", hang=True)], session="stream0")
    script(server, "stream", 4)  # stream0's scripted hang comes first in its queue
    stream = pool.stream(samples("stream", 4), concurrency=2)
    first = [(await anext(stream)).index for _ in range(3)]
    assert sorted(first) == [1, 2, 3]
    [held] = [rid for rid in server.held_request_ids if "stream0" in rid]
    server.release(held)
    last = await anext(stream)
    assert last.index == 0 and last.response == "slow"


async def test_a_group_keeps_its_structure_across_workers(pool: RayRolloutPool, server: FakeVLLMServer) -> None:
    server.script([ScriptedTurn(text=f"member {i}") for i in range(4)])  # group members get fresh session ids
    group = await pool.run_group(Sample(prompt="solve", index=7, metadata=dict(ONE_TURN)), 4)
    assert [sample.metadata["group_member"] for sample in group] == [0, 1, 2, 3]
    assert {sample.group_index for sample in group} == {7}
    assert len({sample.session_id for sample in group}) == 4
    assert sorted(sample.response for sample in group) == [f"member {i}" for i in range(4)]
    assert all(sample.status == Status.COMPLETED for sample in group)


async def test_abort_ends_running_and_unstarted_samples_and_sends_nothing_after(
    pool: RayRolloutPool, server: FakeVLLMServer
) -> None:
    script(server, "abort", 4, hang=True)
    stream = pool.stream(samples("abort", 4), concurrency=1)  # one running on each worker, one waiting on each
    await server.wait_until(lambda: len([r for r in server.waiting_request_ids if "abort" in r]) == 2)
    await pool.abort("cancelled")
    done = [sample async for sample in stream]
    assert {sample.status for sample in done} == {Status.ABORTED}
    # the two running end with the abort's reason; the two waiting for a slot say they never started
    assert sorted(sample.metadata["rollout_reason"] for sample in done) == ["cancelled"] * 2 + ["not_started"] * 2
    assert len(sessions_seen(server, "abort")) == 2, "a sample that had not started sent a request"
    assert not [r for r in server.waiting_request_ids if "abort" in r]


async def test_an_oversampled_batch_drops_a_group_without_signal_and_ends_its_surplus_oversampled(
    pool: RayRolloutPool, server: FakeVLLMServer
) -> None:
    server.script([ScriptedTurn(text="answer A", hang=True)], session="over0")  # group 0: signal, held
    server.script([ScriptedTurn(text="answer B")], session="over1")
    for i in (2, 3):  # group 1: no signal (dropped)
        server.script([ScriptedTurn(text="same")], session=f"over{i}")
    for i in (4, 5):  # group 2 starts in group 1's place, then is the surplus
        server.script([ScriptedTurn(text="never", hang=True)], session=f"over{i}")
    batch = samples("over", 8)
    for position, sample in enumerate(batch):
        sample.group_index = position // 2
    distinct = lambda group: len({sample.response for sample in group}) > 1  # noqa: E731
    running = asyncio.ensure_future(pool.run_batch(batch, concurrency=4, target_groups=1, oversample=1,
                                                   keep_group=distinct))  # fmt: skip
    await server.wait_until(lambda: len([r for r in server.waiting_request_ids if "over" in r]) == 3)
    [held] = [rid for rid in server.held_request_ids if "over0" in rid]
    server.release(held)
    done = await running
    assert [s.group_index for s in done] == [0, 0, 1, 1, 2, 2]  # group 3 never started
    assert (done.kept_groups, done.dropped_groups, done.surplus_groups) == (1, 1, 1)  # type: ignore[attr-defined]
    assert [s.metadata["group_kept"] for s in done] == [True, True, False, False, False, False]
    assert [s.status for s in done[:4]] == [Status.COMPLETED] * 4
    assert [(s.status, s.metadata["rollout_reason"]) for s in done[4:]] == [(Status.ABORTED, "oversampled")] * 2
    assert not [r for r in server.waiting_request_ids if "over" in r]
    assert not sessions_seen(server, "over6")


async def test_a_weight_update_suspends_every_worker_and_loses_no_token(
    pool: RayRolloutPool, server: FakeVLLMServer
) -> None:
    script(server, "weights", 2, hang=True, held_after=2)
    versions_before = len(server.requests_to(UPDATE_WEIGHT_VERSION_PATH))
    batch = asyncio.ensure_future(pool.run_batch(samples("weights", 2), concurrency=2))
    await server.wait_until(lambda: len([r for r in server.held_request_ids if "weights" in r]) == 2)
    async with pool.weight_update(version="7"):
        assert not [r for r in server.waiting_request_ids if "weights" in r], "suspend returned with requests held"
    done = await batch
    assert [sample.response for sample in done] == ["answer weights0", "answer weights1"]
    assert all(sample.status == Status.COMPLETED for sample in done)
    for sample in done:
        versions = [span["version"] for span in sample.metadata["weight_version_spans"]]
        assert versions == ["default", "7"], versions
    assert len(server.requests_to(UPDATE_WEIGHT_VERSION_PATH)) - versions_before == 2  # one per worker
    assert server.weight_version == "7"


async def test_metrics_sum_the_workers(pool: RayRolloutPool, server: FakeVLLMServer) -> None:
    metrics = pool.metrics()
    assert metrics.workers_alive == 2 and metrics.workers_lost == 0
    assert metrics.samples_done == sum(worker.samples_done for worker in metrics.per_worker)
    assert metrics.statuses == {
        status: sum(worker.statuses.get(status, 0) for worker in metrics.per_worker) for status in metrics.statuses
    }
    assert metrics.in_flight == 0


VOLATILE = {"rollout_uid"}
"""Per-run values a rollout writes (unique ids), which no two runs share."""


def comparable(sample: Sample) -> dict[str, Any]:
    data = sample.to_dict()
    data["metadata"] = {key: value for key, value in data["metadata"].items() if key not in VOLATILE}
    data.pop("non_generation_time", None)
    return data


async def test_the_pool_gives_the_same_results_as_one_runner(pool: RayRolloutPool, server: FakeVLLMServer) -> None:
    two_turns = {"scripted_env": {"steps": [["go on", False], ["ok", True]]}}
    inputs = {
        "runner": [Sample(prompt=f"q{i}", index=i, session_id=f"runner{i}", metadata=dict(two_turns))
                   for i in range(6)],
        "pooled": [Sample(prompt=f"q{i}", index=i, session_id=f"pooled{i}", metadata=dict(two_turns))
                   for i in range(6)],
    }  # fmt: skip
    for prefix in inputs:
        for i in range(6):
            turns = [ScriptedTurn(text=f"turn one of {i}"), ScriptedTurn(text=f"turn two of {i}", finish="length")]
            server.script(turns, session=f"{prefix}{i}")
    async with RolloutRunner(pool.config, sampling_params=SAMPLING, tokenizer=load_qwen_tokenizer()) as runner:
        alone = await runner.run_batch(inputs["runner"])
    pooled = await pool.run_batch(inputs["pooled"])
    for one, other in zip(alone, pooled, strict=True):
        one_data, other_data = comparable(one), comparable(other)
        assert one_data.pop("session_id") == f"runner{one.index}"
        assert other_data.pop("session_id") == f"pooled{other.index}"
        assert one_data == other_data


async def test_the_pool_s_samples_build_the_same_token_tree_as_one_runner_s(
    pool: RayRolloutPool, server: FakeVLLMServer
) -> None:
    """Two groups of three two-turn rollouts: the pool's samples (back from the workers, serialised) give the token
    tree the runner's give, node for node and leaf for leaf, with each group's prompt shared."""
    from fsm_rollout import training_tree

    two_turns = {"scripted_env": {"steps": [["go on", False], ["ok", True]]}}
    questions = [Sample(prompt=f"tree question {g}", index=g, metadata=dict(two_turns)) for g in range(2)]

    async def groups(run_group: Any) -> list[Sample]:
        # members take the unnamed scripted turns in any order: every turn answers the same text
        server.script([ScriptedTurn(text="the same answer") for _ in range(2 * 3 * 2)])
        made: list[Sample] = []
        for question in questions:
            made.extend(await run_group(question, 3))
        return made

    async with RolloutRunner(pool.config, sampling_params=SAMPLING, tokenizer=load_qwen_tokenizer()) as runner:
        alone = await groups(runner.run_group)
    pooled = await groups(pool.run_group)
    assert all(sample.status == Status.COMPLETED for sample in [*alone, *pooled])
    mine, theirs = training_tree(pooled), training_tree(alone)
    assert mine.stats["tree_tokens"] < mine.stats["flat_tokens"]
    assert mine.to_dict() == theirs.to_dict()
