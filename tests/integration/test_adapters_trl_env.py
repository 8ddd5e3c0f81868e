"""The trl adapter runs a TRL environment_factory class unchanged: reset(**row) extends the prompt, the public
methods are the tools (schemas as transformers builds them), tool calls run them, get_reward lands on the sample,
the replay is identical and inspect readable; reward functions as TRL calls them; broken classes are typed errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapters_support import inspect_text, replay_counts, run_recorded
from trl_envs import HiddenNumberEnv

from fsm_rollout import Sample
from fsm_rollout.adapters import trl_env
from fsm_rollout.errors import AdapterProtocolError
from fsm_rollout.testing.fake_vllm import ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process


def call(name: str, **arguments: Any) -> str:
    import json

    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


PROMPT = [{"role": "user", "content": "Find the hidden number."}]


def hidden(secret: int, index: int = 0) -> Sample:
    return Sample(index=index, prompt=list(PROMPT), metadata={"row": {"secret": secret}})


async def test_a_trl_environment_class_runs_its_tools_and_its_reward_lands_on_the_sample(
    tokenizer: Any, tmp_path: Path
) -> None:
    from transformers.utils import get_json_schema

    turns = [
        ScriptedTurn(text=call("probe", number=5)),
        ScriptedTurn(text=call("probe", number=7) + call("shout", text="hi") + "<tool_call>{oops</tool_call>"),
        ScriptedTurn(text="It is 7."),
    ]
    [sample] = await run_recorded(tokenizer, tmp_path, trl_env(HiddenNumberEnv), [hidden(7)], turns)
    assert sample.status.value == "completed", sample.metadata.get("rollout_error")
    assert sample.metadata["env_stop"] == "no_tool_calls"
    assert sample.reward == 0.5 and sample.metadata["trl"] == {"rewards": {"HiddenNumberEnv": 0.5}, "turns": 3}
    reset_text = " Use the probe tool to compare a number with the hidden one."
    assert sample.prompt == [{"role": "user", "content": "Find the hidden number." + reset_text}]
    assert sample.metadata["tools"] == [get_json_schema(HiddenNumberEnv().probe)]
    text = tokenizer.decode(sample.tokens)
    assert "<tool_response>\nhigher\n</tool_response>" in text
    assert "<tool_response>\nequal\n</tool_response>" in text
    assert "{'error': 'Tool shout not found.'}" in text
    assert "{'error': 'The tool call is not valid JSON" in text
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    shown = await inspect_text(tmp_path)
    assert "Use the probe tool" in shown and "equal" in shown


async def test_the_last_turn_the_rollout_allows_is_scored(tokenizer: Any, tmp_path: Path) -> None:
    turns = [ScriptedTurn(text=call("probe", number=3)), ScriptedTurn(text=call("probe", number=4))]
    [sample] = await run_recorded(tokenizer, tmp_path, trl_env(HiddenNumberEnv), [hidden(4)], turns, max_turns=2)
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "max_turns"
    assert sample.reward == 0.5


async def test_reward_functions_are_called_as_trl_calls_them(tokenizer: Any, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def probes_used(prompts: Any, completions: Any, environments: Any, **kwargs: Any) -> list[float]:
        seen.append({"prompts": prompts, "completions": completions, **kwargs})
        return [-0.1 * environments[0].probes]

    turns = [ScriptedTurn(text=call("probe", number=2)), ScriptedTurn(text="2")]
    [sample] = await run_recorded(
        tokenizer, tmp_path, trl_env(HiddenNumberEnv, reward_funcs=[probes_used]), [hidden(2)], turns
    )
    assert sample.reward == 1.0 - 0.1
    assert sample.metadata["trl"]["rewards"] == {"HiddenNumberEnv": 1.0, "probes_used": -0.1}
    [arguments] = seen
    assert arguments["secret"] == [2] and arguments["prompts"] == [PROMPT]
    assert [message["role"] for message in arguments["completions"][0]] == ["assistant", "tool", "assistant"]


class NoReset:
    def get_reward(self) -> float:
        return 0.0


class BadReward(HiddenNumberEnv):
    def get_reward(self) -> Any:
        return "high"


async def test_a_class_that_breaks_trls_protocol_fails_the_sample_naming_the_adapter_and_call(
    tokenizer: Any, tmp_path: Path
) -> None:
    done = await run_recorded(
        tokenizer,
        tmp_path,
        trl_env(NoReset),
        [Sample(index=0, prompt="p")],
        [ScriptedTurn(text="x")],
    )
    assert done[0].metadata["rollout_error"]["message"] == (
        "trl adapter: environment_factory() returned NoReset, which has no callable reset"
    )
    (tmp_path / "b").mkdir()
    [bad] = await run_recorded(tokenizer, tmp_path / "b", trl_env(BadReward), [hidden(1)], [ScriptedTurn(text="1")])
    assert bad.status.value == "failed"
    assert bad.metadata["rollout_error"]["type"] == AdapterProtocolError.__name__
    assert bad.metadata["rollout_error"]["message"] == (
        "trl adapter: get_reward returned the reward 'high', not a number"
    )


async def test_a_sample_its_budget_cuts_off_is_scored_as_it_stands(tokenizer: Any, tmp_path: Path) -> None:
    turns = [ScriptedTurn(text=call("probe", number=4)), ScriptedTurn(text="It is", finish="length")]
    [sample] = await run_recorded(tokenizer, tmp_path, trl_env(HiddenNumberEnv), [hidden(4)], turns)
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "length"
    assert sample.reward == 1.0 and sample.metadata["trl"]["rewards"] == {"HiddenNumberEnv": 1.0}
