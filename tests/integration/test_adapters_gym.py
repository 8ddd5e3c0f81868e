"""The gym adapter runs real GEM and Gymnasium environments, unchanged: a GEM text game over several turns, a
Gymnasium toy-text game through obs_to_text/action_parser with its time limit (truncated, with its own reason),
rewards on the sample, the replay identical and inspect readable; importing GEM leaves the host's logging alone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from adapters_support import inspect_text, replay_counts, run_recorded

from fsm_rollout import Sample
from fsm_rollout.adapters import gym_env
from fsm_rollout.errors import AdapterProtocolError
from fsm_rollout.replay import replay_async
from fsm_rollout.testing.fake_vllm import ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

GAME = "game:GuessTheNumber-v0-easy"


def secret_number(seed: int) -> int:
    """The number GEM's game picks for ``seed`` (the game itself, reset as the adapter resets it)."""
    import gem

    env = gem.make(GAME)
    env.reset(seed=seed)
    return int(env.game_number)


async def test_a_gem_text_game_runs_turn_by_turn_with_its_rewards_on_the_sample(tokenizer: Any, tmp_path: Path) -> None:
    from gem.utils.constants import LanguageGameReward

    target = secret_number(3)
    wrong = 1 if target != 1 else 2
    turns = [ScriptedTurn(text=f"I guess \\boxed{{{wrong}}}"), ScriptedTurn(text=f"Then \\boxed{{{target}}}")]
    [sample] = await run_recorded(tokenizer, tmp_path, gym_env(GAME), [Sample(index=0, metadata={"seed": 3})], turns)
    assert sample.status.value == "completed", sample.metadata.get("rollout_error")
    assert sample.metadata["rollout_reason"] == "env_done" and sample.metadata["env_stop"] == "terminated"
    rewards = [LanguageGameReward.internal_step_reward, LanguageGameReward.success_reward]
    assert sample.metadata["gym"]["rewards"] == rewards and sample.reward == sum(rewards)
    assert isinstance(sample.prompt, list) and sample.prompt[-1]["content"].startswith("You are playing Guess The")
    hint = "higher" if wrong < target else "lower"
    assert f"you guessed {wrong}, and the target number is {hint} than {wrong}" in tokenizer.decode(sample.tokens)
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    shown = await inspect_text(tmp_path)
    assert "You are playing Guess The Number" in shown and f"target number is {hint}" in shown


ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}


def lake_text(observation: Any) -> str:
    return f"You stand on square {int(observation)} of a 4x4 frozen lake. Move left, down, right or up."


def lake_action(text: str) -> int:
    words = [word for word in text.lower().split() if word in ACTIONS]
    return ACTIONS[words[-1]] if words else ACTIONS["left"]


async def test_a_gymnasium_game_past_its_time_limit_ends_truncated_in_its_own_words(
    tokenizer: Any, tmp_path: Path
) -> None:
    factory = gym_env(
        "FrozenLake-v1", lake_text, lake_action, make_kwargs={"is_slippery": False, "max_episode_steps": 2}
    )
    turns = [ScriptedTurn(text="right"), ScriptedTurn(text="go right")]
    [sample] = await run_recorded(tokenizer, tmp_path, factory, [Sample(index=0)], turns)
    assert (sample.status.value, sample.metadata["rollout_reason"]) == ("truncated", "env_truncated")
    assert sample.metadata["env_stop"] == "truncated" and sample.metadata["gym"]["stop"] == "truncated"
    assert sample.reward == 0.0 and sample.metadata["gym"]["rewards"] == [0.0, 0.0]
    assert "square 1 of a 4x4" in tokenizer.decode(sample.tokens)  # moved right from square 0
    assert sample.prompt[-1]["content"].startswith("You stand on square 0")
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}


async def test_the_tape_holds_the_truncation_so_replay_takes_the_same_edge(tokenizer: Any, tmp_path: Path) -> None:
    factory = gym_env(
        "FrozenLake-v1", lake_text, lake_action, make_kwargs={"is_slippery": False, "max_episode_steps": 1}
    )
    [sample] = await run_recorded(tokenizer, tmp_path, factory, [Sample(index=0)], [ScriptedTurn(text="down")])
    assert (sample.status.value, sample.metadata["rollout_reason"]) == ("truncated", "env_truncated")
    tape = tmp_path / "run.tape.jsonl"
    records = [json.loads(line) for line in tape.read_text().splitlines()]
    steps = [entry for record in records if record.get("kind") == "sample" for entry in record["io"]
             if entry["op"] == "step"]  # fmt: skip
    assert [step["result"]["step"]["truncated"] for step in steps] == [True]  # tape schema 3: the typed step
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    # without the flag the tape describes an episode that ended on its own: the replay takes env_done and differs
    tape.write_text(tape.read_text().replace('"truncated":true', '"truncated":false'))
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.counts().get("identical", 0) == 0 and "env_done" in report.render(verbose=True)


class Timed:
    """A protocol environment of our own that ends its episode at a time limit after two steps, or says so wrongly."""

    def __init__(self, truncated: Any) -> None:
        self.truncated = truncated
        self.steps = 0

    def reset(self) -> None:
        return None

    def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        self.steps += 1
        done = self.steps == 2
        return "again", done, {"reward": 0.5, "truncated": self.truncated if done else False}

    def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        return None


@pytest.mark.parametrize(
    "truncated, expected",
    [(True, ("truncated", "env_truncated")), (False, ("completed", "env_done"))],
)
async def test_any_environment_ends_truncated_by_saying_so_in_the_step_info(
    tokenizer: Any, tmp_path: Path, truncated: bool, expected: tuple[str, str]
) -> None:
    def build_env(*, sample: Any, args: Any) -> Timed:
        return Timed(truncated)

    samples = [Sample(index=0, prompt="go")]
    [sample] = await run_recorded(tokenizer, tmp_path, build_env, samples, [ScriptedTurn(text="a")] * 2)
    assert (sample.status.value, sample.metadata["rollout_reason"]) == expected
    assert sample.reward == 0.5 and sample.response_length > 0
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}


async def test_a_truncated_flag_that_is_not_a_bool_fails_the_sample_with_a_clear_error(
    tokenizer: Any, tmp_path: Path
) -> None:
    def build_env(*, sample: Any, args: Any) -> Timed:
        return Timed("yes")

    samples = [Sample(index=0, prompt="go")]
    [sample] = await run_recorded(tokenizer, tmp_path, build_env, samples, [ScriptedTurn(text="a")] * 2)
    assert sample.status.value == "failed"
    assert sample.metadata["rollout_error"]["message"] == "env.step's info['truncated'] must be a bool, got str 'yes'"
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}


async def test_the_lake_pays_for_reaching_the_goal(tokenizer: Any, tmp_path: Path) -> None:
    path = ["right", "right", "down", "down", "down", "right"]
    factory = gym_env("FrozenLake-v1", lake_text, lake_action, make_kwargs={"is_slippery": False})
    [sample] = await run_recorded(
        tokenizer, tmp_path, factory, [Sample(index=0)], [ScriptedTurn(text=move) for move in path], max_turns=6
    )
    assert sample.metadata["env_stop"] == "terminated" and sample.metadata["gym"]["rewards"] == [0.0] * 5 + [1.0]
    assert sample.reward == 1.0


class Paying:
    """Pays 0.5, then 0.25, then ends: summed 0.75, last 0.25."""

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        return f"paid {self.steps}", 0.5 / self.steps, self.steps == 2, False, {}


@pytest.mark.parametrize("mode, expected", [("sum", 0.75), ("last", 0.25)])
async def test_rewards_are_summed_or_the_last_taken(tokenizer: Any, tmp_path: Path, mode: str, expected: float) -> None:
    factory = gym_env(Paying, reward=mode)  # type: ignore[arg-type]
    [sample] = await run_recorded(tokenizer, tmp_path, factory, [Sample(index=0)], [ScriptedTurn(text="a")] * 2)
    assert sample.reward == expected and sample.metadata["gym"]["rewards"] == [0.5, 0.25]


class BrokenGym:
    """Answers reset right, but step with the old four-tuple of gym < 0.26."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        return "next", 0.0, False, {}


async def test_an_environment_that_breaks_the_gym_protocol_fails_the_sample_naming_the_adapter_and_call(
    tokenizer: Any, tmp_path: Path
) -> None:
    [sample] = await run_recorded(tokenizer, tmp_path, gym_env(BrokenGym), [Sample(index=0)], [ScriptedTurn(text="x")])
    assert sample.status.value == "failed"
    error = sample.metadata["rollout_error"]
    assert error["type"] == AdapterProtocolError.__name__
    assert error["message"] == (
        "gym adapter: env.step returned a tuple of 4, not (observation, reward, terminated, truncated, info)"
    )


class StuckGym:
    """Its step blocks its thread until released (a foreign environment that hangs)."""

    release = threading.Event()

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        StuckGym.release.wait(60)
        return "late", 1.0, True, False, {}


async def test_a_foreign_step_that_hangs_runs_in_the_pool_and_ends_the_sample_at_the_step_timeout(
    tokenizer: Any, tmp_path: Path
) -> None:
    try:
        [sample] = await run_recorded(
            tokenizer, tmp_path, gym_env(StuckGym), [Sample(index=0)], [ScriptedTurn(text="x")],
            env_step_timeout_s=0.5,
        )  # fmt: skip
    finally:
        StuckGym.release.set()
    assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "env_timeout"


ROOT_LOGGING = "import logging; root = logging.getLogger(); print(len(root.handlers), root.level)"


def root_logging_after(code: str) -> str:
    """The root logger's handler count and level after ``code`` runs in a fresh interpreter."""
    script = f"{code}\n{ROOT_LOGGING}"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def test_using_gem_leaves_the_host_processs_root_logging_as_it_was() -> None:
    untouched = root_logging_after("")
    assert root_logging_after("import gem") != untouched  # GEM configures logging when imported...
    played = (
        "from fsm_rollout.envs.adapters.gym import make_gym_env\n"
        f"env = make_gym_env({GAME!r}); env.reset(seed=0); env.step('\\\\boxed{{1}}')"
    )
    assert root_logging_after(played) == untouched  # ...the adapter puts it back
