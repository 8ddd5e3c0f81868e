"""Adaptive admission (``RolloutConfig.admission="adaptive"``) against the fake server's published load: generate
requests are held while the engine is over its targets and released when it drops, a sample stepping its
environment holds no slot, started turns go first and in the order they asked, preemptions halve the window, and
a server without ``/metrics`` gets fixed admission with one warning."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.cli.inspect import render_summary, summarize
from fsm_rollout.engine.load import EngineLoad, LoadReader, parse_metrics
from fsm_rollout.replay.paths import TracedPath
from fsm_rollout.runtime.admission import AdmissionController, AdmissionPoint
from fsm_rollout.runtime.runner import NOT_STARTED, RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import capture_transitions

SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}


def adaptive(server: FakeVLLMServer, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": "fake-model",
        "max_turns": 1,
        "router_policy": "consistent_hash",
        "admission": "adaptive",
    }
    return RolloutConfig(**{**values, **overrides})


def samples(n: int, server: FakeVLLMServer, turns: int = 1) -> list[Sample]:
    """``n`` samples, each with ``turns`` scripted answers at ``server``."""
    for i in range(n):
        server.script([ScriptedTurn(text=f"answer {turn}") for turn in range(turns)], session=f"s{i}")
    return [Sample(prompt=f"question {i}", index=i, session_id=f"s{i}") for i in range(n)]


async def reads_after(server: FakeVLLMServer, count: int) -> None:
    """Wait until the fake answered ``/metrics`` ``count`` more times: the controller has seen what it says now."""
    target = server.metrics_reads + count
    await server.wait_until(lambda: server.metrics_reads >= target)


class BlockingEnv:
    """An environment whose step waits until the test lets it go."""

    def __init__(self, entered: asyncio.Event, go: asyncio.Event) -> None:
        self.entered, self.go = entered, go

    def reset(self) -> None:
        return None

    async def step(self, text: str) -> Any:
        self.entered.set()
        await self.go.wait()
        return "tool result", False, {}

    def format_observation(self, observation: Any) -> Any:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        return None


async def test_the_fake_and_the_embedded_frame_publish_the_load_vllm_names(fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="held", hang=True)])
    async with aiohttp.ClientSession() as session:
        generate = asyncio.ensure_future(
            session.post(fake_vllm.url + GENERATE_PATH, json={"token_ids": [1, 2, 3], "sampling_params": {}})
        )
        await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
        async with session.get(fake_vllm.url + "/metrics") as answer:
            assert answer.status == 200
            assert answer.content_type == "text/plain"
            load = parse_metrics(await answer.text())
        assert load is not None and (load.running, load.waiting, load.preemptions) == (1, 0, 0)
        assert load.kv_cache_usage == pytest.approx(3 / fake_vllm.kv_cache_tokens)
        fake_vllm.release(fake_vllm.held_request_ids[0])
        (await generate).release()
    reader = LoadReader()
    try:
        assert await reader.read(fake_vllm.url) == EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0)
        fake_vllm.report_load(waiting=40, kv_cache_usage=0.95)
        assert await reader.read(fake_vllm.url) == EngineLoad(running=0, waiting=40, kv_cache_usage=0.95, preemptions=0)
    finally:
        await reader.close()


async def test_new_samples_wait_while_the_engine_is_over_target_and_go_when_it_drops(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.report_load(waiting=50)  # over admission_max_waiting (8)
    factory = ScriptedEnvFactory(steps=[("ok", True)])
    with capture_transitions() as events:
        async with RolloutRunner(
            adaptive(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory
        ) as runner:
            assert runner.admission is not None
            batch = asyncio.ensure_future(runner.run_batch(samples(3, fake_vllm)))
            await reads_after(fake_vllm, 3)
            assert fake_vllm.requests_to(GENERATE_PATH) == []  # held: nothing sent, no environment built
            assert runner.admission.controllers[fake_vllm.url].waiting == 3
            assert runner.in_flight == 0
            fake_vllm.report_load(waiting=None)  # the queue drains
            done = await batch
    assert [sample.status for sample in done] == [Status.COMPLETED] * 3
    renders = [event for event in events if event["trigger"] == "render"]
    assert len(renders) == 3 and all(event["admission_ms"] > 0 for event in renders)
    summary = render_summary("trace", summarize(paths_of(events)), [])
    assert next(line for line in summary.splitlines() if "admission wait" in line).split()[2] == "3"


async def test_kv_headroom_holds_new_samples_at_admission_kv_target_and_releases_them_under_it(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.report_load(kv_cache_usage=0.5)  # at the target: no headroom left
    factory = ScriptedEnvFactory(steps=[("ok", True)])
    async with RolloutRunner(
        adaptive(fake_vllm, admission_kv_target=0.5), sampling_params=SAMPLING, tokenizer=tokenizer,
        env_factory=factory,
    ) as runner:  # fmt: skip
        assert runner.admission is not None
        controller = runner.admission.controllers[fake_vllm.url]
        batch = asyncio.ensure_future(runner.run_batch(samples(2, fake_vllm)))
        await reads_after(fake_vllm, 2)
        assert controller.over_target and controller.waiting == 2
        assert fake_vllm.requests_to(GENERATE_PATH) == []  # held: the queue is empty, only the KV rule holds them
        fake_vllm.report_load(kv_cache_usage=0.45)  # headroom again
        done = await batch
    assert [sample.status for sample in done] == [Status.COMPLETED] * 2
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2


async def test_a_next_turn_waits_while_kv_use_is_over_target_and_a_sample_stepping_holds_no_slot(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    entered, go = asyncio.Event(), asyncio.Event()
    config = adaptive(fake_vllm, max_turns=2)
    with capture_transitions() as events:
        async with RolloutRunner(
            config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=lambda **_: BlockingEnv(entered, go)
        ) as runner:
            assert runner.admission is not None
            controller = runner.admission.controllers[fake_vllm.url]
            run = asyncio.ensure_future(runner.run_batch(samples(1, fake_vllm, turns=2)))
            await entered.wait()
            assert controller.in_flight == 0  # stepping its environment: no generation slot held
            fake_vllm.report_load(kv_cache_usage=0.95)
            await reads_after(fake_vllm, 2)  # read while the sample steps (it has not ended)
            go.set()
            await fake_vllm.wait_until(lambda: controller.waiting == 1)
            await reads_after(fake_vllm, 2)
            assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1  # the second turn is held
            fake_vllm.report_load(kv_cache_usage=None)
            [sample] = await run
    assert sample.status == Status.TRUNCATED and sample.metadata.get("rollout_error") is None
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2
    next_turn = next(e for e in events if e["trigger"] == "generate" and e["src"] == "observing")
    assert next_turn["dst"] == "generating" and next_turn["admission_ms"] > 0
    assert controller.in_flight == 0 and controller.active == 0


async def test_an_abort_ends_samples_waiting_for_admission_unstarted(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.report_load(kv_cache_usage=1.0)
    factory = ScriptedEnvFactory(steps=[("ok", True)])
    async with RolloutRunner(
        adaptive(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory
    ) as runner:
        batch = asyncio.ensure_future(runner.run_batch(samples(2, fake_vllm)))
        await reads_after(fake_vllm, 2)
        await runner.abort("cancelled")
        done = await batch
    assert [(sample.status, sample.metadata["rollout_reason"]) for sample in done] == [
        (Status.ABORTED, NOT_STARTED)
    ] * 2
    assert fake_vllm.requests_to(GENERATE_PATH) == []


async def test_a_server_without_metrics_gets_fixed_admission_with_one_warning(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeVLLMServer(tokenizer, model="fake-model", publish_metrics=False) as server:
        factory = ScriptedEnvFactory(steps=[("ok", True)])
        with caplog.at_level(logging.WARNING, logger="fsm_rollout.runtime.admission"):
            async with RolloutRunner(
                adaptive(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory
            ) as runner:
                assert runner.admission is None
                done = await runner.run_batch(samples(3, server), concurrency=2)
    assert [sample.status for sample in done] == [Status.COMPLETED] * 3
    warnings = [record for record in caplog.records if record.name == "fsm_rollout.runtime.admission"]
    assert len(warnings) == 1 and "does not publish" in warnings[0].getMessage()
    assert "fixed" in warnings[0].getMessage()


class StubReader(LoadReader):
    """A reader whose load the test sets; ``silent``: a read never answers, so only the test's readings count."""

    def __init__(self, load: EngineLoad, *, silent: bool = False) -> None:
        super().__init__()
        self.load, self.silent = load, silent

    async def read(self, base_url: str) -> EngineLoad | None:
        if self.silent:
            await asyncio.Event().wait()
        return self.load


async def test_the_oldest_sample_goes_first_and_new_samples_after_started_ones() -> None:
    over = EngineLoad(running=1, waiting=20, kv_cache_usage=0.5, preemptions=0)
    controller = AdmissionController("http://x", StubReader(over, silent=True), kv_target=0.9, max_waiting=0, load=over)
    priorities = {"new": (1, 0.0, 0), "young": (0, 5.0, 0), "old": (0, 1.0, 0)}
    waits = {name: asyncio.ensure_future(controller.acquire(priority)) for name, priority in priorities.items()}
    await asyncio.sleep(0)  # one loop iteration: the three ask, in that order
    assert controller.waiting == 3 and controller.in_flight == 0
    controller.observe(EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0))  # a window of one
    await waits["old"]
    assert not waits["young"].done() and not waits["new"].done()
    controller.release()
    await waits["young"]
    assert not waits["new"].done()
    controller.release()
    await waits["new"]
    assert controller.in_flight == 1
    await controller.close()


async def test_started_samples_turns_go_in_the_order_they_asked_not_by_the_samples_age() -> None:
    over = EngineLoad(running=1, waiting=20, kv_cache_usage=0.5, preemptions=0)
    controller = AdmissionController("http://x", StubReader(over, silent=True), kv_target=0.9, max_waiting=0, load=over)
    older, younger = AdmissionPoint(controller), AdmissionPoint(controller)
    for point in (older, younger):  # admitted as new samples in this order; their first answers are in
        point.hold(0.0)
        point.release()
    new = asyncio.ensure_future(controller.acquire((1, 0.0, 0)))
    younger_turn = asyncio.ensure_future(younger.acquire())
    await asyncio.sleep(0)  # the younger sample's next turn asks first
    older_turn = asyncio.ensure_future(older.acquire())
    await asyncio.sleep(0)
    assert controller.waiting == 3
    controller.observe(EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0))  # a window of one
    first, _ = await asyncio.wait({younger_turn, older_turn, new}, return_when=asyncio.FIRST_COMPLETED)
    assert first == {younger_turn}
    younger.release()
    first, _ = await asyncio.wait({older_turn, new}, return_when=asyncio.FIRST_COMPLETED)
    assert first == {older_turn}  # a new sample goes after every started turn
    older.release()
    await new
    await controller.close()


def test_new_preemptions_halve_the_window_and_an_over_target_reading_shrinks_it() -> None:
    reader = StubReader(EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0))
    controller = AdmissionController("http://x", reader, kv_target=0.9, max_waiting=8, load=reader.load)
    controller.window = 32
    controller.observe(EngineLoad(running=30, waiting=0, kv_cache_usage=0.5, preemptions=4))
    assert (controller.window, controller.backoffs) == (16, 1)
    controller.observe(EngineLoad(running=30, waiting=0, kv_cache_usage=0.5, preemptions=4))  # none new
    assert controller.window == 16
    controller.in_flight = 5
    controller.observe(EngineLoad(running=5, waiting=9, kv_cache_usage=0.5, preemptions=4))
    assert (controller.over_target, controller.window) == (True, 5)


def paths_of(events: list[dict[str, Any]]) -> list[TracedPath]:
    ids = sorted({str(event["sample_id"]) for event in events})
    return [TracedPath(sample_id=key, session_id=None, events=[e for e in events if str(e["sample_id"]) == key])
            for key in ids]  # fmt: skip


async def test_an_in_process_engine_is_read_on_each_admission_and_answer_without_a_poll() -> None:
    from fsm_rollout.engine.load import register_local, unregister_local

    calm = EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0)
    over = EngineLoad(running=1, waiting=20, kv_cache_usage=0.5, preemptions=0)
    current = [calm]
    register_local("http://in-process", lambda: current[0])
    try:  # the stub never answers: only in-process reads can move the controller
        controller = AdmissionController(
            "http://in-process", StubReader(calm, silent=True), kv_target=0.9, max_waiting=8, load=calm
        )
        await controller.acquire((1, 0.0, 0))
        current[0] = over
        second = asyncio.ensure_future(controller.acquire((1, 1.0, 0)))
        await asyncio.sleep(0)  # it asks: the engine's queue read at that moment is over target
        assert controller.over_target and controller.waiting == 1 and not second.done()
        current[0] = calm
        controller.release()  # the first answer is in: read again, under target, the second goes
        await second
        assert controller.in_flight == 1 and not controller.over_target
        await controller.close()
    finally:
        unregister_local("http://in-process")


async def test_the_window_grows_by_the_queue_room_less_requests_the_engine_has_not_seen() -> None:
    calm = EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0)
    controller = AdmissionController("http://x", StubReader(calm, silent=True), kv_target=0.9, max_waiting=8, load=calm)
    controller.window = 2
    await controller.acquire((1, 0.0, 0))
    await controller.acquire((1, 1.0, 0))
    third = asyncio.ensure_future(controller.acquire((1, 2.0, 0)))
    await asyncio.sleep(0)
    assert controller.waiting == 1
    # Both admitted requests are still on their way (the engine shows none): room 8, less those 2.
    controller.observe(EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0))
    await third
    assert controller.window == 2 + 6
    await controller.close()
