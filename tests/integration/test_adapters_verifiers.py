"""The verifiers adapter runs verifiers environments unchanged, their own loop driven by our turns: a ToolEnv
calls its tool on the model's tool calls and its rubric scores the sample; a MultiTurnEnv game answers each guess
and ends on its own stop condition; the dataset rows become samples; the replay is identical and inspect readable;
a loop that raises is a typed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapters_support import inspect_text, replay_counts, run_recorded
from verifiers_envs import load_game_environment, load_tool_environment

from fsm_rollout.adapters import verifiers_env, verifiers_samples
from fsm_rollout.errors import AdapterProtocolError, EnvironmentContractError
from fsm_rollout.testing.fake_vllm import ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

MULTIPLY = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


def test_the_dataset_rows_become_samples_with_the_system_prompt_and_the_answer_as_label() -> None:
    samples = verifiers_samples(load_tool_environment())
    assert [sample.label for sample in samples] == ["42", "15"]
    assert samples[0].prompt == [
        {"role": "system", "content": "Use the multiply tool, then answer with the number only."},
        {"role": "user", "content": "What is 6 times 7?"},
    ]
    assert samples[1].metadata["verifiers_row"] == {"answer": "15", "example_id": 1}


async def test_a_tool_env_runs_its_tool_on_our_tool_call_and_its_rubric_scores_the_sample(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = load_tool_environment()
    samples = verifiers_samples(env, n=1)
    turns = [ScriptedTurn(text=MULTIPLY), ScriptedTurn(text="42")]
    [sample] = await run_recorded(tokenizer, tmp_path, verifiers_env(env), samples, turns)
    assert sample.status.value == "completed", sample.metadata.get("rollout_error")
    assert sample.metadata["env_stop"] == "no_tools_called"
    record = sample.metadata["verifiers"]
    assert record["stop_condition"] == "no_tools_called" and record["error"] is None
    assert record["metrics"]["correct_answer"] == 1.0 and record["metrics"]["used_few_tools"] == 1.0
    assert record["metrics"]["total_tool_calls"] == 1.0 and record["metrics"]["num_turns"] == 2.0
    assert sample.reward == 1.5
    assert sample.metadata["tools"][0]["function"]["name"] == "multiply"
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(sample.tokens)
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    shown = await inspect_text(tmp_path)
    assert "What is 6 times 7?" in shown and "reward 1.5" in shown


async def test_a_wrong_tool_call_goes_back_to_the_model_as_the_tool_env_words_it(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = load_tool_environment()
    turns = [
        ScriptedTurn(text='<tool_call>{"name": "multiply", "arguments": {"a": 6}}</tool_call>'),
        ScriptedTurn(text="<tool_call>{not json</tool_call>"),
        ScriptedTurn(text="41"),
    ]
    [sample] = await run_recorded(tokenizer, tmp_path, verifiers_env(env), verifiers_samples(env, n=1), turns)
    text = tokenizer.decode(sample.tokens)
    assert "missing 1 required positional argument: 'b'" in text and "Expecting property name" in text
    assert sample.reward == 0.0 and sample.metadata["verifiers"]["metrics"]["used_few_tools"] == 0.0


async def test_a_multi_turn_game_ends_on_its_own_stop_condition_with_its_state_in_metadata(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = load_game_environment()
    turns = [ScriptedTurn(text="beaver"), ScriptedTurn(text="otter")]
    [sample] = await run_recorded(tokenizer, tmp_path, verifiers_env(env), verifiers_samples(env), turns)
    assert sample.status.value == "completed", sample.metadata.get("rollout_error")
    assert sample.metadata["env_stop"] == "word_found"
    assert sample.reward == 1.0 and sample.metadata["verifiers"]["metrics"]["quick"] == 0.5
    assert sample.metadata["verifiers"]["state"]["wrong_guesses"] == 1
    assert "'beaver' is cold. Guess again." in tokenizer.decode(sample.tokens)
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}


async def test_the_rollouts_turn_limit_stops_the_loop_and_scores_it_as_it_stands(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = load_game_environment()
    turns = [ScriptedTurn(text="cat"), ScriptedTurn(text="dog")]
    [sample] = await run_recorded(tokenizer, tmp_path, verifiers_env(env), verifiers_samples(env), turns, max_turns=2)
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "max_turns"
    assert sample.reward == 0.0 and sample.metadata["verifiers"]["state"]["wrong_guesses"] == 2
    assert "env_stop" not in sample.metadata


async def test_an_env_response_that_raises_fails_the_sample_naming_the_adapter_and_call(
    tokenizer: Any, tmp_path: Path
) -> None:
    env = load_game_environment()

    async def broken(messages: Any, state: Any, **_: Any) -> Any:
        raise KeyError("board")

    env.env_response = broken  # type: ignore[method-assign]
    [sample] = await run_recorded(
        tokenizer, tmp_path, verifiers_env(env), verifiers_samples(env), [ScriptedTurn(text="cat")]
    )
    assert sample.status.value == "failed"
    assert sample.metadata["rollout_error"]["type"] == AdapterProtocolError.__name__
    assert sample.metadata["rollout_error"]["message"] == "verifiers adapter: env_response raised KeyError: 'board'"


def test_only_verifiers_environments_are_taken() -> None:
    with pytest.raises(EnvironmentContractError, match="verifiers_env takes a verifiers MultiTurnEnv"):
        verifiers_env(object())


async def test_a_sample_its_budget_cuts_off_is_scored_as_it_stands(tokenizer: Any, tmp_path: Path) -> None:
    env = load_game_environment()
    turns = [ScriptedTurn(text="beaver"), ScriptedTurn(text="ott", finish="length")]
    [sample] = await run_recorded(tokenizer, tmp_path, verifiers_env(env), verifiers_samples(env), turns)
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "length"
    assert sample.reward == 0.0 and sample.metadata["verifiers"]["metrics"]["quick"] == 0.5
