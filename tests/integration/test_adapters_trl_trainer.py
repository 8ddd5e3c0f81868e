"""TRL's real GRPOTrainer takes two steps on fsm-rollout's rollouts: trl_rollout_func rolls each group out with a
skyrl-gym environment on the embedded engine (a tiny model, on the CPU), and the trainer trains on the answer; on the
default model, the engine's logprobs follow the trainer's weights step by step (the trainer's weights are pushed)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.adapters import env_reward, skyrl_env, trl_rollout_func
from fsm_rollout.adapters.trl_rollout import trl_answer
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.tiny import TINY_MODEL_NAME, tiny_model_dir

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

QUESTION = "Tom has 40 apples and buys 2 more. How many apples does he have?"


@contextlib.contextmanager
def served_in_a_thread(model_dir: Path, name: str) -> Iterator[LocalEngine]:
    """The embedded engine on its own event loop, as a separate inference server is to a trainer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = LocalEngine(model_dir, served_model_name=name, torch_threads=1)
    asyncio.run_coroutine_threadsafe(engine.__aenter__(), loop).result(timeout=300)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.__aexit__(None, None, None), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="module")
def engine_in_a_thread() -> Iterator[LocalEngine]:
    with served_in_a_thread(tiny_model_dir(), TINY_MODEL_NAME) as engine:
        yield engine


def import_trainer() -> tuple[Any, Any]:
    """TRL's GRPOConfig and GRPOTrainer. TRL probes for vLLM with ``find_spec("vllm")``, which finds this suite's
    ``tests/vllm`` directory when ``tests`` is on ``sys.path`` (as pytest puts it): TRL is imported without it."""
    tests_dir = Path(__file__).resolve().parents[1]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != tests_dir]
    try:
        from trl import GRPOConfig, GRPOTrainer

        GRPOTrainer.__init__  # noqa: B018 - resolves TRL's lazy module while the path is clean
    finally:
        sys.path[:] = saved
    return GRPOConfig, GRPOTrainer


def test_grpo_trainer_takes_two_steps_on_our_rollouts(engine_in_a_thread: LocalEngine, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer

    GRPOConfig, GRPOTrainer = import_trainer()

    model_dir = str(tiny_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = RolloutConfig(engine_url=engine_in_a_thread.url, model=engine_in_a_thread.served_model_name, max_turns=2)
    calls: list[dict[str, Any]] = []
    rollout = trl_rollout_func(
        config,
        # the tiny model is random: stop strings it writes soon end its turns, so the environment answers them
        sampling_params={"max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "stop": [" ", "\n"]},
        tokenizer=tokenizer,
        env_factory=skyrl_env("gsm8k_multi_turn"),
        make_sample=lambda prompt: Sample(prompt=prompt, label="42", metadata={"extras": {"max_turns": 2}}),
        seed=5,
    )

    def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        answer = rollout(prompts, trainer)
        calls.append({"prompts": prompts, "answer": answer})
        return answer

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[env_reward],
        args=GRPOConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=128,
            learning_rate=1e-4,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
        ),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION}]] * 4}),
        processing_class=tokenizer,
        rollout_func=recorded,
    )
    before = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) == 2
    for call in calls:
        answer = call["answer"]
        assert len(call["prompts"]) == 2 and len(answer["completion_ids"]) == 2
        for ids, logprobs, mask in zip(answer["completion_ids"], answer["logprobs"], answer["env_mask"], strict=True):
            assert len(ids) == len(logprobs) == len(mask) > 0
        assert all(isinstance(reward, float) for reward in answer["env_reward"])
    # a multi-turn sample's observation tokens are masked out of the loss
    assert any(0 in mask for call in calls for mask in call["answer"]["env_mask"])
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    changed = any(not parameter.equal(before[name]) for name, parameter in trainer.model.named_parameters())
    assert changed or all(entry.get("reward_std", 0.0) == 0.0 for entry in logged)


def test_the_answer_holds_what_trl_reads_per_sample() -> None:
    sample = Sample(prompt="p", tokens=[1, 2, 3, 4, 5], response_length=3, loss_mask=[1, 0, 1],
                    rollout_log_probs=[-0.1, 0.0, -0.2], reward=0.5)  # fmt: skip
    sample.metadata["rollout_reason"] = "env_done"
    assert trl_answer([sample]) == {
        "prompt_ids": [[1, 2]],
        "completion_ids": [[3, 4, 5]],
        "logprobs": [[-0.1, 0.0, -0.2]],
        "env_mask": [[1, 0, 1]],
        "env_reward": [0.5],
        "rollout_status": ["pending"],
        "rollout_reason": ["env_done"],
        "weight_version": [None],  # no weight_version_spans: the sample's first token's version is unknown
    }
    assert env_reward(env_reward=[0.5, None]) == [0.5, None]


class OneTurn:
    """Ends the episode after the model's first turn."""

    async def reset(self) -> None:
        return None

    async def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        return "", True, {"reward": 0.0}

    async def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": str(observation)}

    async def close(self) -> None:
        return None


def one_turn(*, sample: Any, args: Any) -> OneTurn:
    return OneTurn()


def token_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A reward that differs between a group's answers (their token ids), so the trainer's step moves the weights."""
    return [float(sum(ids) % 97) for ids in completion_ids]


def completion_logprobs(model: Any, answer: dict[str, list[Any]]) -> list[list[float]]:
    """The model's logprob of each generated token (env_mask 1) of every sample in ``answer``."""
    import torch

    found: list[list[float]] = []
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for prompt, completion, mask in zip(
                answer["prompt_ids"], answer["completion_ids"], answer["env_mask"], strict=True
            ):
                ids = torch.tensor([prompt + completion])
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
                found.append([float(value) for value, kept in zip(picked, mask, strict=True) if kept])
    finally:
        model.train(training)
    return found


def mean_gap(ours: list[list[float]], theirs: list[list[float]]) -> float:
    gaps = [abs(a - b) for row, other in zip(ours, theirs, strict=True) for a, b in zip(row, other, strict=True)]
    assert gaps
    return sum(gaps) / len(gaps)


def test_the_engine_samples_from_the_trainers_weights_at_every_step(tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir

    GRPOConfig, GRPOTrainer = import_trainer()
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    initial = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32")
    calls: list[dict[str, Any]] = []
    with served_in_a_thread(model_dir, DEFAULT_MODEL_NAME) as engine:
        config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name, max_turns=1)
        rollout = trl_rollout_func(
            config,
            sampling_params={"max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0},
            tokenizer=tokenizer,
            env_factory=one_turn,
            seed=3,
        )

        def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            answer = rollout(prompts, trainer)
            calls.append(
                {
                    "step": trainer.state.global_step,
                    "answer": answer,
                    "trainer": completion_logprobs(trainer.model, answer),
                    "initial": completion_logprobs(initial, answer),
                }
            )
            return answer

        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[token_reward],
            args=GRPOConfig(
                output_dir=str(tmp_path),
                max_steps=2,
                per_device_train_batch_size=2,
                num_generations=2,
                max_completion_length=64,
                learning_rate=5e-3,
                use_cpu=True,
                bf16=False,
                report_to=[],
                save_strategy="no",
                logging_steps=1,
            ),
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION}]] * 4}),
            processing_class=tokenizer,
            rollout_func=recorded,
        )
        trainer.train()
    assert trainer.state.global_step == 2 and [call["step"] for call in calls] == [0, 1]
    for call in calls:
        engine_logprobs = [
            [value for value, kept in zip(row, mask, strict=True) if kept]
            for row, mask in zip(call["answer"]["logprobs"], call["answer"]["env_mask"], strict=True)
        ]
        assert call["answer"]["weight_version"] == [str(call["step"])] * 2
        assert mean_gap(engine_logprobs, call["trainer"]) <= 1e-4, call["step"]
    # the first step moved the weights: without the push, the second call's logprobs would be the initial model's
    second = calls[1]
    assert mean_gap(second["trainer"], second["initial"]) > 1e-2
