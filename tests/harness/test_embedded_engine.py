"""Codex CLI and Claude Code, unchanged, through the gateway on the embedded engine serving the harness model: the
model calls the harness's shell tool, the harness runs exactly that command, the model answers, and the session is
token-exact.

The harness model (:mod:`fsm_rollout.engine.local.harness_model`) is built once into the cache (a session fixture;
a first build trains for several minutes on the CPU). The engine decodes greedily (temperature 0), so each run is the
same. The task asks for a name and a text the training never asked together; the tests check that the command the
model wrote ran (its file holds its text), not that the model copied the task's words, which this tiny model does
not yet do reliably (see the harness model's docs).
"""

from __future__ import annotations

import json
import pathlib
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import pytest
from harness_install import Harnesses
from harness_support import base_env, check_sequence_exact, run_harness
from spy_transport import GenerateSpy
from test_claude_code import claude_env
from test_codex import API_KEY_VAR, codex_home

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.harness_data import FINAL_ANSWER, HELD_OUT, task_text
from fsm_rollout.engine.local.harness_model import HARNESS_MODEL_NAME, harness_model_dir
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner

NAME, TEXT = HELD_OUT
TASK: Final = task_text(NAME, TEXT)
#: The command the harness model writes: ``echo TEXT > NAME`` (its training's only shape).
ECHO: Final = re.compile(r"echo (\S+) > (\S+)")
#: Greedy: the harness model's answers are the same on every run.
SAMPLING: Final = {"max_new_tokens": 96, "temperature": 0.0}


@pytest.fixture(scope="session")
def harness_model() -> pathlib.Path:
    started = time.perf_counter()
    directory = harness_model_dir()
    print(f"\nharness model ready in {time.perf_counter() - started:.1f} s: {directory}")
    return directory


class Spy(GenerateSpy):
    """Each generate request, its answer and its time."""

    @property
    def generates(self) -> list[tuple[dict[str, Any], Any, float]]:
        return [(each.payload, each.answer, each.seconds) for each in self.seen]


@asynccontextmanager
async def gateway_on_harness_model(model_dir: pathlib.Path) -> AsyncIterator[tuple[AgentGateway, Spy, Any]]:
    async with LocalEngine(model_dir, served_model_name=HARNESS_MODEL_NAME) as engine:
        config = RolloutConfig(
            engine_url=engine.url,
            model=HARNESS_MODEL_NAME,
            tokenizer_path=str(engine.model_dir),
            max_turns=50,
            check_invariants=True,
        )
        runner = RolloutRunner(config, sampling_params=dict(SAMPLING))
        async with AgentGateway(runner) as gateway:
            spy = Spy(runner.engine_client(engine.url).transport)
            runner.engine_client(engine.url).transport = spy
            yield gateway, spy, runner.tokenizer


def show_calls(spy: Spy, tool: str, tokenizer: Any) -> None:
    """Each call's prompt length, generate time and answer (shown with ``pytest -s``)."""
    for index, (payload, answer, seconds) in enumerate(spy.generates):
        text = tokenizer.decode(answer["choices"][0]["token_ids"])
        print(f"{tool} call {index + 1}: {len(payload['token_ids'])} prompt tokens, {seconds:.2f} s: {text!r}")


def model_command(spy: Spy, tokenizer: Any, tool: str, argument: str) -> str:
    """The shell command of the model's first answer: one call of ``tool`` in Qwen's markup."""
    text = tokenizer.decode(spy.generates[0][1]["choices"][0]["token_ids"])
    found = re.search(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.S)
    assert found, text
    call = json.loads(found.group(1))
    assert call["name"] == tool, call
    return str(call["arguments"][argument])


def check_ran(command: str, workdir: pathlib.Path) -> None:
    """The harness ran exactly the model's ``echo TEXT > NAME``: the file it names holds its text."""
    shape = ECHO.fullmatch(command)
    assert shape, command
    text, name = shape.groups()
    assert (workdir / name).read_text(encoding="utf-8") == f"{text}\n"


def check_session(spy: Spy, sequences: list[Sample], tokenizer: Any) -> str:
    """Two calls, the first the shell tool's call, token-exact with the mask on the generated tokens only; the
    observation between them decoded."""
    sent = [payload["token_ids"] for payload, _, _ in spy.generates]
    generated = [answer["choices"][0]["token_ids"] for _, answer, _ in spy.generates]
    assert len(sent) == 2, [tokenizer.decode(each) for each in generated]
    assert tokenizer.decode(generated[1]).startswith(FINAL_ANSWER)
    check_sequence_exact(sent, generated, sequences)
    return str(tokenizer.decode(sent[1][len(sent[0]) + len(generated[0]) :]))


async def test_codex_runs_the_harness_models_shell_call_on_the_embedded_engine(
    harnesses: Harnesses, harness_model: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    async with gateway_on_harness_model(harness_model) as (gateway, spy, tokenizer):
        session = await gateway.open_session(metadata={"harness": "codex"})
        env = {
            **base_env(tmp_path / "home"),
            "CODEX_HOME": str(codex_home(tmp_path / "codex-home", session.base_url)),
            API_KEY_VAR: "unused",
        }
        command = [
            str(harnesses.codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK,
        ]  # fmt: skip
        run = await run_harness(command, cwd=workdir, env=env)
        show_calls(spy, "exec_command", tokenizer)
        assert run.returncode == 0, run.describe()
        assert run.stdout.strip() == FINAL_ANSWER, run.describe()
        check_ran(model_command(spy, tokenizer, "exec_command", "cmd"), workdir)
        sequences = await session.close(reward=1.0)
    observation = check_session(spy, sequences, tokenizer)
    assert "Process exited with code 0" in observation


async def test_claude_code_runs_the_harness_models_bash_call_on_the_embedded_engine(
    harnesses: Harnesses, harness_model: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    async with gateway_on_harness_model(harness_model) as (gateway, spy, tokenizer):
        session = await gateway.open_session(metadata={"harness": "claude-code"})
        command = [str(harnesses.claude), "-p", "--allowedTools", "Bash", "--", TASK]
        run = await run_harness(command, cwd=workdir, env=claude_env(tmp_path / "home", session.base_url))
        show_calls(spy, "Bash", tokenizer)
        assert run.returncode == 0, run.describe()
        assert run.stdout.strip() == FINAL_ANSWER, run.describe()
        check_ran(model_command(spy, tokenizer, "Bash", "command"), workdir)
        sequences = await session.close(reward=1.0)
    observation = check_session(spy, sequences, tokenizer)
    assert "(Bash completed with no output)" in observation
