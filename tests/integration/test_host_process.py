"""A library must not change its host process behind its back: importing fsm_rollout and running rollouts with a
default config leaves the collector, the event loop, the process's hooks and its threads exactly as they were."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, Status, get_tracer
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.replay import replay_async
from fsm_rollout.runtime.pacing import _PACERS
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0}


def test_importing_the_library_registers_no_exit_or_fork_hook_and_leaves_the_collector_alone() -> None:
    program = textwrap.dedent(
        """
        import atexit, gc, importlib, os, pkgutil, sys
        registered = []
        atexit.register = lambda func, *a, **k: registered.append(("atexit", func.__module__))
        os.register_at_fork = lambda **k: registered.append(("fork", [f.__module__ for f in k.values()]))
        before = (gc.get_threshold(), gc.isenabled(), gc.get_freeze_count())
        import fsm_rollout
        # those import torch (slow, and not the library's core), or verl, which is installed apart
        skipped = ("fsm_rollout.engine.local", "fsm_rollout.cli", "fsm_rollout.examples",
                   "fsm_rollout.adapters.verl_agent_loop")
        for module in pkgutil.walk_packages(fsm_rollout.__path__, "fsm_rollout."):
            if not module.name.startswith(skipped):
                importlib.import_module(module.name)
        after = (gc.get_threshold(), gc.isenabled(), gc.get_freeze_count())
        ours = [entry for entry in registered if "fsm_rollout" in str(entry)]
        print(repr((before == after, ours)))
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "(True, [])", result.stderr


class ProcessState(RolloutHooks):
    """Notes the collector's and the loop's settings at every transition of every rollout."""

    def __init__(self) -> None:
        self.seen: set[tuple[Any, ...]] = set()

    def transition(self, *_: Any) -> None:
        self.seen.add(process_state())


def library_threads() -> set[str]:
    """The process's threads but the fake test server's own."""
    return {thread.name for thread in threading.enumerate() if not thread.name.startswith("fake-vllm")}


def process_state() -> tuple[Any, ...]:
    loop = asyncio.get_running_loop()
    return (
        gc.get_threshold(),
        gc.isenabled(),
        gc.get_freeze_count(),
        loop.get_debug(),
        loop.slow_callback_duration,
        loop.get_task_factory(),
        loop.get_exception_handler(),
    )


async def test_default_config_rollouts_and_replay_leave_the_collector_and_the_loop_as_they_were(
    fake_vllm: FakeVLLMServer, tokenizer: Any, make_config: Callable[..., RolloutConfig], tmp_path: Path
) -> None:
    config = make_config(max_turns=2, trace=str(tmp_path / "run.jsonl"))
    assert config.tune_gc is False and config.loop_slice_ms is None
    before = process_state()
    threads_before = library_threads()
    loop_pacers = [key for key in _PACERS if key[0] == id(asyncio.get_running_loop())]
    fake_vllm.script([ScriptedTurn(text="first"), ScriptedTurn(text="second")] * 16)
    observer = ProcessState()
    async with RolloutRunner(
        config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory(), hooks=observer
    ) as runner:
        batch = await runner.run_batch([Sample(prompt=f"q{i}", index=i) for i in range(4)], concurrency=2)
        group = await runner.run_group(Sample(prompt="g", index=9), 2)
        streamed = [sample async for sample in runner.stream([Sample(prompt="s", index=20)])]
    assert {sample.status for sample in batch + group + streamed} == {Status.TRUNCATED}
    assert observer.seen == {before}
    assert process_state() == before
    assert library_threads() == threads_before
    assert [key for key in _PACERS if key[0] == id(asyncio.get_running_loop())] == loop_pacers
    get_tracer(config.trace).close()


async def test_replaying_a_recording_freezes_nothing_and_leaves_the_collector_alone(
    fake_vllm: FakeVLLMServer,
    tokenizer: Any,
    make_config: Callable[..., RolloutConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = tmp_path / "run.jsonl"
    fake_vllm.script([ScriptedTurn(text="first"), ScriptedTurn(text="second")] * 4)
    config = make_config(max_turns=2, trace=str(trace), record=True)
    async with RolloutRunner(
        config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=ScriptedEnvFactory()
    ) as runner:
        await runner.run_batch([Sample(prompt=f"q{i}", index=i) for i in range(4)])
    before = process_state()
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    report = await replay_async(trace, tokenizer=tokenizer)
    assert report.counts() == {"identical": 4}, report.render(verbose=True)
    assert calls == []
    assert process_state() == before
    get_tracer(str(trace)).close()
