"""The built-in Geo3K environment: tool-call parsing, answer grading, feedback, done rules and the reward."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.envs.geo3k import Geo3KEnv, Geo3KSetupError, answers_match, build_env, extract_boxed
from fsm_rollout.envs.protocol import check_environment, load_env_factory, unpack_step_result


def make_env(label: Any = "70", max_turns: int = 3) -> tuple[Geo3KEnv, Sample]:
    sample = Sample(prompt="<image>question", label=label, index=7)
    env = build_env(sample=sample, args=SimpleNamespace(max_turns=max_turns))
    env.reset()
    return env, sample


def call(answer: Any, name: str = "calc_score") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"answer": answer}}) + "</tool_call>"


# --- building ---------------------------------------------------------------------------------------------------


def test_module_loads_as_an_environment_module() -> None:
    factory = load_env_factory("fsm_rollout.envs.geo3k")
    env = factory(sample=Sample(label="5"), args=SimpleNamespace(max_turns=2))
    assert check_environment(env) is env


def test_build_env_reads_max_turns_from_a_rollout_config() -> None:
    config = RolloutConfig(engine_url="http://127.0.0.1:1", model="m", max_turns=4)
    env = build_env(sample=Sample(label="5"), args=config)
    assert env.max_turns == 4


@pytest.mark.parametrize("label", [None, "", "   "])
def test_build_env_requires_a_label_and_names_the_sample(label: Any) -> None:
    with pytest.raises(Geo3KSetupError, match=r"index=3.*sample\.label"):
        build_env(sample=Sample(label=label, index=3), args=SimpleNamespace(max_turns=2))


def test_missing_label_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        build_env(sample=Sample(), args=SimpleNamespace(max_turns=2))


@pytest.mark.parametrize("args", [SimpleNamespace(), SimpleNamespace(max_turns=None), SimpleNamespace(max_turns=0)])
def test_build_env_requires_max_turns(args: Any) -> None:
    with pytest.raises(Geo3KSetupError, match="max_turns"):
        build_env(sample=Sample(label="5"), args=args)


def test_numeric_label_is_accepted() -> None:
    env, _ = make_env(label=70)
    observation, _, _ = env.step(call("70"))
    assert observation.startswith("Correct (score 1.0).")


# --- grading ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("70", "70"),
        ("70.0", "70"),
        ("70^\\circ", "70"),
        ("70^{\\circ}", "70"),
        ("70°", "70"),
        ("70 degrees", "70"),
        ("\\boxed{70}", "70"),
        ("$70$", "70"),
        ("x = 70", "70"),
        ("5 cm", "5"),
        ("40 \\text{cm}^2", "40"),
        ("40 square units", "40"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\frac12", "0.5"),
        ("\\frac{\\sqrt{3}}{2}", "0.8660254"),
        ("2\\sqrt{2}", "2.828427"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\sqrt[3]{27}", "3"),
        ("12\\pi", "12\\pi"),
        ("12π", "12\\pi"),
        ("37.7", "12\\pi"),
        ("37.70", "12\\pi"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("3 \\times 4", "12"),
        ("70.00001", "70"),
        ("0.0000005", "0"),
        ("ABC", "abc"),
    ],
)
def test_equivalent_answers_match(answer: str, label: str) -> None:
    assert answers_match(answer, label)


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("71", "70"),
        ("70.1", "70"),
        ("37.6", "12\\pi"),
        ("12", "12\\pi"),
        ("\\frac{1}{3}", "0.5"),
        ("", "70"),
        ("seventy", "70"),
        ("0.00001", "0"),
    ],
)
def test_different_answers_do_not_match(answer: str, label: str) -> None:
    assert not answers_match(answer, label)


def test_extract_boxed_balances_braces_and_takes_the_last() -> None:
    assert extract_boxed("first \\boxed{1} then \\boxed{\\frac{3}{4}} done") == "\\frac{3}{4}"
    assert extract_boxed("no answer here") is None


# --- steps ------------------------------------------------------------------------------------------------------


def test_step_returns_a_three_tuple() -> None:
    env, _ = make_env()
    result = env.step(call("70"))
    assert isinstance(result, tuple)
    assert len(result) == 3
    unpack_step_result(result)


def test_correct_answer_scores_one_and_is_not_done() -> None:
    env, sample = make_env()
    observation, done, info = env.step("The angles sum to 180. " + call("70"))
    assert observation.startswith("Correct (score 1.0).")
    assert not done
    assert info["score"] == 1.0
    assert sample.reward == 1.0


def test_incorrect_answer_asks_for_a_corrected_call() -> None:
    env, sample = make_env()
    observation, done, info = env.step(call("60"))
    assert observation == ("Incorrect (score 0.0). Check your work and call calc_score again with a corrected answer.")
    assert not done
    assert info["score"] == 0.0
    assert sample.reward == 0.0


def test_latex_answer_in_a_tool_call_is_graded() -> None:
    env, _ = make_env(label="12\\pi")
    observation, _, _ = env.step(call("\\boxed{12\\pi}"))
    assert observation.startswith("Correct")


def test_latex_written_with_single_backslashes_in_the_json_is_read_as_latex() -> None:
    env, _ = make_env(label="0.5")
    observation, _, info = env.step(
        '<tool_call>{"name": "calc_score", "arguments": {"answer": "\\frac{1}{2}"}}</tool_call>'
    )
    assert info["answer"] == "\\frac{1}{2}"
    assert observation.startswith("Correct")


def test_numeric_answer_argument_is_accepted() -> None:
    env, _ = make_env()
    observation, _, _ = env.step(call(70))
    assert observation.startswith("Correct")


def test_last_tool_call_wins() -> None:
    env, _ = make_env()
    _, _, info = env.step(call("70") + " wait, no: " + call("60"))
    assert info["answer"] == "60"
    assert info["score"] == 0.0


def test_an_unclosed_last_tool_call_is_read_to_the_end() -> None:
    env, _ = make_env()
    _, _, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "70"}}')
    assert info["score"] == 1.0


def test_arguments_may_be_a_json_string() -> None:
    env, _ = make_env()
    text = (
        "<tool_call>" + json.dumps({"name": "calc_score", "arguments": json.dumps({"answer": "70"})}) + "</tool_call>"
    )
    observation, _, _ = env.step(text)
    assert observation.startswith("Correct")


def test_calc_geo3k_reward_is_the_same_tool() -> None:
    env, _ = make_env()
    observation, _, _ = env.step(call("70", name="calc_geo3k_reward"))
    assert observation.startswith("Correct")


def test_unsupported_tool_gets_feedback_naming_it() -> None:
    env, sample = make_env()
    observation, done, info = env.step(call("70", name="search"))
    assert "Unsupported tool 'search'" in observation
    assert "calc_score" in observation
    assert not done
    assert info["score"] is None
    assert sample.metadata["geo3k"]["scores"] == []


def test_malformed_json_gets_feedback() -> None:
    env, _ = make_env()
    observation, done, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": </tool_call>')
    assert "not valid JSON" in observation
    assert '<tool_call>{"name": "calc_score"' in observation
    assert not done
    assert info["problem"] is not None


def test_malformed_arguments_string_gets_feedback() -> None:
    env, _ = make_env()
    observation, done, _ = env.step('<tool_call>{"name": "calc_score", "arguments": "{answer"}</tool_call>')
    assert "arguments string is not valid JSON" in observation
    assert not done


@pytest.mark.parametrize(
    "arguments",
    [{}, {"answer": ""}, {"answer": None}, {"value": "70"}],
)
def test_missing_answer_gets_feedback(arguments: dict[str, Any]) -> None:
    env, _ = make_env()
    text = "<tool_call>" + json.dumps({"name": "calc_score", "arguments": arguments}) + "</tool_call>"
    observation, done, _ = env.step(text)
    assert 'missing the "answer" argument' in observation
    assert not done


def test_call_without_arguments_gets_feedback() -> None:
    env, _ = make_env()
    observation, done, _ = env.step('<tool_call>{"name": "calc_score"}</tool_call>')
    assert '"answer"' in observation
    assert not done


def test_no_tool_call_ends_the_episode_and_scores_a_boxed_answer() -> None:
    env, sample = make_env()
    observation, done, info = env.step("So angle C is \\boxed{70^\\circ}.")
    assert done
    assert info["score"] == 1.0
    assert sample.reward == 1.0
    assert "70" in observation


def test_no_tool_call_without_boxed_answer_keeps_the_best_reward() -> None:
    env, sample = make_env()
    env.step(call("70"))
    _, done, info = env.step("I am done.")
    assert done
    assert info["score"] is None
    assert sample.reward == 1.0
    assert sample.metadata["geo3k"] == {"turns": 2, "scores": [1.0]}


def test_a_wrong_final_answer_does_not_lower_the_reward() -> None:
    env, sample = make_env()
    env.step(call("70"))
    env.step("Final: \\boxed{60}")
    assert sample.reward == 1.0
    assert sample.metadata["geo3k"]["scores"] == [1.0, 0.0]


def test_tool_call_turns_leave_the_turn_limit_to_the_rollout() -> None:
    env, sample = make_env(max_turns=2)
    _, first_done, _ = env.step(call("60"))
    _, second_done, info = env.step(call("70"))
    assert (first_done, second_done) == (False, False)
    assert info["score"] == 1.0
    assert sample.reward == 1.0


def test_feedback_turns_are_not_done_either() -> None:
    env, _ = make_env(max_turns=1)
    _, done, _ = env.step(call("70", name="search"))
    assert not done


def test_reward_and_metadata_are_written_on_every_step() -> None:
    env, sample = make_env()
    assert sample.reward == 0.0
    assert sample.metadata["geo3k"] == {"turns": 0, "scores": []}
    env.step(call("60"))
    assert sample.reward == 0.0
    assert isinstance(sample.reward, float)
    assert sample.metadata["geo3k"] == {"turns": 1, "scores": [0.0]}
    env.step(call("70"))
    assert sample.reward == 1.0
    assert sample.metadata["geo3k"] == {"turns": 2, "scores": [0.0, 1.0]}


def test_reset_starts_the_episode_over() -> None:
    env, sample = make_env()
    env.step(call("70"))
    env.reset()
    assert sample.reward == 0.0
    assert sample.metadata["geo3k"] == {"turns": 0, "scores": []}


def test_format_observation_is_a_text_only_user_message() -> None:
    env, _ = make_env()
    observation, _, _ = env.step(call("60"))
    message = env.format_observation(observation)
    assert message == {"role": "user", "content": [{"type": "text", "text": observation}]}


def test_an_unclosed_tool_call_before_a_closed_one_does_not_swallow_it() -> None:
    env, _ = make_env()
    _, _, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "60"} then ' + call("70"))
    assert info["answer"] == "70"
    assert info["score"] == 1.0
