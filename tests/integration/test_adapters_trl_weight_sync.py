"""trl_rollout_func against the fake engine, called as TRL calls it (from a thread, with the trainer): the trainer's
weights are pushed before each call whose step changed, through /update_weights or a callable, and every sample
records the version it was sampled under; a push the engine refuses, a call whose samples all failed and a single
URL given as a string are handled as the module says."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.adapters import trl_rollout_func
from fsm_rollout.errors import ConfigError, RolloutError
from fsm_rollout.testing.fake_vllm import UPDATE_WEIGHTS_PATH, FakeVLLMServer, ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}
PROMPT = [{"role": "user", "content": "Say something."}]


class OneTurn:
    """Ends the episode after the model's first turn, rewarding it 1.0."""

    async def reset(self) -> None:
        return None

    async def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        return "", True, {"reward": 1.0}

    async def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": str(observation)}

    async def close(self) -> None:
        return None


def one_turn(*, sample: Any, args: Any) -> OneTurn:
    return OneTurn()


def broken(*, sample: Any, args: Any) -> OneTurn:
    raise RuntimeError(f"no environment for sample {sample.index}")


def fake_trainer(step: int) -> Any:
    import torch

    torch.manual_seed(0)
    return SimpleNamespace(
        model=torch.nn.Linear(3, 2), state=SimpleNamespace(global_step=step), num_generations=2, accelerator=None
    )


def config_for(server: FakeVLLMServer) -> RolloutConfig:
    return RolloutConfig(engine_url=server.url, model=server.model, max_turns=1)


async def test_the_trainers_weights_are_pushed_when_its_step_changes_and_samples_carry_the_version(
    tokenizer: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="hello") for _ in range(6)])
    rollout = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=one_turn, seed=1
    )
    trainer = fake_trainer(0)
    seen: list[tuple[bool, str]] = []
    real_updates = fake_vllm.weight_updates

    class Watching(list[Any]):
        def append(self, body: Any) -> None:  # the file must exist while the engine reads it
            path = body["update_info"]["path"]
            seen.append((Path(path).is_file(), body["update_info"]["weight_version"]))
            super().append(body)

    fake_vllm.weight_updates = Watching(real_updates)
    first = await asyncio.to_thread(rollout, [PROMPT, PROMPT], trainer)
    again = await asyncio.to_thread(rollout, [PROMPT, PROMPT], trainer)
    trainer.state.global_step = 1
    later = await asyncio.to_thread(rollout, [PROMPT, PROMPT], trainer)

    assert seen == [(True, "0"), (True, "1")]  # one push per step, none when the step did not change
    pushed = [Path(body["update_info"]["path"]) for body in fake_vllm.weight_updates]
    assert not any(path.exists() for path in pushed)  # the file is removed once the call is over
    assert first["weight_version"] == ["0", "0"] and again["weight_version"] == ["0", "0"]
    assert later["weight_version"] == ["1", "1"]
    assert first["env_reward"] == [1.0, 1.0]


async def test_the_pushed_file_holds_the_trainers_parameters(tokenizer: Any, fake_vllm: FakeVLLMServer) -> None:
    from safetensors.torch import load_file

    fake_vllm.script([ScriptedTurn(text="hello")])
    trainer = fake_trainer(3)
    loaded: list[dict[str, Any]] = []

    class Reading(list[Any]):
        def append(self, body: Any) -> None:
            loaded.append(load_file(body["update_info"]["path"]))
            super().append(body)

    fake_vllm.weight_updates = Reading()
    rollout = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=one_turn
    )
    await asyncio.to_thread(rollout, [PROMPT], trainer)
    expected = trainer.model.state_dict()
    assert sorted(loaded[0]) == sorted(expected)
    assert all(loaded[0][name].equal(expected[name]) for name in expected)


async def test_a_weight_sync_callable_pushes_instead_and_none_pushes_nothing(
    tokenizer: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="hello") for _ in range(4)])
    pushed: list[tuple[Any, str]] = []

    async def push(trainer: Any, version: str) -> None:
        pushed.append((trainer, version))

    trainer = fake_trainer(0)
    rollout = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=one_turn, weight_sync=push
    )
    answer = await asyncio.to_thread(rollout, [PROMPT, PROMPT], trainer)
    assert pushed == [(trainer, "0")] and answer["weight_version"] == ["0", "0"]
    assert fake_vllm.weight_updates == []  # the callable did the pushing

    off = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=one_turn, weight_sync=None
    )
    trainer.state.global_step = 5
    answer = await asyncio.to_thread(off, [PROMPT, PROMPT], trainer)
    assert answer["weight_version"] == ["0", "0"] and fake_vllm.weight_updates == []  # the engine kept its version
    with pytest.raises(ConfigError, match="weight_sync must be"):
        trl_rollout_func(config_for(fake_vllm), sampling_params=SAMPLING, weight_sync="nccl")


async def test_an_engine_that_refuses_the_weights_is_an_error_that_says_what_to_pass(
    tokenizer: Any, fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.fail_next(UPDATE_WEIGHTS_PATH, status=400)
    rollout = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=one_turn
    )
    with pytest.raises(RolloutError, match=r"refused the trainer's weights .*400.*weight_sync=callable"):
        await asyncio.to_thread(rollout, [PROMPT], fake_trainer(1))
    assert fake_vllm.requests_to("/inference/v1/generate") == []  # nothing was rolled out on the old weights


async def test_a_call_whose_samples_all_failed_raises_naming_the_first_failure(
    tokenizer: Any, fake_vllm: FakeVLLMServer
) -> None:
    rollout = trl_rollout_func(
        config_for(fake_vllm), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=broken, weight_sync=None
    )
    with pytest.raises(RolloutError, match=r"all 2 samples of the call failed; the first: .*no environment for sample"):
        await asyncio.to_thread(rollout, [PROMPT, PROMPT], fake_trainer(0))


async def test_one_url_given_as_a_string_is_one_engine(tokenizer: Any, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="hello")])
    config = RolloutConfig(engine_url="http://127.0.0.1:9", model=fake_vllm.model, max_turns=1)  # never used
    rollout = trl_rollout_func(
        config,
        sampling_params=SAMPLING,
        tokenizer=tokenizer,
        env_factory=one_turn,
        engine_urls=fake_vllm.url,
        weight_sync=None,
    )
    answer = await asyncio.to_thread(rollout, [PROMPT], None)
    assert answer["rollout_status"] == ["completed"] and len(fake_vllm.requests_to("/inference/v1/generate")) == 1
    with pytest.raises(ConfigError, match="engine_urls must be URL strings"):
        trl_rollout_func(config, sampling_params=SAMPLING, engine_urls=[fake_vllm.url, 7])  # type: ignore[list-item]
