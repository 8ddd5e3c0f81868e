"""Over-sampling, dynamic sampling and staleness pacing on the runner's ``run_batch`` and ``stream``, against the
fake vLLM server with held requests (no sleeps, no timing)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.cli.inspect import render_summary, summarize
from fsm_rollout.errors import ConfigError
from fsm_rollout.machine.lifecycle import OVERSAMPLED
from fsm_rollout.replay.paths import TracedPath
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.runtime.sampling import GROUP_KEPT, SampledBatch
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}


RIGHT: set[str] = set()
"""The sessions scripted to answer right (the reward is scored before the response text is finalized)."""


@pytest.fixture(autouse=True)
def _fresh_answers() -> None:
    RIGHT.clear()


def right_answer(sample: Sample) -> float:
    return 1.0 if sample.session_id in RIGHT else 0.0


def rewards_vary(group: Any) -> bool:
    return len({sample.reward for sample in group}) > 1


def runner_for(server: FakeVLLMServer, tokenizer: Any, envs: ScriptedEnvFactory, **config: Any) -> RolloutRunner:
    settings: dict[str, Any] = {"max_turns": 1, "reward_fn": right_answer, "router_policy": "consistent_hash", **config}
    return RolloutRunner(RolloutConfig(engine_url=server.url, model="fake-model", **settings),
                         sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=envs)  # fmt: skip


def groups(count: int, members: int = 2) -> list[Sample]:
    return [Sample(prompt=f"question {g}", index=g * members + m, group_index=g, session_id=f"g{g}m{m}")
            for g in range(count) for m in range(members)]  # fmt: skip


def script(server: FakeVLLMServer, group: int, *answers: str | list[ScriptedTurn]) -> None:
    for member, answer in enumerate(answers):
        turns = [ScriptedTurn(text=answer)] if isinstance(answer, str) else answer
        if any(turn.text == "right" for turn in turns):
            RIGHT.add(f"g{group}m{member}")
        server.script(turns, session=f"g{group}m{member}")


def sessions_sent(server: FakeVLLMServer) -> set[str]:
    return {str(request.body["request_id"]).split("-")[0] for request in server.requests_to(GENERATE_PATH)}


async def test_the_surplus_groups_end_aborted_oversampled_with_their_data_kept_and_envs_closed_once(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    envs = ScriptedEnvFactory(steps=[("tool says 4", False), ("ok", True)])
    script(fake_vllm, 0, *([[ScriptedTurn(text="first"), ScriptedTurn(text="right", hang=True)]] * 2))
    script(fake_vllm, 1, *([[ScriptedTurn(text="partial"), ScriptedTurn(text="never", hang=True)]] * 2))
    script(fake_vllm, 2, *([[ScriptedTurn(text="never", hang=True)]] * 2))
    async with runner_for(fake_vllm, tokenizer, envs, max_turns=3) as runner:
        batch = asyncio.ensure_future(runner.run_batch(groups(4), target_groups=1, oversample=2))
        await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 6)  # 3 groups started, the 4th not
        for member in (0, 1):
            fake_vllm.release(f"g0m{member}-turn1")
        done = await batch
        snapshot = runner.metrics()
    assert isinstance(done, SampledBatch)
    assert (done.kept_groups, done.surplus_groups, done.dropped_groups, done.prompts_exhausted) == (1, 2, 0, False)
    assert [sample.group_index for sample in done] == [0, 0, 1, 1, 2, 2]  # the 4th group never started
    assert [sample.status for sample in done.kept] == [Status.COMPLETED] * 2
    surplus = [sample for sample in done if sample.group_index in (1, 2)]
    assert {(sample.status, sample.metadata["rollout_reason"]) for sample in surplus} == {(Status.ABORTED, OVERSAMPLED)}
    assert all(sample.metadata[GROUP_KEPT] is False for sample in surplus)
    assert all(sample.response.startswith("partial") for sample in surplus[:2])  # the first turn is kept
    assert all(sample.response_length > 0 for sample in surplus[:2])
    assert [env.close_count for env in envs.built] == [1] * 6
    assert "g3m0" not in sessions_sent(fake_vllm)
    assert snapshot.reasons[OVERSAMPLED] == 4


@pytest.mark.parametrize("how", ["run_batch", "stream"])
async def test_keep_group_drops_groups_without_signal_and_starts_the_next_prompt(
    fake_vllm: FakeVLLMServer, tokenizer: Any, how: str
) -> None:
    script(fake_vllm, 0, "wrong", "wrong")  # no signal: dropped
    script(fake_vllm, 1, "right", "wrong")  # kept
    batch = groups(3)
    async with runner_for(fake_vllm, tokenizer, ScriptedEnvFactory(steps=[("ok", True)])) as runner:
        if how == "run_batch":
            done: list[Sample] = await runner.run_batch(batch, concurrency=4, target_groups=1, keep_group=rewards_vary)
        else:
            stream = runner.stream(batch, concurrency=4, target_groups=1, keep_group=rewards_vary)
            done = [sample async for sample in stream]
            assert stream.prompts_exhausted is False  # type: ignore[attr-defined]
    assert [(s.group_index, s.metadata[GROUP_KEPT]) for s in done] == [(0, False), (0, False), (1, True), (1, True)]
    assert [s.reward for s in done] == [0.0, 0.0, 1.0, 0.0]
    assert all(sample.status == Status.COMPLETED for sample in done)
    assert [sample.status for sample in batch[4:]] == [Status.PENDING] * 2  # the third prompt was not needed
    assert sessions_sent(fake_vllm) == {"g0m0", "g0m1", "g1m0", "g1m1"}


async def test_when_the_prompts_run_out_it_returns_what_it_has_and_says_so(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script(fake_vllm, 0, "wrong", "wrong")
    script(fake_vllm, 1, "right", "wrong")
    trace = tmp_path / "run.jsonl"
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    with caplog.at_level(logging.WARNING):
        async with runner_for(fake_vllm, tokenizer, envs, trace=str(trace)) as runner:
            done = await runner.run_batch(groups(2), target_groups=2, oversample=1, keep_group=rewards_vary)
    assert isinstance(done, SampledBatch)
    assert (done.prompts_exhausted, done.kept_groups, done.dropped_groups) == (True, 1, 1)
    assert [sample.group_index for sample in done.kept] == [1, 1]
    assert len(done) == 4 and all(sample.status == Status.COMPLETED for sample in done)
    assert any("prompts ran out" in record.getMessage() for record in caplog.records)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    exhausted = [event for event in events if event["event"] == "groups_exhausted"]
    assert [(e["target_groups"], e["kept_groups"], e["dropped_groups"]) for e in exhausted] == [(2, 1, 1)]


async def test_an_abort_starts_no_further_group(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    script(fake_vllm, 0, *([[ScriptedTurn(text="never", hang=True)]] * 2))
    async with runner_for(fake_vllm, tokenizer, ScriptedEnvFactory(steps=[("ok", True)])) as runner:
        batch = asyncio.ensure_future(runner.run_batch(groups(3), target_groups=1, keep_group=rewards_vary))
        await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 2)
        await runner.abort("cancelled")
        done = await batch
    assert isinstance(done, SampledBatch)
    assert [(s.group_index, s.metadata["rollout_reason"]) for s in done] == [(0, "cancelled"), (0, "cancelled")]
    assert done.prompts_exhausted is False  # aborted, not out of prompts
    assert sessions_sent(fake_vllm) == {"g0m0", "g0m1"}


def test_sampling_arguments_are_checked() -> None:
    from fsm_rollout.runtime.sampling import GroupTarget

    with pytest.raises(ConfigError, match="need target_groups"):
        GroupTarget.of(None, 2, None)
    with pytest.raises(ConfigError, match="target_groups must be a positive integer"):
        GroupTarget.of(0, 0, None)
    with pytest.raises(ConfigError, match="oversample must be"):
        GroupTarget.of(1, -1, None)
    with pytest.raises(ConfigError, match="max_staleness"):
        RolloutConfig(engine_url="http://x", model="m", max_turns=1, max_staleness=-1)


async def test_max_staleness_holds_a_new_group_until_the_trainer_consumes_and_never_drops_a_finished_one(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Path
) -> None:
    # the weight update cuts g0m0's held request; the suspended turn then goes on with the next answer
    script(fake_vllm, 0, [ScriptedTurn(text="never", hang=True), ScriptedTurn(text="right")], "wrong")
    script(fake_vllm, 1, "right", "wrong")
    trace = tmp_path / "run.jsonl"
    batch = groups(2)
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs, max_staleness=1, trace=str(trace)) as runner:
        runner.consumed(0)
        first = asyncio.ensure_future(runner.run_batch(batch[:2]))
        await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
        async with runner.weight_update(version="2"):  # the trainer is now two versions past what it consumed
            pass
        second = asyncio.ensure_future(runner.run_batch(batch[2:]))
        await runner.pacing.held.wait()
        finished = await first  # in flight when the weights moved on: finished, not dropped
        assert not second.done() and "g1m0" not in sessions_sent(fake_vllm)
        assert runner.pacing.waiting == 2
        runner.consumed(1)
        later = await second
    assert [sample.status for sample in finished] == [Status.COMPLETED] * 2
    assert [sample.reward for sample in finished] == [1.0, 0.0]
    assert [sample.status for sample in later] == [Status.COMPLETED] * 2
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    waits = [event for event in events if event["event"] == "staleness_wait"]
    assert [(w["weight_version"], w["consumed_version"], w["ahead"], w["max_staleness"]) for w in waits] == [
        (2, 1, 2, 1)
    ]
    transitions = [event for event in events if event["event"] == "transition"]
    first_of: dict[str, dict[str, Any]] = {}
    for event in transitions:
        first_of.setdefault(str(event["sample_id"]), event)
    assert "staleness_ms" not in first_of["0"] and "staleness_ms" not in first_of["1"]
    assert first_of["2"]["staleness_ms"] >= 0.0 and first_of["3"]["staleness_ms"] >= 0.0
    paths = [TracedPath(sample_id=key, session_id=None, events=[e for e in transitions if str(e["sample_id"]) == key])
             for key in sorted(first_of)]  # fmt: skip
    summary = render_summary("trace", summarize(paths), [])
    row = next(line for line in summary.splitlines() if "staleness wait" in line)
    assert row.split()[2] == "2"  # n: both samples of the held group


async def test_a_group_that_started_is_not_held_up_again(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    script(fake_vllm, 0, [ScriptedTurn(text="never", hang=True), ScriptedTurn(text="right")], "wrong")
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs, max_staleness=0) as runner:
        runner.consumed(0)
        # one slot: the second member queues behind the first; the weights move on while it does
        batch = asyncio.ensure_future(runner.run_batch(groups(1), concurrency=1))
        await fake_vllm.wait_until(lambda: len(fake_vllm.held_request_ids) == 1)
        async with runner.weight_update(version="3"):
            pass
        done = await batch
    assert [sample.status for sample in done] == [Status.COMPLETED] * 2
    assert runner.pacing.waits == 0
