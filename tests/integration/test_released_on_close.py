"""A runner or an embedded engine that has been closed leaves nothing running or open behind: no thread of its own, no
open file, no model. A test session runs hundreds of them in one process, as a trainer may over a long run."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, Status
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.model import LoadedModel
from fsm_rollout.engine.local.tiny import TINY_MODEL_NAME, tiny_model_dir
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
ANSWER = ScriptedTurn(text="42.<|im_end|>")


def open_files_under(folder: Path) -> list[str]:
    """Files this process holds open under ``folder``."""
    root = str(folder.resolve())
    opened = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:  # the descriptor listing itself, closed meanwhile
            continue
        if target.startswith(root):
            opened.append(target)
    return opened


def new_threads(before: set[int]) -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.ident not in before]


def loaded_models() -> int:
    gc.collect()
    return sum(1 for item in gc.get_objects() if type(item) is LoadedModel)


async def test_a_recording_runner_closes_its_trace_and_tape_and_ends_their_thread_when_it_exits(
    fake_vllm: FakeVLLMServer, make_config: Callable[..., RolloutConfig], tokenizer: Any, tmp_path: Path
) -> None:
    fake_vllm.script([ANSWER, ANSWER])
    before = {thread.ident for thread in threading.enumerate()}
    trace = tmp_path / "run.jsonl"
    config = make_config(max_turns=1, trace=str(trace), record=True)
    runner = RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory())
    async with runner:
        sample = await runner.run(Sample(prompt="What is 6 * 7?", index=0))
        assert open_files_under(tmp_path)  # the premise: the trace and the tape are open while the runner runs
    assert sample.status != Status.FAILED, sample.metadata
    assert open_files_under(tmp_path) == []
    assert [name for name in new_threads(before) if name.startswith("fsm-rollout-tape")] == []
    assert trace.stat().st_size > 0 and (tmp_path / "run.tape.jsonl").stat().st_size > 0

    # entered again, it opens them again (appending), and closes them again
    async with runner:
        again = await runner.run(Sample(prompt="And 7 * 8?", index=1))
    assert again.status != Status.FAILED, again.metadata
    assert open_files_under(tmp_path) == []
    assert len(trace.read_text().splitlines()) > 2


async def test_two_runners_sharing_a_trace_keep_it_open_until_the_last_one_exits(
    fake_vllm: FakeVLLMServer, make_config: Callable[..., RolloutConfig], tokenizer: Any, tmp_path: Path
) -> None:
    fake_vllm.script([ANSWER, ANSWER])
    config = make_config(max_turns=1, trace=str(tmp_path / "run.jsonl"), record=True)
    first = RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory())
    second = RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory())
    async with second:
        async with first:
            first_sample = await first.run(Sample(prompt="What is 6 * 7?", index=0))
        assert open_files_under(tmp_path)  # the second runner still writes to them
        sample = await second.run(Sample(prompt="And 7 * 8?", index=1))
    assert Status.FAILED not in (first_sample.status, sample.status), (first_sample.metadata, sample.metadata)
    assert open_files_under(tmp_path) == []
    samples = [line for line in (tmp_path / "run.tape.jsonl").read_text().splitlines() if '"kind":"sample"' in line]
    assert len(samples) == 2


async def test_a_stopped_embedded_engine_ends_its_threads_and_lets_its_model_go(tokenizer: Any) -> None:
    models_before = loaded_models()
    before = {thread.ident for thread in threading.enumerate()}
    engine = LocalEngine(tiny_model_dir(), served_model_name=TINY_MODEL_NAME)
    async with engine:
        config = RolloutConfig(engine_url=engine.url, model=TINY_MODEL_NAME, max_turns=1)
        async with RolloutRunner(
            config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory()
        ) as runner:
            sample = await runner.run(Sample(prompt="What is 6 * 7?", index=0))
        assert loaded_models() == models_before + 1
    assert sample.status != Status.FAILED, sample.metadata
    assert [name for name in new_threads(before) if name.startswith("fsm-rollout-engine")] == []
    # released by the stop, though the engine object is still referenced (here, and by aiohttp's middleware cache)
    assert loaded_models() == models_before
    assert engine.model_dir == tiny_model_dir()
