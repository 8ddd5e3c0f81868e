"""A runner's samples waiting for a concurrency slot: queued apart from ``pending``, and ended ``not_started``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.cli.inspect import render_summary, summarize
from fsm_rollout.machine.diagrams import build_overlay, mermaid
from fsm_rollout.replay.paths import TracedPath
from fsm_rollout.runtime.runner import NOT_STARTED, RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import capture_transitions

SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}


def runner_for(server: FakeVLLMServer, tokenizer: Any) -> RolloutRunner:
    config = RolloutConfig(engine_url=server.url, model="fake-model", max_turns=1, router_policy="consistent_hash")
    return RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer,
                         env_factory=ScriptedEnvFactory(steps=[("ok", True)]))  # fmt: skip


def samples(n: int) -> list[Sample]:
    return [Sample(prompt=f"question {i}", index=i, session_id=f"s{i}") for i in range(n)]


class Clock:
    """``time.perf_counter`` that moves only when told: every duration is what the test made it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def first_events(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    first: dict[str, dict[str, Any]] = {}
    for event in events:
        first.setdefault(str(event["sample_id"]), event)
    return first


async def test_the_wait_for_a_slot_is_queued_time_not_pending_dwell(
    fake_vllm: FakeVLLMServer, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    fake_vllm.script([ScriptedTurn(text="slow", hang=True)], session="s0")
    for i in (1, 2):
        fake_vllm.script([ScriptedTurn(text="fast")], session=f"s{i}")
    with capture_transitions() as events:
        async with runner_for(fake_vllm, tokenizer) as runner:
            batch = asyncio.ensure_future(runner.run_batch(samples(3), concurrency=1))
            await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
            while_held = runner.metrics()
            clock.now += 5.0  # the two others wait five (fake) seconds for the slot
            fake_vllm.release(fake_vllm.held_request_ids[0])
            done = await batch
            final = runner.metrics()
    assert [sample.status for sample in done] == [Status.COMPLETED] * 3
    assert (while_held.queued, while_held.in_flight, sum(while_held.occupancy.values())) == (2, 1, 1)
    assert "pending" not in while_held.occupancy  # the queued samples are not shown as pending
    first = first_events(events)
    assert [first[str(i)]["queued_ms"] for i in range(3)] == [0.0, 5000.0, 5000.0]
    assert [first[str(i)]["dwell_ms"] for i in range(3)] == [0.0, 0.0, 0.0]  # pending is the render only
    assert sum("queued_ms" in event for event in events) == 3  # on the first transition only
    assert (final.queued, final.queue_waits, final.queued_ms_mean) == (0, 3, pytest.approx(10000.0 / 3))
    assert final.dwell_ms_mean["pending"] == 0.0

    summary = render_summary("trace", summarize(paths_of(events)), [])
    queued_row = next(line for line in summary.splitlines() if "queued for a slot" in line)
    assert queued_row.split()[4:6] == ["3", "5000.00"]  # n, p50
    overlay = build_overlay(events)
    assert overlay.states["pending"].queued_p50_ms == 5000.0
    assert overlay.states["pending"].dwell_p50_ms == 0.0
    assert "queued before it p50 5000 ms" in mermaid(overlay)


def paths_of(events: list[dict[str, Any]]) -> list[TracedPath]:
    ids = sorted({str(event["sample_id"]) for event in events})
    return [TracedPath(sample_id=key, session_id=None, events=[e for e in events if str(e["sample_id"]) == key])
            for key in ids]  # fmt: skip


async def test_an_abort_ends_the_samples_still_queued_as_not_started_and_sends_nothing_for_them(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="never", hang=True)], session="s0")
    with capture_transitions() as events:
        async with runner_for(fake_vllm, tokenizer) as runner:
            batch = asyncio.ensure_future(runner.run_batch(samples(3), concurrency=1))
            await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
            await runner.abort("cancelled")
            done = await batch
            snapshot = runner.metrics()
    assert [sample.metadata["rollout_reason"] for sample in done] == ["cancelled", NOT_STARTED, NOT_STARTED]
    assert all(sample.status == Status.ABORTED for sample in done)
    assert [request.body["request_id"] for request in fake_vllm.requests_to(GENERATE_PATH)] == ["s0-turn0"]
    assert snapshot.reasons == {"cancelled": 1, NOT_STARTED: 2}
    ended = {str(event["sample_id"]): event for event in events if event["dst"] == "aborted"}
    assert {key: (event["src"], event["reason"]) for key, event in ended.items()} == {
        "0": ("generating", "cancelled"),
        "1": ("pending", NOT_STARTED),
        "2": ("pending", NOT_STARTED),
    }


@pytest.mark.parametrize("how", ["cancel the batch", "close the stream"])
async def test_samples_queued_when_their_batch_goes_away_end_not_started(
    fake_vllm: FakeVLLMServer, tokenizer: Any, how: str
) -> None:
    fake_vllm.script([ScriptedTurn(text="first")], session="s0")
    fake_vllm.script([ScriptedTurn(text="never", hang=True)], session="s1")
    batch = samples(3)
    async with runner_for(fake_vllm, tokenizer) as runner:
        if how == "cancel the batch":
            task = asyncio.ensure_future(runner.run_batch(batch, concurrency=1))
            await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            stream = runner.stream(batch, concurrency=1)
            assert (await anext(stream)).index == 0
            await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
            await stream.aclose()  # type: ignore[attr-defined]
        assert runner.queued == 0
    assert batch[1].status == Status.ABORTED  # it had started: cancelled (or, closing, shut down) mid-way
    assert (batch[2].status, batch[2].metadata["rollout_reason"]) == (Status.ABORTED, NOT_STARTED)
