"""Weight updates through the runner against the fake vLLM server over loopback HTTP: suspended turns continue to
exactly the uninterrupted result (also when a stop string spans the cut, and when one turn is cut several times),
samples that have not started and new ``run`` calls wait, the metrics count suspensions, and a recorded run with
suspensions replays identically. Suspensions land where the server holds a request (``held_after`` tokens
produced), so nothing depends on timing."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, capture_transitions, get_tracer
from fsm_rollout.engine.schema import GENERATE_PATH
from fsm_rollout.replay import replay_async
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 120, "temperature": 0.0, "top_p": 1.0, "stop": ["</answer>"]}
TEXTS = [
    ["Let me think about the angle first.", "So the angle is <answer>70</answer> degrees, done."],
    ["The triangle has two equal sides here.", "Hence x = <answer>35</answer> and that is all."],
    ["Start from the sum of the angles in it.", "It gives <answer>110</answer> then some more text."],
]


def config(server: FakeVLLMServer, tmp_path: Path | None = None, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": server.model,
        "max_turns": 2,
        "router_policy": "consistent_hash",
        "check_invariants": True,
    }
    if tmp_path is not None:
        values.update(trace=str(tmp_path / "run.jsonl"), record=True)
    values.update(overrides)
    return RolloutConfig(**values)


def samples() -> list[Sample]:
    return [Sample(prompt=f"Problem {i}", index=i, session_id=f"s{i}") for i in range(len(TEXTS))]


def script(server: FakeVLLMServer, *, holds: list[list[tuple[int, tuple[int, ...]]]] | None = None) -> None:
    for index, texts in enumerate(TEXTS):
        turns = []
        for turn, text in enumerate(texts):
            hold = holds[index][turn] if holds is not None else None
            if hold is None:
                turns.append(ScriptedTurn(text=text))
            else:
                turns.append(ScriptedTurn(text=text, hang=True, held_after=hold[0], held_again_after=hold[1]))
        server.script(turns, session=f"s{index}")


def outcome(sample: Sample) -> tuple[Any, ...]:
    return (
        sample.tokens,
        sample.loss_mask,
        sample.rollout_log_probs,
        sample.status,
        sample.metadata.get("rollout_reason"),
        sample.response,
    )


async def reference_run(server: FakeVLLMServer) -> list[Sample]:
    script(server)
    async with RolloutRunner(
        config(server), sampling_params=SAMPLING, tokenizer=server.tokenizer, env_factory=ScriptedEnvFactory()
    ) as runner:
        return await runner.run_batch(samples())


async def interrupted_run(
    server: FakeVLLMServer, rng: random.Random, tmp_path: Path | None = None
) -> tuple[list[Sample], int]:
    """Every turn held once or twice at random token counts (the second cut of one turn comes right after the
    first resume); each hold is either released or cut by a suspension."""
    holds = [
        [(rng.randrange(0, 12), (rng.randrange(0, 6),) if rng.random() < 0.5 else ()) for _ in texts] for texts in TEXTS
    ]
    script(server, holds=holds)
    suspensions = 0
    async with RolloutRunner(
        config(server, tmp_path), sampling_params=SAMPLING, tokenizer=server.tokenizer, env_factory=ScriptedEnvFactory()
    ) as runner:
        batch = asyncio.ensure_future(runner.run_batch(samples()))
        while not batch.done():
            waiting = asyncio.ensure_future(server.wait_until_waiting(1))
            await asyncio.wait([batch, waiting], return_when=asyncio.FIRST_COMPLETED)
            if batch.done():
                waiting.cancel()
                break
            if suspensions == 0 or rng.random() < 0.6:
                await runner.suspend()
                assert runner.suspender.requests_in_flight == 0
                suspensions += 1
                await runner.resume()
            else:
                for request_id in list(server.waiting_request_ids):
                    server.release(request_id)
        result = await batch
        assert runner.metrics().suspensions >= suspensions
    return result, suspensions


@pytest.mark.parametrize("seed", [7, 8, 9, 10])
async def test_suspended_turns_continue_to_the_uninterrupted_result(tokenizer: Any, seed: int) -> None:
    async with FakeVLLMServer(tokenizer) as server:
        reference = await reference_run(server)
    async with FakeVLLMServer(tokenizer) as server:
        today, suspensions = await interrupted_run(server, random.Random(seed))
        assert suspensions > 0
        assert server.continuation_request_ids
    for before, after in zip(reference, today, strict=True):
        assert outcome(after) == outcome(before)
        spans = after.metadata["weight_version_spans"]
        covered = [p for span in spans for p in range(span["start"], span["end"])]
        assert covered == [p for p, mask in enumerate(after.loss_mask or []) if mask == 1]


async def test_a_stop_string_across_the_cut_ends_the_turn_where_the_engine_would_have(tokenizer: Any) -> None:
    sampling = {**SAMPLING, "stop": ["<answer>"]}
    text = "So it is <answer>70</answer>"
    cut = len(tokenizer.encode("So it is <answ", add_special_tokens=False))
    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text=text)], session="s0")
        async with RolloutRunner(
            config(server, max_turns=1), sampling_params=sampling, tokenizer=tokenizer, env_factory=ScriptedEnvFactory()
        ) as runner:
            reference = await runner.run(Sample(prompt="p", index=0, session_id="s0"))
        server.script([ScriptedTurn(text=text, hang=True, held_after=cut)], session="s0")
        async with RolloutRunner(
            config(server, max_turns=1), sampling_params=sampling, tokenizer=tokenizer, env_factory=ScriptedEnvFactory()
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0, session_id="s0")))
            await server.wait_until_waiting(1)
            await runner.suspend()
            await runner.resume()
            today = await run
    assert outcome(today) == outcome(reference)
    assert (
        today.response.endswith("<answer>") and today.metadata["rollout_reason"] == reference.metadata["rollout_reason"]
    )


async def test_samples_not_started_and_new_runs_wait_for_the_resume(tokenizer: Any) -> None:
    async with FakeVLLMServer(tokenizer) as server:
        script(server)
        async with RolloutRunner(
            config(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory()
        ) as runner:
            await runner.suspend()
            with capture_transitions() as events:
                batch = asyncio.ensure_future(runner.run_batch(samples()[:2]))
                late = asyncio.ensure_future(runner.run(samples()[2]))
                # Time for renders to reach the server if anything let them go: it can only make this test fail.
                await asyncio.sleep(0.2)
                # nothing rendered, nothing generated (entering the runner checked the engine's health only)
                assert [r.path for r in server.requests if r.path not in ("/health", "/v1/models")] == []
                assert events == []
                assert runner.metrics().in_flight == 3
                resumed_at = time.monotonic()
                await runner.resume()
                done = [*await batch, await late]
            work = [request for request in server.requests if request.path not in ("/health", "/v1/models")]
            assert work and all(request.at >= resumed_at for request in work)
            assert {sample.metadata["rollout_reason"] for sample in done} == {"max_turns"}


async def test_a_suspension_between_turns_takes_effect_before_the_next_request(tokenizer: Any) -> None:
    async with FakeVLLMServer(tokenizer) as server:
        script(server)
        runner_box: list[RolloutRunner] = []
        stepped = asyncio.Event()

        class SuspendingEnvs(ScriptedEnvFactory):
            def __call__(self, *, sample: Any, args: Any) -> Any:
                env = super().__call__(sample=sample, args=args)
                step = env.step

                def step_and_suspend(text: str) -> Any:
                    runner_box[0].suspender.request_suspend()  # the weight update starts while this env steps
                    stepped.set()
                    return step(text)

                env.step = step_and_suspend  # type: ignore[method-assign]
                return env

        async with RolloutRunner(
            config(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=SuspendingEnvs()
        ) as runner:
            runner_box.append(runner)
            with capture_transitions() as events:
                batch = asyncio.ensure_future(runner.run_batch(samples()))
                await stepped.wait()
                await runner.suspend()
                generates = len(server.requests_to(GENERATE_PATH))
                for _ in range(1000):  # every rollout runs on until it suspends; no request may leave meanwhile
                    if runner.metrics().suspended == len(TEXTS):
                        break
                    await asyncio.sleep(0)
                assert runner.metrics().suspended == len(TEXTS)
                assert len(server.requests_to(GENERATE_PATH)) == generates  # nothing sent while suspended
                await runner.resume()
                await batch
            after_steps = [event for event in events if event["trigger"] == "suspend" and not event["cut_request"]]
            assert after_steps  # the environment's sample suspended at its next generating, before sending
            assert all(event["partial_tokens"] == 0 for event in after_steps)


async def test_a_recorded_run_with_suspensions_replays_identically(tokenizer: Any, tmp_path: Path) -> None:
    async with FakeVLLMServer(tokenizer) as server:
        _, suspensions = await interrupted_run(server, random.Random(3), tmp_path)
    assert suspensions > 0
    get_tracer(str(tmp_path / "run.jsonl")).close()  # the sink is shared per path: close it before reading
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": len(TEXTS)}
