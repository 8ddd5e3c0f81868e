"""The skyrl adapter runs skyrl-gym's built-in environments unchanged: gsm8k_multi_turn over two turns with its
per-turn rewards summed onto the sample, the replay identical and inspect readable; a broken step is a typed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapters_support import inspect_text, replay_counts, run_recorded

from fsm_rollout import Sample
from fsm_rollout.adapters import skyrl_env
from fsm_rollout.errors import AdapterProtocolError, EnvironmentNotFoundError
from fsm_rollout.testing.fake_vllm import ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

QUESTION = "Tom has 40 apples and buys 2 more. How many apples does he have?"


async def test_gsm8k_multi_turn_runs_two_turns_with_per_turn_rewards_summed(tokenizer: Any, tmp_path: Path) -> None:
    turns = [ScriptedTurn(text="I think #### 41"), ScriptedTurn(text="Sorry: #### 42")]
    sample = Sample(index=0, prompt=QUESTION, label="42", metadata={"extras": {"max_turns": 3}})
    [done] = await run_recorded(tokenizer, tmp_path, skyrl_env("gsm8k_multi_turn"), [sample], turns)
    assert done.status.value == "completed", done.metadata.get("rollout_error")
    assert done.metadata["env_stop"] == "done" and done.metadata["rollout_reason"] == "env_done"
    format_score = 0.2 / 3  # the environment's own: well formatted but wrong, per turn
    assert done.metadata["skyrl"]["rewards"] == [pytest.approx(format_score), 1.0]
    assert done.reward == pytest.approx(1.0 + format_score)
    assert done.metadata["skyrl"]["metrics"] == {"steps": 2}
    assert done.prompt == [{"role": "user", "content": QUESTION}]
    assert "include a tentative numeric answer" in tokenizer.decode(done.tokens)  # its observation
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    shown = await inspect_text(tmp_path)
    assert "Tom has 40 apples" in shown and "tentative numeric answer" in shown


async def test_gsm8k_single_turn_scores_the_answer_with_the_label_as_ground_truth(
    tokenizer: Any, tmp_path: Path
) -> None:
    samples = [Sample(index=0, prompt=QUESTION, label="42"), Sample(index=1, prompt=QUESTION, label="7")]
    done = await run_recorded(tokenizer, tmp_path, skyrl_env("gsm8k"), samples, [ScriptedTurn(text="#### 42")] * 2)
    assert [(sample.status.value, sample.reward) for sample in done] == [("completed", 1.0), ("completed", 0.0)]


class NotADict:
    def __init__(self, env_config: Any = None, extras: Any = None) -> None:
        pass

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> list[Any]:
        return [[], 1.0, True]

    def close(self) -> None:
        pass


async def test_a_step_that_is_not_skyrls_dict_fails_the_sample_naming_adapter_and_call(
    tokenizer: Any, tmp_path: Path
) -> None:
    [done] = await run_recorded(
        tokenizer, tmp_path, skyrl_env(NotADict), [Sample(index=0, prompt="q")], [ScriptedTurn(text="a")]
    )
    assert done.status.value == "failed"
    assert done.metadata["rollout_error"]["message"] == (
        "skyrl adapter: env.step returned list, not a dict of observations, reward, done, metadata"
    )
    assert done.metadata["rollout_error"]["type"] == AdapterProtocolError.__name__


def test_an_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(EnvironmentNotFoundError, match=r"no skyrl-gym environment is registered as 'nope'.*gsm8k"):
        skyrl_env("nope")
