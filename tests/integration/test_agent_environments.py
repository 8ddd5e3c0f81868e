"""Environments of real agents: async methods, a worker pool for slow synchronous ones, timeouts that end a sample
``truncated`` with a reason, and rewards. Abort, suspension and cancellation during an environment call behave as
during a request: the environment is closed exactly once and nothing is sent after an abort. Environment calls
are held on events; only the two timeout tests wait for a limit to run out."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, get_tracer
from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH
from fsm_rollout.replay import replay_async
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


class AsyncEnv:
    """Every method is a coroutine; ``step`` can be held on an event; done after ``turns`` steps."""

    def __init__(self, turns: int = 2, hold: asyncio.Event | None = None, reward: float | None = None) -> None:
        self.turns = turns
        self.hold = hold
        self.reward = reward
        self.steps = 0
        self.closed = 0
        self.stepping = asyncio.Event()

    async def reset(self) -> None:
        await asyncio.sleep(0)

    async def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        self.steps += 1
        self.stepping.set()
        if self.hold is not None:
            await self.hold.wait()
        done = self.steps >= self.turns
        info = {"reward": self.reward} if done and self.reward is not None else {}
        return f"observation {self.steps}", done, info

    async def format_observation(self, observation: Any) -> dict[str, str]:
        return {"role": "user", "content": str(observation)}

    async def close(self) -> None:
        self.closed += 1


class SlowSyncEnv:
    """Synchronous methods; ``step`` blocks its thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.finished = threading.Event()
        self.closed = 0
        self.thread: str | None = None

    def reset(self) -> None:
        pass

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        self.thread = threading.current_thread().name
        self.entered.set()
        self.release.wait(30)
        self.finished.set()
        return "observation", True, {"reward": 1.0}

    def format_observation(self, observation: Any) -> dict[str, str]:
        return {"role": "user", "content": str(observation)}

    def close(self) -> None:
        self.closed += 1


def config(server: FakeVLLMServer, tmp_path: Path | None = None, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {"engine_url": server.url, "model": server.model, "max_turns": 3, "check_invariants": True}
    if tmp_path is not None:
        values.update(trace=str(tmp_path / "run.jsonl"), record=True)
    values.update(overrides)
    return RolloutConfig(**values)


async def test_an_async_environment_is_awaited_and_its_reward_lands_on_the_sample(tokenizer: Any) -> None:
    envs: list[AsyncEnv] = []

    async def build_env(*, sample: Any, args: Any) -> AsyncEnv:  # an async build_env too
        envs.append(AsyncEnv(turns=2, reward=0.75))
        return envs[-1]

    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first"), ScriptedTurn(text="second")])
        async with RolloutRunner(
            config(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=build_env
        ) as runner:
            sample = await runner.run(Sample(prompt="p", index=0))
    assert sample.status.value == "completed" and sample.reward == 0.75
    assert envs[0].steps == 2 and envs[0].closed == 1


@pytest.mark.parametrize("executor", ["inline", "thread"])
async def test_an_abort_during_an_awaited_step_ends_the_sample_and_sends_nothing_after(
    tokenizer: Any, executor: str
) -> None:
    hold = asyncio.Event()
    env = AsyncEnv(turns=3, hold=hold)
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first"), ScriptedTurn(text="second")])
        async with RolloutRunner(
            config(server, env_executor=executor),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0)))
            await env.stepping.wait()
            sent = len(server.requests)
            await runner.abort("weight_update")
            sample = await run
            assert len(server.requests) == sent  # no request after the abort (nothing was in flight)
    assert sample.status.value == "aborted" and sample.metadata["rollout_reason"] == "weight_update"
    assert sample.response_length > 0  # the first turn stays
    assert env.closed == 1


async def test_a_threaded_step_is_waited_for_on_abort_and_its_result_discarded(tokenizer: Any) -> None:
    env = SlowSyncEnv()
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first")])
        async with RolloutRunner(
            config(server, env_executor="thread", env_max_workers=2),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0)))
            await asyncio.to_thread(env.entered.wait, 30)
            assert env.thread is not None and env.thread.startswith("fsm-rollout-env")
            abort = asyncio.ensure_future(runner.abort("cancelled"))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not abort.done()  # the step is still running in its thread: the abort waits for it
            env.release.set()
            await abort
            sample = await run
    assert env.finished.is_set()
    assert sample.status.value == "aborted" and sample.reward is None  # the step's result was discarded
    assert env.closed == 1


async def test_a_slow_synchronous_step_in_the_pool_does_not_stall_the_loop(tokenizer: Any) -> None:
    env = SlowSyncEnv()
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first")])
        async with RolloutRunner(
            config(server, env_executor="thread"),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0)))
            await asyncio.to_thread(env.entered.wait, 30)
            ticks = 0
            for _ in range(50):  # the loop keeps turning while the step blocks its worker thread
                await asyncio.sleep(0)
                ticks += 1
            assert ticks == 50 and not run.done()
            env.release.set()
            sample = await run
    assert sample.status.value == "completed" and sample.reward == 1.0 and env.closed == 1


async def test_cancelling_the_caller_during_an_async_step_ends_it_cancelled(tokenizer: Any) -> None:
    env = AsyncEnv(turns=3, hold=asyncio.Event())
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first")])
        async with RolloutRunner(
            config(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=lambda **_: env
        ) as runner:
            sample = Sample(prompt="p", index=0)
            run = asyncio.ensure_future(runner.run(sample))
            await env.stepping.wait()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
    assert sample.status.value == "aborted" and sample.metadata["rollout_reason"] == "cancelled"
    assert env.closed == 1


async def test_a_suspension_during_a_step_lets_it_finish_and_suspends_before_the_next_request(tokenizer: Any) -> None:
    hold = asyncio.Event()
    env = AsyncEnv(turns=2, hold=hold)
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first"), ScriptedTurn(text="second")])
        async with RolloutRunner(
            config(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=lambda **_: env
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0)))
            await env.stepping.wait()
            await runner.suspend()
            hold.set()
            for _ in range(1000):
                if runner.metrics().suspended:
                    break
                await asyncio.sleep(0)
            assert runner.metrics().suspended == 1
            assert len(server.requests_to(GENERATE_PATH)) == 1
            await runner.resume()
            sample = await run
    assert sample.status.value == "completed" and env.closed == 1


@pytest.mark.parametrize("executor", ["inline", "thread"])
async def test_an_environment_call_past_its_limit_ends_the_sample_truncated_env_timeout(
    tokenizer: Any, executor: str
) -> None:
    env = AsyncEnv(turns=3, hold=asyncio.Event())  # never released: only the limit ends the step
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first")])
        async with RolloutRunner(
            config(server, env_executor=executor, env_step_timeout_s=0.2),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            sample = await runner.run(Sample(prompt="p", index=0))
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "env_timeout"
    assert sample.metadata["rollout_timeout"] == {"what": "env.step", "limit_s": 0.2, "state": "stepping"}
    assert sample.response_length > 0 and sample.loss_mask and sample.loss_mask[0] == 1  # the turn stays
    assert env.closed == 1


async def test_a_rollout_past_its_limit_ends_truncated_and_its_request_is_aborted(tokenizer: Any) -> None:
    env = AsyncEnv(turns=3)
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first", hang=True)])
        # the request hangs until the limit: ample time for the render before it on a loaded machine
        async with RolloutRunner(
            config(server, rollout_timeout_s=2.0),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            sample = await runner.run(Sample(prompt="p", index=0, session_id="s"))
        assert server.requests_to(ABORT_PATH)  # the hanging request was named to the server
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "rollout_timeout"
    assert sample.metadata["rollout_timeout"] == {"what": "rollout", "limit_s": 2.0, "state": "generating"}
    assert env.closed == 1


async def test_time_suspended_does_not_count_against_the_rollout_limit(tokenizer: Any) -> None:
    env = AsyncEnv(turns=1)
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first", hang=True, held_after=2), ScriptedTurn(text="unused")])
        async with RolloutRunner(
            config(server, rollout_timeout_s=3.0),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: env,
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0)))
            await server.wait_until_waiting(1)
            await runner.suspend()
            # Longer than the whole limit, spent suspended: a clock that kept running would end the sample here.
            # The work outside the suspension is a render and two instant answers, far below the limit.
            await asyncio.sleep(4.0)
            await runner.resume()
            sample = await run
    assert sample.status.value == "completed", sample.metadata.get("rollout_timeout")


async def test_reward_fn_sets_the_reward_and_its_error_fails_the_sample_with_data_kept(tokenizer: Any) -> None:
    async def reward(sample: Sample) -> float:
        return float(sample.response_length)

    def broken(sample: Sample) -> float:
        raise ValueError("the reward model is down")

    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="first"), ScriptedTurn(text="again")])
        async with RolloutRunner(
            config(server, reward_fn=reward),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: AsyncEnv(turns=1),
        ) as runner:
            scored = await runner.run(Sample(prompt="p", index=0))
        env = AsyncEnv(turns=1)
        async with RolloutRunner(
            config(server, reward_fn=broken), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=lambda **_: env
        ) as runner:
            failed = await runner.run(Sample(prompt="p", index=1))
    assert scored.status.value == "completed" and scored.reward == float(scored.response_length)
    assert failed.status.value == "failed" and "reward model is down" in failed.metadata["rollout_error"]["message"]
    assert failed.response_length > 0 and env.closed == 1


async def test_reward_fn_is_the_terminal_edge_s_step_after_its_actions_and_only_into_scored_states(
    tokenizer: Any,
) -> None:
    """Scoring is awaited on the edge into ``truncated`` after the edge appended the last turn, once per sample; the
    edges into ``aborted`` and ``failed`` do not score."""
    seen: list[tuple[str, int]] = []

    def reward(sample: Sample) -> float:
        seen.append((str(sample.index), sample.response_length))
        return 1.0

    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="one two three four five six seven eight nine ten")], session="s0")
        server.script([ScriptedTurn(text="partial", finish="abort")], session="s1")
        async with RolloutRunner(
            config(server, reward_fn=reward, router_policy="consistent_hash"),
            sampling_params={**SAMPLING, "max_new_tokens": 4},
            tokenizer=tokenizer,
            env_factory=lambda **_: AsyncEnv(turns=1),
        ) as runner:
            cut = await runner.run(Sample(prompt="p", index=0, session_id="s0"))
            aborted = await runner.run(Sample(prompt="p", index=1, session_id="s1"))
    assert (cut.status.value, cut.metadata["rollout_reason"]) == ("truncated", "length")
    assert cut.response_length == 4 and cut.reward == 1.0
    assert aborted.status.value == "aborted" and aborted.reward is None
    assert seen == [("0", 4)]  # the turn the length edge appended is in the sample it scored


async def test_a_recorded_run_with_an_async_environment_replays_identically(tokenizer: Any, tmp_path: Path) -> None:
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text=f"turn {i}") for i in range(4)])
        async with RolloutRunner(
            config(server, tmp_path),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=lambda **_: AsyncEnv(turns=2, reward=1.0),
        ) as runner:
            await runner.run_batch([Sample(prompt="p", index=i) for i in range(2)])
    get_tracer(str(tmp_path / "run.jsonl")).close()
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 2}
