"""The GRPO example's environment: exact credit by default, partial credit for near misses only when asked."""

from __future__ import annotations

import json

from fsm_rollout import Sample
from fsm_rollout.envs.geo3k import CORRECT_FEEDBACK, INCORRECT_FEEDBACK
from fsm_rollout.examples.grpo_tiny import NearMissEnv


def call(answer: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calc_score', 'arguments': {'answer': answer}})}</tool_call>"


def test_by_default_only_the_right_answer_earns_and_the_best_attempt_counts() -> None:
    env = NearMissEnv(Sample(label="40"))
    env.reset()
    assert env.credit("39") == 0.0 and env.credit("40") == 1.0
    observation, done, info = env.step(call("39"))
    assert (observation, done, info["reward"]) == (INCORRECT_FEEDBACK, False, 0.0)
    env.sample.reward = info["reward"]
    observation, done, info = env.step(call("40"))
    assert (observation, done, info["reward"]) == (CORRECT_FEEDBACK, False, 1.0)
    assert env.step("no tool call")[1] is True


def test_a_share_gives_near_misses_partial_credit_within_the_band() -> None:
    env = NearMissEnv(Sample(label="40"), band=0.5, share=0.25)
    assert env.credit("40") == 1.0
    assert env.credit("30") == 0.25 * (1 - 10 / 20)
    assert env.credit("20") == 0.0 and env.credit("abc") == 0.0
