"""Rollouts sharing a loop through the pacer, and the collector tuned while they run (real HTTP, real tokenizer)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.errors import ConfigError
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_path_for
from fsm_rollout.replay import replay
from fsm_rollout.runtime import gc_policy
from fsm_rollout.runtime.pacing import pacer_for
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import Tracer

SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


async def _batch(
    server: FakeVLLMServer, client: VLLMClient, tokenizer: Any, config: RolloutConfig, n: int
) -> list[Rollout]:
    for i in range(n):  # each sample its own answers (by session), whatever order the requests arrive in
        server.script(
            [ScriptedTurn(text=f"answer {i % 3}.{turn}", delay=0.001 * (i % 5)) for turn in range(2)], session=f"s{i}"
        )
    rollouts = [
        Rollout(
            Sample(prompt=f"question {i}", index=i, session_id=f"s{i}"),
            config=config,
            sampling_params=SAMPLING,
            client=client,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(steps=[("keep going", False), ("ok", True)]),
        )
        for i in range(n)
    ]
    await asyncio.gather(*(rollout.run() for rollout in rollouts))
    return rollouts


async def test_paced_rollouts_end_exactly_as_unpaced_ones(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any, make_config: Callable[..., RolloutConfig]
) -> None:
    pacer = pacer_for(asyncio.get_running_loop())
    waited = pacer.waited
    paced_config = make_config(router_policy="consistent_hash", loop_slice_ms=5.0)
    paced = await _batch(fake_vllm, client, tokenizer, paced_config, 60)
    assert pacer.waited > waited  # 60 rollouts starting together did not all run in one iteration
    unpaced = await _batch(
        fake_vllm, client, tokenizer, make_config(router_policy="consistent_hash", loop_slice_ms=None), 60
    )
    for one, other in zip(paced, unpaced, strict=True):
        assert one.state == other.state == "completed"
        assert one.sample.to_dict() == other.sample.to_dict()


async def test_a_rollout_cancelled_while_waiting_its_turn_sends_nothing(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any, make_config: Callable[..., RolloutConfig]
) -> None:
    config = make_config(loop_slice_ms=5.0)
    fake_vllm.script([ScriptedTurn(text="x")] * 200)
    rollouts = [
        Rollout(
            Sample(prompt=f"q {i}", index=i),
            config=config,
            sampling_params=SAMPLING,
            client=client,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(steps=[("ok", True)]),
        )
        for i in range(50)
    ]
    tasks = [asyncio.create_task(rollout.run()) for rollout in rollouts]
    await asyncio.sleep(0)  # every task ran its first step: the last ones wait for the pacer
    last = rollouts[-1]
    assert last.state == "pending" and last.env is None
    tasks[-1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[-1], asyncio.CancelledError)
    assert last.state == "aborted" and last.reason == "cancelled"
    assert last.sample.status == Status.ABORTED
    assert all(rollout.state == "completed" for rollout in rollouts[:-1])
    assert len(fake_vllm.requests_to(RENDER_PATH)) == 49
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 49


class ThresholdsSeen(RolloutHooks):
    def __init__(self, seen: list[tuple[int, int, int]]) -> None:
        self.seen = seen

    def transition(self, *_: Any) -> None:
        self.seen.append(gc.get_threshold())


async def test_the_collector_is_tuned_while_rollouts_run(
    fake_vllm: FakeVLLMServer, client: VLLMClient, tokenizer: Any, make_config: Callable[..., RolloutConfig]
) -> None:
    before = gc.get_threshold()

    async def thresholds_seen(**config: Any) -> list[tuple[int, int, int]]:
        seen: list[tuple[int, int, int]] = []
        fake_vllm.script([ScriptedTurn(text="x")])
        rollout = Rollout(
            Sample(prompt="q", index=0),
            config=make_config(**config),
            sampling_params=SAMPLING,
            client=client,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(steps=[("ok", True)]),
            hooks=ThresholdsSeen(seen),
        )
        await rollout.run()
        assert rollout.sample.status == Status.COMPLETED
        return seen

    tuned = await thresholds_seen(tune_gc=True)
    assert tuned and set(tuned) == {gc_policy.tuned_thresholds(before)} != {before}
    assert gc.get_threshold() == before
    assert await thresholds_seen(tune_gc=False) == [before] * len(tuned)
    assert gc.get_threshold() == before


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_loop_slice_must_be_a_positive_number(value: Any) -> None:
    with pytest.raises(ConfigError, match="loop_slice_ms"):
        RolloutConfig(engine_url="http://127.0.0.1:1", model="m", max_turns=1, loop_slice_ms=value)


async def test_aborts_that_land_while_rollouts_wait_for_the_pacer_replay_identically(
    tmp_path: Path,
    fake_vllm: FakeVLLMServer,
    client: VLLMClient,
    tokenizer: Any,
    make_config: Callable[..., RolloutConfig],
) -> None:
    """Two new places an abort can land: waiting to start (ends at once, nothing built or sent) and waiting for
    the pacer after an answer (the turn counts as just answered). Both record and replay identically."""
    trace = tmp_path / "run.jsonl"
    tracer = Tracer(trace.open("ab"), owns_stream=True)
    writer = TapeWriter(tape_path_for(trace))
    config = make_config(router_policy="consistent_hash", loop_slice_ms=5.0)
    envs = [ScriptedEnvFactory(steps=[("again", False), ("ok", True)]) for _ in range(40)]
    rollouts = []
    for i in range(40):
        fake_vllm.script([ScriptedTurn(text=f"turn {turn}") for turn in range(2)], session=f"s{i}")
        rollouts.append(
            recorded_rollout(
                Sample(prompt=f"q{i}", index=i, session_id=f"s{i}"),
                config=config,
                sampling_params=SAMPLING,
                client=client,
                tokenizer=tokenizer,
                env_factory=envs[i],
                tracer=tracer,
                tape=writer,
            )
        )
    tasks = [asyncio.ensure_future(rollout.run()) for rollout in rollouts]
    await asyncio.sleep(0)
    waiting = rollouts[-1]
    assert waiting._start_waiter is not None  # the last ones wait for the pacer to start
    waiting.request_abort("shutdown")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert tasks[-1].done()  # woken at once, not left queued behind the others it will never run after
    assert sum(not task.done() for task in tasks) > 20
    caught: list[Rollout] = []

    def abort_one_that_just_got_its_answer() -> None:
        for rollout in rollouts:
            inflight = rollout._inflight
            if rollout.state == "generating" and inflight is not None and inflight.done():
                rollout.request_abort("weight_update")
                caught.append(rollout)
                return
        if not all(task.done() for task in tasks):
            asyncio.get_running_loop().call_soon(abort_one_that_just_got_its_answer)

    asyncio.get_running_loop().call_soon(abort_one_that_just_got_its_answer)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    writer.close()
    tracer.close()

    assert (waiting.state, waiting.reason, waiting.env) == ("aborted", "shutdown", None)
    assert envs[-1].built == []
    assert not [r for r in fake_vllm.requests if r.headers.get("x-session-id") == "s39"]
    (answered,) = caught
    assert (answered.state, answered.reason) == ("aborted", "weight_update")
    report = await asyncio.to_thread(replay, trace, tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 40}
