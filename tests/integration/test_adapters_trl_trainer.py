"""TRL's real GRPOTrainer takes two steps on fsm-rollout's rollouts: trl_rollout_func rolls each group out with a
skyrl-gym environment on the embedded engine (a tiny model, on the CPU), and the trainer trains on the answer."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.adapters import skyrl_env
from fsm_rollout.adapters.trl_rollout import env_reward, trl_answer, trl_rollout_func
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.tiny import TINY_MODEL_NAME, tiny_model_dir

QUESTION = "Tom has 40 apples and buys 2 more. How many apples does he have?"


@pytest.fixture(scope="module")
def engine_in_a_thread() -> Iterator[LocalEngine]:
    """The embedded engine on its own event loop, as a separate inference server is to a trainer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = LocalEngine(tiny_model_dir(), served_model_name=TINY_MODEL_NAME, torch_threads=1)
    asyncio.run_coroutine_threadsafe(engine.__aenter__(), loop).result(timeout=300)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.__aexit__(None, None, None), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


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
    }
    assert env_reward(env_reward=[0.5, None]) == [0.5, None]
