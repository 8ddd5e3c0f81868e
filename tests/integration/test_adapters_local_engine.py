"""Every adapter's real environment against the embedded CPU engine (a real model, seeded): each sample ends
completed or truncated with the environment's reward on it, the environment answered its turns, the replay is
identical and inspect shows the sample. The model's text is its own, so only what holds whatever it says is
asserted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from adapters_support import inspect_text, replay_counts
from trl_envs import HiddenNumberEnv
from verifiers_envs import load_game_environment, load_tool_environment

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, get_tracer
from fsm_rollout.adapters import gym_env, skyrl_env, trl_env, verifiers_env, verifiers_samples
from fsm_rollout.engine.local import LocalEngine

# the frameworks' imports stay out of the suite's process
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.own_process]

SAMPLING = {"max_new_tokens": 96, "temperature": 1.0, "top_p": 1.0, "seed": 11}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine() as served:
        yield served


def lake(text: str) -> int:
    return 2 if "right" in text.lower() else 1  # right, else down


def gym_case() -> tuple[Any, list[Sample]]:
    factory = gym_env("FrozenLake-v1", lambda square: f"You are on square {square}.", lake,
                      make_kwargs={"is_slippery": False})  # fmt: skip
    return factory, [Sample(index=0)]


def skyrl_case() -> tuple[Any, list[Sample]]:
    question = "Tom has 40 apples and buys 2 more. How many apples does he have?"
    return skyrl_env("gsm8k_multi_turn"), [Sample(index=0, prompt=question, label="42")]


def trl_case() -> tuple[Any, list[Sample]]:
    sample = Sample(index=0, prompt=[{"role": "user", "content": "Find the number."}], metadata={"row": {"secret": 4}})
    return trl_env(HiddenNumberEnv), [sample]


def verifiers_tool_case() -> tuple[Any, list[Sample]]:
    env = load_tool_environment()
    return verifiers_env(env), verifiers_samples(env, n=1)


def verifiers_game_case() -> tuple[Any, list[Sample]]:
    env = load_game_environment()
    return verifiers_env(env), verifiers_samples(env)


CASES: dict[str, Callable[[], tuple[Any, list[Sample]]]] = {
    "gym": gym_case,
    "skyrl": skyrl_case,
    "trl": trl_case,
    "verifiers-tool": verifiers_tool_case,
    "verifiers-game": verifiers_game_case,
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_environment_runs_on_the_embedded_engine_and_replays_identically(
    engine: LocalEngine, tokenizer: Any, tmp_path: Path, case: str
) -> None:
    factory, samples = CASES[case]()
    config = RolloutConfig(
        engine_url=engine.url,
        model=engine.served_model_name,
        max_turns=2,
        check_invariants=True,
        trace=str(tmp_path / "run.jsonl"),
        record=True,
    )
    async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory) as runner:
        [sample] = await runner.run_batch(samples, concurrency=1)
    get_tracer(str(tmp_path / "run.jsonl")).close()
    assert sample.status.value in ("completed", "truncated"), sample.metadata.get("rollout_error")
    assert isinstance(sample.reward, float), sample.metadata
    assert sample.metadata.get("observations") or sample.metadata.get("env_stop"), sample.metadata  # it answered
    assert await replay_counts(tokenizer, tmp_path) == {"identical": 1}
    assert (await inspect_text(tmp_path)).startswith("sample 0 ")
