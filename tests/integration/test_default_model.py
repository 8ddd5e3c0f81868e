"""The embedded engine's default model: built deterministically, trained on what rollouts really see, and it
follows the Geo3K task's format (tool call, feedback, another attempt or a final answer)."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections import Counter
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, RolloutRunner
from fsm_rollout.data.figures import FIGURE_SIZE
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local import default_model as default_model_module
from fsm_rollout.engine.local.cache import cache_dir
from fsm_rollout.engine.local.default_model import (
    DEFAULT_MODEL_NAME,
    RECIPE,
    BuildProgress,
    Conversation,
    TrainingData,
    default_model_dir,
    encode_conversations,
    read_training_data,
    recipe_key,
    train_model_dir,
)
from fsm_rollout.engine.local.tiny import BUILD_MARKER, TINY_MODEL_NAME
from fsm_rollout.envs.geo3k import CORRECT_FEEDBACK, INCORRECT_FEEDBACK
from tools.default_model_data import training_conversations

pytestmark = pytest.mark.own_process  # its engines and model builds are a lasting step up in the suite's process

SAMPLING = {"max_new_tokens": 192, "temperature": 1.0, "top_p": 1.0, "stop": ["</tool_call>"], "no_stop_trim": True,
            "seed": 17}  # fmt: skip


def marker(directory: pathlib.Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((directory / BUILD_MARKER).read_text(encoding="utf-8"))
    return loaded


def test_a_build_in_a_fresh_cache_has_the_same_weights_and_reuse_trains_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = default_model_dir()
    said: list[str] = []
    fresh = default_model_dir(tmp_path, log=said.append)
    assert len(said) == 1 and str(fresh) in said[0]  # the CLI prints this line while the model trains
    assert fresh.name == shared.name == f"{DEFAULT_MODEL_NAME}-{recipe_key()}"
    built = marker(fresh)
    assert built["weights_sha256"] == marker(shared)["weights_sha256"]  # fixed torch threads: the same on any machine
    assert built["recipe"] == RECIPE and built["base"] == TINY_MODEL_NAME
    assert built["loss_first"] > 10 > 1 > built["loss_last"]  # from uniform over 152k ids to the task's format

    def no_training(*args: Any) -> None:
        raise AssertionError("a finished build was trained again")

    monkeypatch.setattr(default_model_module, "_train_in_subprocess", no_training)
    assert default_model_dir(tmp_path, log=said.append) == fresh
    assert len(said) == 1


def test_the_cache_key_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = recipe_key()
    shipped = read_training_data()
    fewer = TrainingData(shipped.conversations[:-1], shipped.figure_size)
    assert recipe_key(fewer) != key  # and the data
    monkeypatch.setitem(RECIPE, "steps", RECIPE["steps"] + 1)
    assert recipe_key() != key


def test_a_build_reports_each_step_with_its_loss_and_the_time_left(tmp_path: pathlib.Path) -> None:
    shutil.copytree(default_model_module.tiny_model_dir(), tmp_path / TINY_MODEL_NAME)  # only the training runs
    shipped = read_training_data()
    data = TrainingData(shipped.conversations[:8], shipped.figure_size)
    given: list[BuildProgress] = []
    built = train_model_dir(tmp_path, "small", data, {**RECIPE, "steps": 5, "warmup_steps": 1}, progress=given.append)

    phases = [report.phase for report in given if report.phase is not None]
    reports = [report for report in given if report.phase is None]
    assert given[: len(phases)] == [report for report in given if report.phase is not None]  # set-up comes first
    assert phases[0] == "importing torch" and "encoding 8 conversations" in phases  # said while it loads
    assert [report.step for report in reports] == [0, 1, 2, 3, 4, 5]  # training starts, then every step
    assert {report.steps for report in reports} == {5}
    assert reports[0].loss is None and all(report.loss is not None and report.loss > 0 for report in reports[1:])
    first, last = reports[1].loss, reports[-1].loss
    assert first is not None and last is not None
    assert (round(first, 4), round(last, 4)) == (marker(built)["loss_first"], marker(built)["loss_last"])
    elapsed = [report.elapsed_s for report in reports]
    assert elapsed == sorted(elapsed)
    assert reports[0].remaining_s is None and reports[-1].remaining_s == 0
    assert all(report.remaining_s is not None and report.remaining_s >= 0 for report in reports[1:])
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".")] == []  # no inputs left behind


def test_one_torch_thread_and_two_train_the_same_weights(tmp_path: pathlib.Path) -> None:
    """So a loaded machine may train on one thread (two spin at each step's barriers while one waits for a core)."""
    shipped = read_training_data()
    data = TrainingData(shipped.conversations[:8], shipped.figure_size)
    recipe = {**RECIPE, "steps": 6, "warmup_steps": 1}
    weights = []
    for threads in (1, 2):
        cache = tmp_path / f"threads-{threads}"
        shutil.copytree(default_model_module.tiny_model_dir(), cache / TINY_MODEL_NAME)
        weights.append(marker(train_model_dir(cache, "small", data, recipe, threads=threads))["weights_sha256"])
    assert weights[0] is not None and weights[0] == weights[1]


def test_conversations_are_graded_by_the_environment_and_end_as_a_rollout_would() -> None:
    conversations = training_conversations(200, seed=5, first_correct=0.6, retry_correct=0.6, max_turns=3)
    lengths = Counter(len(conversation.turns) for conversation in conversations)
    assert set(lengths) == {2, 3}  # right at once then boxed; or a retry; never past the turn limit
    for conversation in conversations:
        assert len(conversation.feedback) == len(conversation.turns) - 1
        for turn, feedback in zip(conversation.turns, conversation.feedback, strict=False):
            assert "<tool_call>" in turn
            right = f'"answer": {json.dumps(conversation.label)}' in turn
            assert feedback == (CORRECT_FEEDBACK if right else INCORRECT_FEEDBACK)
        if CORRECT_FEEDBACK in conversation.feedback:
            assert conversation.turns[-1] == f"The answer is \\boxed{{{conversation.label}}}."


async def test_training_prompts_are_the_tokens_a_rollout_sends() -> None:
    samples = practice_samples(3, seed=8)
    async with LocalEngine() as engine:
        config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name,
                               tokenizer_path=str(engine.model_dir), image_merge_size=engine.image_merge_size,
                               max_turns=1, env_path="fsm_rollout.envs.geo3k")  # fmt: skip
        async with RolloutRunner(config, sampling_params={**SAMPLING, "max_new_tokens": 4}) as runner:
            rolled = await runner.run_batch(samples)
            tokenizer = runner.tokenizer
    examples = encode_conversations(
        TrainingData(tuple(Conversation(str(sample.prompt), ("x",), ()) for sample in rolled), FIGURE_SIZE), tokenizer
    )
    for sample, example in zip(rolled, examples, strict=True):
        prompt = sample.tokens[: len(sample.tokens) - sample.response_length]
        assert example.token_ids[: len(prompt)] == prompt
        assert not any(example.trainable[: len(prompt)])


async def test_the_default_model_calls_the_tool_takes_feedback_and_tries_again() -> None:
    """What the model does is a draw: each sample has its own seed (so the draws are independent), and the test bounds
    the rates of the behaviour instead of asking every sample for it. A sample may legally end after one turn (a boxed
    answer and no tool call gets no feedback), and which samples do depends on the machine's float arithmetic even
    at a fixed seed; the bounds sit far below the rates a build of the recipe shows, while a model that lost the
    format (or a rollout that dropped the feedback) falls below them."""
    samples = practice_samples(16, seed=31)
    async with LocalEngine() as engine:
        assert engine.served_model_name == DEFAULT_MODEL_NAME
        assert engine.model_dir.parent == cache_dir()
        config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name,
                               tokenizer_path=str(engine.model_dir), image_merge_size=engine.image_merge_size,
                               max_turns=3, env_path="fsm_rollout.envs.geo3k")  # fmt: skip
        async with RolloutRunner(config, sampling_params=SAMPLING) as runner:
            seeds = [SAMPLING["seed"] + index for index in range(len(samples))]
            results = await runner.run_batch(samples, concurrency=len(samples), seeds=seeds)

    turns = [sample.metadata["geo3k"]["turns"] for sample in results]
    graded = [len(sample.metadata["geo3k"]["scores"]) for sample in results]
    # nearly every turn is a well-formed calc_score call (scored) or, after "Correct", a final boxed answer
    assert sum(graded) >= 0.8 * sum(turns), (turns, graded)
    took_feedback = [sample for sample, count in zip(results, turns, strict=True) if count >= 2]
    assert len(took_feedback) >= len(results) // 2, turns  # feedback was read and acted on
    for sample in results:
        assert sample.response_length > 0
    for sample in took_feedback:  # whatever the draw: the feedback is in the tokens and masked out of the loss
        assert 0 in sample.loss_mask and "<tool_call>" in str(sample.response)
