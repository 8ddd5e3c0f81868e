"""Weight updates against the embedded engine over real HTTP: suspended rollouts match uninterrupted ones, the keep
strategy labels tokens with both versions, and slime/vime's ``partial_rollout`` hands samples back and resumes them
(also in another process, through ``to_dict``/``from_dict``).

The moment of a suspension is chosen by the engine's state (a request has sampled tokens), never by time.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, compat
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.tiny import tiny_model_dir
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = {"max_new_tokens": 48, "temperature": 0.0, "top_p": 1.0}
# min_new_tokens holds every turn open to a long budget, so that the requests are still running when the keep test
# freezes them, however loaded the machine (the rollout passes min_tokens on; it has no ignore_eos)
HELD = {"max_new_tokens": 400, "min_new_tokens": 400, "temperature": 0.0, "top_p": 1.0}
WAIT_S = 120.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine(served_model_name=str(tiny_model_dir()), max_num_seqs=4) as running:
        yield running


async def tokens_sampled(engine: LocalEngine, *, requests: int, at_least: int = 1) -> None:
    """Wait until ``requests`` generate requests each sampled ``at_least`` tokens (bounded)."""

    async def reached() -> None:  # the engine signals nothing per token: poll its state briefly
        while sum(1 for count in engine.live_token_counts().values() if count >= at_least) < requests:  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    await asyncio.wait_for(reached(), WAIT_S)


def config(engine: LocalEngine, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": engine.url,
        "model": engine.served_model_name,
        "max_turns": 2,
        "tokenizer_path": str(engine.model_dir),
        "check_invariants": True,
    }
    values.update(overrides)
    return RolloutConfig(**values)


def samples() -> list[Sample]:
    return [Sample(prompt=f"Count to {n}.", index=n) for n in range(3)]


def outcome(sample: Sample) -> tuple[Any, ...]:
    return (sample.tokens, sample.loss_mask, sample.status, sample.metadata.get("rollout_reason"))


def generated_positions(sample: Sample) -> list[int]:
    return [position for position, mask in enumerate(sample.loss_mask or []) if mask == 1]


def span_positions(sample: Sample) -> list[int]:
    return [p for span in sample.metadata.get("weight_version_spans", []) for p in range(span["start"], span["end"])]


async def run_batch(engine: LocalEngine, **overrides: Any) -> list[Sample]:
    envs = ScriptedEnvFactory()
    async with RolloutRunner(config(engine, **overrides), sampling_params=SAMPLING, env_factory=envs) as runner:
        return await runner.run_batch(samples())


async def test_abort_strategy_suspensions_match_the_uninterrupted_rollouts(engine: LocalEngine) -> None:
    reference = await run_batch(engine)
    envs = ScriptedEnvFactory()
    async with RolloutRunner(config(engine), sampling_params=SAMPLING, env_factory=envs) as runner:
        batch = asyncio.ensure_future(runner.run_batch(samples()))
        for _ in range(2):  # twice within the first turns, each time with tokens sampled
            await tokens_sampled(engine, requests=3, at_least=2)
            await runner.suspend()
            assert runner.suspender.requests_in_flight == 0
            assert runner.last_suspension.abort_calls == 1
            assert engine.live_request_ids() == []
            await runner.resume()
        today = await batch
        assert runner.metrics().suspensions >= 6
    for before, after in zip(reference, today, strict=True):
        assert outcome(after) == outcome(before)
        assert after.rollout_log_probs == pytest.approx(before.rollout_log_probs, abs=1e-5)
        assert span_positions(after) == generated_positions(after)


async def test_keep_strategy_freezes_the_requests_and_the_spans_show_both_versions(engine: LocalEngine) -> None:
    envs = ScriptedEnvFactory()
    cfg = config(engine, weight_update_strategy="keep", max_turns=1)
    async with RolloutRunner(cfg, sampling_params=HELD, env_factory=envs) as runner:
        batch = asyncio.ensure_future(runner.run_batch(samples()[:2]))
        await tokens_sampled(engine, requests=2, at_least=3)
        async with runner.weight_update(version="7"):
            assert engine.is_paused
            frozen = engine.live_token_counts()
            assert len(frozen) == 2
            await asyncio.sleep(0)  # the engine would have sampled more by now if it were not frozen
            assert engine.live_token_counts() == frozen
        done = await batch
        assert runner.last_suspension.abort_calls == 0 and runner.last_suspension.pause_calls == 1
    try:
        for sample in done:
            versions = [span["version"] for span in sample.metadata["weight_version_spans"]]
            assert versions == ["default", "7"]
            assert span_positions(sample) == generated_positions(sample)
            assert sample.metadata["start_weight_version"] == "default"
            assert sample.weight_versions == ["7"]
    finally:
        await engine.update_weight_version("default")


def compat_args(engine: LocalEngine, **overrides: Any) -> SimpleNamespace:
    url = urlsplit(engine.url)
    values: dict[str, Any] = {
        "vllm_router_ip": url.hostname,
        "vllm_router_port": url.port,
        "hf_checkpoint": engine.served_model_name,
        "max_turns": 1,
        "rollout_max_context_len": None,
        "partial_rollout": True,
        "rollout_interaction_env_path": "fsm_rollout.envs.geo3k",
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def geo3k_sample(index: int) -> Sample:
    return Sample(prompt=f"What is the angle {index}?", index=index, label="70")


async def test_partial_rollout_hands_samples_back_and_resumes_them(engine: LocalEngine) -> None:
    args = compat_args(engine)
    reference = await asyncio.gather(
        *(
            compat.generate(compat_args(engine, partial_rollout=False), geo3k_sample(i), dict(SAMPLING))
            for i in range(2)
        )
    )
    calls = [asyncio.ensure_future(compat.generate(args, geo3k_sample(i), dict(SAMPLING))) for i in range(2)]
    await tokens_sampled(engine, requests=2, at_least=2)
    await compat.suspend()
    handed_back = await asyncio.gather(*calls)
    for sample in handed_back:
        assert sample.status == Sample.Status.ABORTED
        assert sample.metadata["rollout_reason"] == "handed_back"  # the hand_back edge's own reason
        state = sample.metadata["resume_state"]
        assert state["suspend_reason"] == "weight_update"
        assert json.loads(json.dumps(state)) == state  # plain JSON
        assert sum(len(part["token_ids"]) for part in state["partial_turn"]) >= 2
    await compat.resume()
    finished = await asyncio.gather(*(compat.generate(args, sample, dict(SAMPLING)) for sample in handed_back))
    for before, after in zip(reference, finished, strict=True):
        assert outcome(after) == outcome(before)
        assert after.rollout_log_probs == pytest.approx(before.rollout_log_probs, abs=1e-5)
        assert "resume_state" not in after.metadata
        assert after.metadata["geo3k"] == before.metadata["geo3k"]
    await compat.close_clients()


RESUME_ELSEWHERE = r"""
import asyncio, json, sys
from types import SimpleNamespace
from fsm_rollout import Sample, compat

args = SimpleNamespace(**json.loads(sys.argv[1]))
sample = Sample.from_dict(json.loads(sys.stdin.read()))
sampling = json.loads(sys.argv[2])

async def main():
    done = await compat.generate(args, sample, sampling)
    await compat.close_clients()
    print(json.dumps(done.to_dict()))

asyncio.run(main())
"""


async def test_a_sample_handed_back_resumes_in_another_process(engine: LocalEngine) -> None:
    args = compat_args(engine)
    reference = await compat.generate(compat_args(engine, partial_rollout=False), geo3k_sample(5), dict(SAMPLING))
    call = asyncio.ensure_future(compat.generate(args, geo3k_sample(5), dict(SAMPLING)))
    await tokens_sampled(engine, requests=1, at_least=2)
    await compat.suspend()
    handed_back = await call
    await compat.resume()
    await compat.close_clients()
    data = json.dumps(handed_back.to_dict())
    compat.discard_suspended(handed_back)  # this process forgets it: only the dict goes on
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", RESUME_ELSEWHERE, json.dumps(vars(args)), json.dumps(SAMPLING)],
        input=data,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = Sample.from_dict(json.loads(result.stdout.strip().splitlines()[-1]))
    assert outcome(resumed) == outcome(reference)
    assert resumed.rollout_log_probs == pytest.approx(reference.rollout_log_probs, abs=1e-5)
    assert resumed.metadata["geo3k"] == reference.metadata["geo3k"]


async def test_resuming_elsewhere_without_a_snapshot_says_what_the_environment_lacks(engine: LocalEngine) -> None:
    args = compat_args(engine, rollout_interaction_env_path="fsm_rollout.testing.envs")
    call = asyncio.ensure_future(compat.generate(args, geo3k_sample(6), dict(SAMPLING)))
    await tokens_sampled(engine, requests=1, at_least=1)
    await compat.suspend()
    handed_back = await call
    await compat.resume()
    moved = Sample.from_dict(json.loads(json.dumps(handed_back.to_dict())))
    compat.discard_suspended(handed_back)
    with pytest.raises(compat.ResumeError, match="snapshot"):
        await compat.generate(args, moved, dict(SAMPLING))
    assert moved.tokens == handed_back.tokens  # nothing of the sample is lost
    await compat.close_clients()
