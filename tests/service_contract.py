"""The RolloutService contract: one set of behaviours, run against RolloutRunner (tests/integration/
test_service_runner.py) and RayRolloutPool (tests/ray/test_service_pool.py), each of which imports these tests and
provides a ``contract`` fixture (:class:`Contract`) over the fake vLLM server.

Every test scripts its own sessions (a prefix of its own), so tests sharing one server and one service do not see
each other's turns.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout import Sample, Status
from fsm_rollout.runtime.metrics import MetricsSnapshot
from fsm_rollout.runtime.service import RolloutService
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.weights.suspension import SuspendStats

ONE_TURN = {"scripted_env": {"steps": [["ok", True]]}}
"""Sample metadata whose scripted environment ends the episode after the first turn (env ``fsm_rollout.testing.
envs``)."""


@dataclass
class Contract:
    """What a contract test gets: the service (entered), the fake engine behind it, where its traces go, and how
    many samples it runs at once per unit of ``concurrency`` (1 for a runner, its worker count for a pool)."""

    service: RolloutService
    server: FakeVLLMServer
    trace_dir: Path
    parallel: int


def samples(prefix: str, n: int) -> list[Sample]:
    return [Sample(prompt=f"question {i}", index=i, session_id=f"{prefix}{i}", metadata=dict(ONE_TURN))
            for i in range(n)]  # fmt: skip


def script(server: FakeVLLMServer, prefix: str, n: int, **turn: Any) -> None:
    for i in range(n):
        server.script([ScriptedTurn(text=f"answer {prefix}{i}", **turn)], session=f"{prefix}{i}")


def seeds_sent(server: FakeVLLMServer, prefix: str) -> dict[str, Any]:
    """Each session's sampling seed, as its generate requests sent it."""
    return {request.headers["x-session-id"]: request.body["sampling_params"].get("seed")
            for request in server.requests_to(GENERATE_PATH)
            if request.headers.get("x-session-id", "").startswith(prefix)}  # fmt: skip


def held(server: FakeVLLMServer, prefix: str) -> list[str]:
    return [request_id for request_id in server.held_request_ids if prefix in request_id]


def traced_sample_ids(trace_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            event = orjson.loads(line)
            names.add(str(event.get("sample_id")))
    return names


async def until(predicate: Callable[[], bool], server: FakeVLLMServer) -> None:
    await asyncio.wait_for(server.wait_until(predicate), timeout=60)


async def test_the_service_has_the_protocol(contract: Contract) -> None:
    assert isinstance(contract.service, RolloutService)
    assert isinstance(contract.service.metrics(), MetricsSnapshot)
    assert isinstance(contract.service.last_suspension, SuspendStats)


async def test_run_returns_the_finished_sample(contract: Contract) -> None:
    script(contract.server, "one", 1)
    done = await contract.service.run(samples("one", 1)[0])
    assert (done.status, done.response, done.metadata["rollout_reason"]) == (Status.COMPLETED, "answer one0",
                                                                             "env_done")  # fmt: skip


async def test_a_batch_comes_back_in_input_order_named_and_seeded_by_position(contract: Contract) -> None:
    script(contract.server, "batch", 4)
    before = contract.service.metrics().samples_done
    done = await contract.service.run_batch(
        samples("batch", 4), concurrency=2, sample_ids=[f"named-{i}" for i in range(4)], seeds=[70, 71, 72, 73]
    )
    assert [sample.response for sample in done] == [f"answer batch{i}" for i in range(4)]
    assert seeds_sent(contract.server, "batch") == {f"batch{i}": 70 + i for i in range(4)}
    assert {f"named-{i}" for i in range(4)} <= traced_sample_ids(contract.trace_dir)
    metrics = contract.service.metrics()
    assert metrics.samples_done - before == 4  # counted by the time the batch returns
    assert (metrics.in_flight, metrics.queued, contract.service.in_flight) == (0, 0, 0)


async def test_a_stream_yields_as_samples_finish_with_their_seeds(contract: Contract) -> None:
    contract.server.script([ScriptedTurn(text="slow", hang=True)], session="stream0")
    script(contract.server, "stream", 3)  # stream0's hang comes first in its queue
    stream = contract.service.stream(samples("stream", 3), concurrency=2, seeds=[5, 6, 7])
    first = [(await anext(stream)).index for _ in range(2)]
    assert sorted(first) == [1, 2]
    [request_id] = held(contract.server, "stream0")
    contract.server.release(request_id)
    last = await anext(stream)
    assert (last.index, last.response) == (0, "slow")
    assert seeds_sent(contract.server, "stream") == {"stream0": 5, "stream1": 6, "stream2": 7}


async def test_a_seeded_group_sends_each_member_seed_plus_its_position(contract: Contract) -> None:
    contract.server.script([ScriptedTurn(text=f"member {i}") for i in range(3)])  # members get fresh sessions
    group = await contract.service.run_group(Sample(prompt="solve", index=4, metadata=dict(ONE_TURN)), 3, seed=40)
    assert [sample.metadata["group_member"] for sample in group] == [0, 1, 2]
    sent = seeds_sent(contract.server, "")
    assert [sent[str(sample.session_id)] for sample in group] == [40, 41, 42]
    assert {sample.group_index for sample in group} == {4}


async def test_abort_ends_the_running_with_its_reason_and_the_queued_as_not_started(contract: Contract) -> None:
    running = contract.parallel  # concurrency 1: one sample running per runner
    total = running + 2
    script(contract.server, "abort", total, hang=True)
    stream = contract.service.stream(samples("abort", total), concurrency=1)
    await until(lambda: len(held(contract.server, "abort")) == running, contract.server)
    await contract.service.abort("cancelled")
    done = [sample async for sample in stream]
    assert {sample.status for sample in done} == {Status.ABORTED}
    reasons = Counter(sample.metadata["rollout_reason"] for sample in done)
    assert reasons == {"cancelled": running, "not_started": total - running}
    assert not [sample for sample in done if sample.metadata["rollout_reason"] == "not_started" and sample.response]
    assert len(seeds_sent(contract.server, "abort")) == running, "a sample that had not started sent a request"
    assert contract.service.in_flight == 0


async def test_a_weight_update_suspends_resumes_and_reports_what_it_cost(contract: Contract) -> None:
    running = contract.parallel * 1
    script(contract.server, "weights", running, hang=True, held_after=2)
    batch = asyncio.ensure_future(contract.service.run_batch(samples("weights", running), concurrency=1))
    await until(lambda: len(held(contract.server, "weights")) == running, contract.server)
    async with contract.service.weight_update(version="9"):
        assert not [r for r in contract.server.waiting_request_ids if "weights" in r]
        suspended = contract.service.last_suspension
    done = await batch
    assert (suspended.reason, suspended.requests_in_flight) == ("weight_update", running)
    assert contract.service.last_suspension.resume_s >= 0.0
    assert all(sample.status == Status.COMPLETED for sample in done)
    for sample in done:
        assert [span["version"] for span in sample.metadata["weight_version_spans"]][-1] == "9"
    assert contract.service.metrics().suspensions >= running


__all__ = [
    "Contract",
    "test_a_batch_comes_back_in_input_order_named_and_seeded_by_position",
    "test_a_seeded_group_sends_each_member_seed_plus_its_position",
    "test_a_stream_yields_as_samples_finish_with_their_seeds",
    "test_a_weight_update_suspends_resumes_and_reports_what_it_cost",
    "test_abort_ends_the_running_with_its_reason_and_the_queued_as_not_started",
    "test_run_returns_the_finished_sample",
    "test_the_service_has_the_protocol",
]
