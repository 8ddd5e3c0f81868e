"""Behaviour that holds for any engine, checked against the fake scripted server and the embedded CPU engine.

The fake server answers from scripts; the embedded engine runs a real (tiny, random) model, so these tests only
assert what must hold whatever the model says: the token flow between turns, aligned training arrays, budgets,
aborts and concurrency.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 1.0, "seed": 7}


@dataclass
class Engine:
    kind: str
    url: str
    model: str
    fake: FakeVLLMServer | None

    def script(self, turns: int, session: str) -> None:
        """Script the fake server's answers for one session (the real engine needs none)."""
        if self.fake is not None:
            turn_list = [ScriptedTurn(text=f"Step {i}: the angle is 70 degrees.") for i in range(turns)]
            self.fake.script(turn_list, session=session)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local_engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine() as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["fake", "local"])
async def engine(request: pytest.FixtureRequest, local_engine: LocalEngine) -> AsyncIterator[Engine]:
    if request.param == "local":
        yield Engine("local", local_engine.url, local_engine.served_model_name, None)
        return
    async with FakeVLLMServer(load_qwen_tokenizer(), model="fake-model") as fake:
        yield Engine("fake", fake.url, "fake-model", fake)


def make_rollout(engine: Engine, client: VLLMClient, sample: Sample, **config: Any) -> Rollout:
    values: dict[str, Any] = {
        "engine_url": engine.url,
        "model": engine.model,
        "max_turns": 2,
        "router_policy": "consistent_hash",
        "check_invariants": True,
        "retry": RetryPolicy(max_attempts=2, base_delay_s=0.01),
    }
    sampling = config.pop("sampling", SAMPLING)
    values.update(config)
    return Rollout(
        sample,
        config=RolloutConfig(**values),
        sampling_params=sampling,
        client=client,
        tokenizer=load_qwen_tokenizer(),
        env_factory=ScriptedEnvFactory(),
    )


class RecordingClient(VLLMClient):
    """A client that keeps every generate body it sent and every answer it parsed."""

    def __init__(self, url: str) -> None:
        super().__init__(url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
        self.generate_bodies: list[dict[str, Any]] = []
        self.turns: list[Any] = []

    async def generate(self, body: Any, *, request_id: str, headers: Any = None) -> Any:
        self.generate_bodies.append({**body, "token_ids": list(body["token_ids"])})
        turn = await super().generate(body, request_id=request_id, headers=headers)
        self.turns.append(turn)
        return turn


async def test_each_turn_extends_the_last_request_and_response_and_arrays_line_up(engine: Engine) -> None:
    engine.script(2, "flow")
    async with RecordingClient(engine.url) as client:
        rollout = make_rollout(
            engine,
            client,
            Sample(prompt="Find the missing angle.", index=0, session_id="flow"),
            sampling={**SAMPLING, "max_new_tokens": 200},
        )
        sample = await rollout.run()
    bodies, turns = client.generate_bodies, client.turns
    prompt = bodies[0]["token_ids"]
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response_length == len(sample.tokens) - len(prompt)
    if len(bodies) == 2:
        first_end = len(prompt) + len(turns[0].token_ids)
        assert bodies[1]["token_ids"][:first_end] == prompt + turns[0].token_ids
        assert len(bodies[1]["token_ids"]) > first_end
        assert sample.tokens == bodies[1]["token_ids"] + turns[1].token_ids
    trainable = [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if mask]
    assert trainable and all(lp <= 0.0 for lp in trainable)
    assert sample.status in (Status.TRUNCATED, Status.COMPLETED)


async def test_every_generate_request_stays_within_the_remaining_budget(engine: Engine) -> None:
    engine.script(2, "budget")
    async with RecordingClient(engine.url) as client:
        rollout = make_rollout(
            engine,
            client,
            Sample(prompt="Find x.", index=1, session_id="budget"),
            sampling={**SAMPLING, "max_new_tokens": 16},
        )
        sample = await rollout.run()
    assert client.generate_bodies[0]["sampling_params"]["max_tokens"] == 16
    assert all(
        len(turn.token_ids) <= body["sampling_params"]["max_tokens"]
        for body, turn in zip(client.generate_bodies, client.turns, strict=True)
    )
    assert sample.response_length <= 16


async def test_abort_in_flight_ends_the_sample_and_nothing_follows(engine: Engine) -> None:
    if engine.fake is not None:
        engine.fake.script([ScriptedTurn(text="never", hang=True)], session="abort-me")
    async with RecordingClient(engine.url) as client:
        rollout = make_rollout(
            engine,
            client,
            Sample(prompt="Think at length.", index=2, session_id="abort-me"),
            # min_new_tokens masks EOS for the whole budget: the turn cannot end on its own before the abort lands,
            # whatever the model draws (the rollout does not pass ignore_eos on to the engine)
            sampling={**SAMPLING, "max_new_tokens": 4000, "min_new_tokens": 4000},
            rollout_max_context_len=None,
        )
        task = asyncio.ensure_future(rollout.run())
        for _ in range(1000):
            if client.generate_bodies:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await rollout.abort("weight_update")
        await task
        sent = len(client.generate_bodies)
    assert rollout.sample.status == Status.ABORTED
    assert rollout.sample.metadata["rollout_reason"] == "weight_update"
    # a second request means the first turn ended before the abort: say how, for the trace of a rare failure
    assert sent == 1, [(turn.finish, len(turn.token_ids)) for turn in client.turns]
    if engine.fake is not None:
        mine = [r for r in engine.fake.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == "abort-me"]
        assert len(mine) == 1


async def test_many_samples_at_once_all_end_with_aligned_arrays(engine: Engine) -> None:
    for i in range(12):
        engine.script(2, f"many-{i}")
    async with VLLMClient(engine.url) as client:
        rollouts = [
            make_rollout(engine, client, Sample(prompt=f"Question {i}", index=10 + i, session_id=f"many-{i}"))
            for i in range(12)
        ]
        samples = await asyncio.gather(*(rollout.run() for rollout in rollouts))
    for sample in samples:
        assert sample.status in (Status.TRUNCATED, Status.COMPLETED)
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
