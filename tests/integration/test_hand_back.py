"""Hand-back as an edge: a suspended sample that goes back to its caller leaves through ``suspended --hand_back-->
aborted`` (reason ``handed_back``), traced and recorded like every transition; its environment is snapshotted
into the resume state and closed, so nothing is held for a sample the caller drops; a resume rebuilds the
environment from the snapshot and ends where the uninterrupted rollout ends. Against the fake vLLM server; the
suspension lands where the server holds the request, so nothing depends on timing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample, capture_transitions, get_tracer
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.errors import ResumeError
from fsm_rollout.recording import recorded_rollout
from fsm_rollout.replay import replay_async
from fsm_rollout.rollout import Rollout
from fsm_rollout.sample import Status
from fsm_rollout.testing.envs import ScriptedEnv, ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.weights.suspension import HandBack, Suspender

SAMPLING = {"max_new_tokens": 60, "temperature": 0.0, "top_p": 1.0}
TEXT = "The angle is seventy degrees, so the answer is 70."


class HandingBack(Suspender):
    """A gate that hands a suspended rollout back instead of letting it wait (``partial_rollout``)."""

    async def wait_resumed(self) -> None:
        if self.suspended:
            raise HandBack


@dataclass
class SnapshotEnv(ScriptedEnv):
    restored: list[Any] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        return {"texts": list(self.texts)}

    def restore(self, state: Any) -> None:
        self.restored.append(state)


@dataclass
class SnapshotEnvFactory(ScriptedEnvFactory):
    def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
        env = SnapshotEnv(steps=list(self.steps), default=self.default)
        self.built.append(env)
        return env


def config(server: FakeVLLMServer, **overrides: Any) -> RolloutConfig:
    return RolloutConfig(
        **{
            "engine_url": server.url,
            "model": server.model,
            "max_turns": 1,
            "router_policy": "consistent_hash",
            "check_invariants": True,
            **overrides,
        }
    )


def outcome(sample: Sample) -> tuple[Any, ...]:
    return (sample.tokens, sample.loss_mask, sample.rollout_log_probs, sample.status, sample.response)


async def handed_back(
    server: FakeVLLMServer, client: VLLMClient, envs: ScriptedEnvFactory, **config_overrides: Any
) -> tuple[Sample, HandingBack, Rollout]:
    server.script([ScriptedTurn(text=TEXT, hang=True, held_after=4)], session="s0")
    gate = HandingBack(lambda: [client])
    sample = Sample(prompt="p", index=0, session_id="s0")
    build = recorded_rollout if config_overrides.get("record") else Rollout
    rollout = build(
        sample,
        config=config(server, **config_overrides),
        sampling_params=SAMPLING,
        client=client,
        tokenizer=server.tokenizer,
        env_factory=envs,
        suspender=gate,
    )
    run = asyncio.ensure_future(rollout.run())
    await server.wait_until_waiting(1)
    await gate.suspend()
    assert await run is sample
    return sample, gate, rollout


async def test_a_handed_back_sample_leaves_by_the_edge_and_its_environment_is_closed(tokenizer: Any) -> None:
    envs = SnapshotEnvFactory()
    async with FakeVLLMServer(tokenizer) as server, VLLMClient(server.url) as client:
        with capture_transitions() as events:
            sample, _, rollout = await handed_back(server, client, envs)
    assert (rollout.state, rollout.reason) == ("aborted", "handed_back")
    assert sample.status == Status.ABORTED and sample.metadata["rollout_reason"] == "handed_back"
    last = events[-1]
    assert (last["src"], last["trigger"], last["dst"], last["reason"]) == (
        "suspended",
        "hand_back",
        "aborted",
        "handed_back",
    )
    assert last["suspend_reason"] == "weight_update" and last["partial_tokens"] == 4
    state = sample.metadata["resume_state"]
    assert json.loads(json.dumps(state)) == state
    assert state["env_snapshot"] == {"texts": []} and state["state"] == "suspended"
    assert envs.last.close_count == 1  # closed at hand-back: nothing is left for a caller that drops the sample


async def test_a_handed_back_sample_resumes_to_the_uninterrupted_result(tokenizer: Any) -> None:
    async with FakeVLLMServer(tokenizer) as server, VLLMClient(server.url) as client:
        server.script([ScriptedTurn(text=TEXT)], session="s0")
        reference = await Rollout(
            Sample(prompt="p", index=0, session_id="s0"),
            config=config(server),
            sampling_params=SAMPLING,
            client=client,
            tokenizer=tokenizer,
            env_factory=SnapshotEnvFactory(),
        ).run()
        envs = SnapshotEnvFactory()
        sample, gate, _ = await handed_back(server, client, envs)
        await gate.resume()
        with capture_transitions() as events:
            resumed = await Rollout(
                sample,
                config=config(server),
                sampling_params=SAMPLING,
                client=client,
                tokenizer=tokenizer,
                env_factory=envs,
                suspender=gate,
            ).run()
    assert outcome(resumed) == outcome(reference)
    assert "resume_state" not in resumed.metadata
    assert [event["trigger"] for event in events][:1] == ["resume"]
    assert len(envs.built) == 2 and envs.built[1].restored == [{"texts": []}]  # rebuilt from the snapshot
    assert [env.close_count for env in envs.built] == [1, 1]


async def test_an_environment_without_a_snapshot_is_closed_and_the_resume_says_why(tokenizer: Any) -> None:
    envs = ScriptedEnvFactory()
    async with FakeVLLMServer(tokenizer) as server, VLLMClient(server.url) as client:
        sample, gate, _ = await handed_back(server, client, envs)
        await gate.resume()
        assert envs.last.close_count == 1
        with pytest.raises(ResumeError, match="ScriptedEnv has no snapshot"):
            Rollout(
                sample,
                config=config(server),
                sampling_params=SAMPLING,
                client=client,
                tokenizer=tokenizer,
                env_factory=envs,
                suspender=gate,
            )
    assert "resume_state" in sample.metadata  # nothing of the sample is lost


async def test_a_recorded_hand_back_replays_identically(tokenizer: Any, tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    async with FakeVLLMServer(tokenizer) as server, VLLMClient(server.url) as client:
        await handed_back(server, client, SnapshotEnvFactory(), trace=str(trace), record=True)
    get_tracer(str(trace)).close()  # the sink is shared per path: close it before reading
    report = await replay_async(trace, tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 1}
