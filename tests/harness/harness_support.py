"""What the harness tests share: the gateway over the scripted fake engine, running a harness, the token checks."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))

from process_groups import start_group, stop_group

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.chat_templates import chat_template
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer
from fsm_rollout.testing.qwen3_6_tokenizer import load_qwen3_6_tokenizer
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

#: Generous: a harness's start-up and two calls take 1 to 3 s on an idle machine.
HARNESS_TIMEOUT_S: Final = 300.0
#: The harnesses' prompts are long (Codex ~10k tokens, Claude Code ~13k with the Qwen tokenizer).
MAX_MODEL_LEN: Final = 65536
SAMPLING: Final = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}
#: The command the model asks the harness's shell tool to run, in the harness's working directory.
COMMAND: Final = "echo harness-was-here > out.txt"
WRITTEN: Final = "harness-was-here\n"
FINAL_ANSWER: Final = "The file is written."


@dataclass(frozen=True)
class ModelCase:
    """The engine's model as the gateway sees it: its tokenizer and chat template, and whether its turns start
    with a ``<think>`` block (which the harness gets as a reasoning item or a thinking block and echoes back)."""

    name: str
    thinking: bool

    @property
    def tokenizer(self) -> Any:
        return _tokenizer(self.name)

    def turn(self, answer: str, reasoning: str) -> str:
        """One generated turn: the reasoning first when the model thinks, then ``answer`` and the end of turn."""
        opening = f"<think>\n{reasoning}\n</think>\n\n" if self.thinking else ""
        return f"{opening}{answer}<|im_end|>"


MODEL_CASES: Final = {
    # the test suite's Qwen2 tokenizer and template: renders any role and any content shape
    "qwen2": ModelCase("qwen2", thinking=False),
    # Qwen3's shipped template (Hermes tool calls, <think> kept after the last user query) on the real Qwen3.6
    # vocabulary, where <think> and </think> are single tokens
    "qwen3_thinking": ModelCase("qwen3_thinking", thinking=True),
}


@functools.cache
def _tokenizer(name: str) -> Any:
    if name == "qwen2":
        return load_qwen_tokenizer()
    tokenizer = load_qwen3_6_tokenizer()
    tokenizer.chat_template = chat_template("qwen3")
    return tokenizer


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The model's tool call in Qwen's (Hermes) markup."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@asynccontextmanager
async def gateway_over(
    tokenizer: Any, *, trace: str | None = None
) -> AsyncIterator[tuple[AgentGateway, FakeVLLMServer]]:
    """An :class:`AgentGateway` whose runner's engine is a scripted fake vLLM server with room for a harness's
    prompt (with ``trace``, the run is traced and recorded there, for ``fsm-rollout replay``)."""
    async with FakeVLLMServer(tokenizer, model="fake-model", max_model_len=MAX_MODEL_LEN) as server:
        config = RolloutConfig(
            engine_url=server.url,
            model="fake-model",
            max_turns=50,
            check_invariants=True,
            trace=trace,
            record=trace is not None,
        )
        runner = RolloutRunner(config, sampling_params=dict(SAMPLING), tokenizer=tokenizer)
        async with AgentGateway(runner) as gateway:
            yield gateway, server


@dataclass(frozen=True)
class HarnessRun:
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr[-6000:]}"


async def run_harness(command: Sequence[str], *, cwd: pathlib.Path, env: dict[str, str]) -> HarnessRun:
    """Run a harness (stdin empty) in a process group of its own, while this loop goes on serving the gateway; the
    group is stopped when it is done, timed out or the test is cancelled."""
    process = start_group(
        list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        try:
            out, err = await asyncio.to_thread(process.communicate, timeout=HARNESS_TIMEOUT_S)
        except subprocess.TimeoutExpired as timeout:
            partial = (timeout.stdout or b"").decode(errors="replace"), (timeout.stderr or b"").decode(errors="replace")
            raise AssertionError(
                f"{command[0]} did not finish in {HARNESS_TIMEOUT_S} s\n--- stdout ---\n{partial[0]}\n"
                f"--- stderr ---\n{partial[1][-6000:]}"
            ) from None
    finally:
        await asyncio.to_thread(stop_group, process)
    return HarnessRun(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def base_env(home: pathlib.Path) -> dict[str, str]:
    """A harness's environment: this process's PATH (node), a home of its own, nothing else of ours."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}


def check_token_exact(
    server: FakeVLLMServer, session_id: str, sequences: Sequence[Sample], scripted: Sequence[str], tokenizer: Any
) -> None:
    """The session is one training sequence: the engine's first prompt, then each answer the engine generated
    (mask 1) and what the harness sent in between (mask 0), ending with the last answer; every generate request
    sent exactly the sequence's tokens up to it."""
    requests = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session_id]
    assert len(requests) == len(scripted), f"{len(requests)} generate requests for {len(scripted)} scripted turns"
    generated = [tokenizer.encode(text, add_special_tokens=False) for text in scripted]
    check_sequence_exact([request.body["token_ids"] for request in requests], generated, sequences)


def check_sequence_exact(
    sent: Sequence[list[int]], generated: Sequence[list[int]], sequences: Sequence[Sample]
) -> None:
    """The session is one training sequence: the first prompt ``sent``, then each answer ``generated`` (mask 1)
    and what the harness sent in between (mask 0); every request sent exactly the sequence's tokens up to it."""
    assert len(sequences) == 1, [s.metadata.get("history_rewritten") for s in sequences]
    sequence = sequences[0]
    assert sequence.tokens == list(sent[-1]) + list(generated[-1])
    mask = [0] * len(sequence.tokens)
    for prompt, output in zip(sent, generated, strict=True):
        assert sequence.tokens[: len(prompt) + len(output)] == list(prompt) + list(output)
        mask[len(prompt) : len(prompt) + len(output)] = [1] * len(output)
    prompt_length = len(sequence.tokens) - sequence.response_length
    assert prompt_length == len(sent[0])
    assert sequence.loss_mask == mask[prompt_length:]


async def check_replays_identically(trace: pathlib.Path) -> None:
    """``fsm-rollout replay`` re-executes the recorded session (one sample) identically."""
    replayed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fsm_rollout.cli", "replay", str(trace)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "identical 1" in replayed.stdout, replayed.stdout
