"""The built-in calculator environment: an async, tool-using episode with several calls per turn and a reward."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample
from fsm_rollout.envs.calculator import TOOLS, CalculatorError, build_env, evaluate
from fsm_rollout.envs.protocol import load_env_factory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.tokens.parity import check_template_parity

SAMPLING = {"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0}


def call(expression: str) -> str:
    return (
        "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"
    )


@pytest.mark.parametrize(
    ("expression", "value"), [("(3 + 4) * 12", 84), ("2 ** 10", 1024), ("7 / 2", 3.5), ("-5 % 3", 1), ("17 // 5", 3)]
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "x + 1", "2 ** 1000", "1 / 0", "", "[1, 2]", "9" * 300, "True + 1"]
)
def test_the_calculator_refuses_anything_else_with_a_reason(expression: str) -> None:
    with pytest.raises(CalculatorError):
        evaluate(expression)


async def test_one_turn_with_several_calls_gives_one_result_each_then_the_answer_is_scored() -> None:
    sample = Sample(prompt="What is (3 + 4) * 12?", label="84")
    env = await build_env(sample=sample, args=SimpleNamespace(max_turns=3, calculator_delay_s=0.01))
    assert sample.metadata["tools"] == TOOLS
    await env.reset()
    results, done, info = await env.step(f"Let me compute. {call('3 + 4')} {call('7 * 12')} {call('1/0')}")
    assert not done and info["calls"] == 3
    messages = await env.format_observation(results)
    assert [message["content"] for message in messages] == ["7", "84", "error: division by zero"]
    assert all(message["role"] == "tool" for message in messages)
    _, done, info = await env.step("So the answer is \\boxed{84}.")
    assert done and info["reward"] == 1.0


async def test_malformed_calls_are_reported_to_the_model_not_raised() -> None:
    env = await build_env(sample=Sample(prompt="q", label="1"), args=SimpleNamespace(max_turns=2))
    results, done, _ = await env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
    assert not done and results[0]["content"].startswith("error:")


def test_the_environment_loads_as_a_module() -> None:
    assert load_env_factory("fsm_rollout.envs.calculator") is build_env


async def test_a_tool_calling_rollout_on_the_fake_server_earns_its_reward_and_keeps_template_parity(
    tokenizer: Any,
) -> None:
    turns = [
        ScriptedTurn(text=f"I will use the tool. {call('3 + 4')}{call('7 * 12')}"),
        ScriptedTurn(text="The answer is \\boxed{84}."),
    ]
    async with FakeVLLMServer(tokenizer) as server:
        server.script(turns)
        config = RolloutConfig(
            engine_url=server.url,
            model=server.model,
            max_turns=3,
            check_invariants=True,
            env_path="fsm_rollout.envs.calculator",
        )
        async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer) as runner:
            sample = await runner.run(Sample(prompt="What is (3 + 4) * 12?", label="84", index=0))
        render = server.requests_to("/v1/chat/completions/render")[0]
        assert render.body["tools"] == TOOLS
    assert sample.status.value == "completed" and sample.reward == 1.0
    observation = sample.metadata["observations"][0]
    assert [message["content"] for message in observation["messages"]] == ["7", "84"]
    report = check_template_parity(sample, tokenizer)
    assert report.ok, report.describe()


async def test_slow_async_steps_of_many_samples_overlap(tokenizer: Any) -> None:
    """A step that awaits its delay leaves the loop to the other samples: their steps overlap (checked by counting
    steps in progress at once, not by timing)."""
    in_progress = 0
    peak = 0
    release = asyncio.Event()

    class Counting:
        def __init__(self, env: Any) -> None:
            self.env = env

        def __getattr__(self, name: str) -> Any:
            return getattr(self.env, name)

        async def step(self, text: str) -> Any:
            nonlocal in_progress, peak
            in_progress += 1
            peak = max(peak, in_progress)
            if peak >= 4:
                release.set()
            await asyncio.wait_for(release.wait(), 30)
            in_progress -= 1
            return await self.env.step(text)

    async def counting_env(*, sample: Any, args: Any) -> Any:
        return Counting(await build_env(sample=sample, args=args))

    async with FakeVLLMServer(tokenizer) as server:
        server.script([ScriptedTurn(text="\\boxed{84}")] * 4)
        config = RolloutConfig(engine_url=server.url, model=server.model, max_turns=2)
        async with RolloutRunner(
            config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=counting_env
        ) as runner:
            samples = await runner.run_batch([Sample(prompt="q", label="84", index=i) for i in range(4)])
    assert peak == 4
    assert [sample.reward for sample in samples] == [1.0] * 4


async def test_a_recorded_tool_calling_run_replays_identically(tokenizer: Any, tmp_path: Any) -> None:
    from fsm_rollout import get_tracer
    from fsm_rollout.replay import replay_async

    turns = [
        ScriptedTurn(text=f"Tools first. {call('6 * 7')}{call('40 + 2')}{call('2 ** 5')}"),
        ScriptedTurn(text="\\boxed{42}"),
    ]
    async with FakeVLLMServer(tokenizer) as server:
        server.script(turns)
        config = RolloutConfig(
            engine_url=server.url,
            model=server.model,
            max_turns=3,
            env_path="fsm_rollout.envs.calculator",
            trace=str(tmp_path / "run.jsonl"),
            record=True,
        )
        async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer) as runner:
            sample = await runner.run(Sample(prompt="What is 6 * 7?", label="42", index=0))
    assert sample.reward == 1.0
    get_tracer(str(tmp_path / "run.jsonl")).close()
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 1}
