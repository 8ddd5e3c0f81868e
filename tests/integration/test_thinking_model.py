"""The CPU recipe for a thinking template: the default model retrained in Qwen3.6's format (built once, cached like
the default model) reasons in ``<think>...</think>`` and then answers; ``fsm-rollout run --chat-template qwen3_6``
runs on it with ``auto`` choosing ``fork`` (the template drops earlier reasoning); the gateway hands the reasoning
back apart from the content; every exported sequence is what the engine was sent and generated."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from spy_transport import GenerateSpy
from test_run_cli import cli_env, one_error_line  # pytest puts this directory on sys.path

from fsm_rollout import RolloutConfig, Sample, training_sequences
from fsm_rollout.data.figures import FIGURE_SIZE
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local import thinking_model as thinking_module
from fsm_rollout.engine.local.default_model import (
    DEFAULT_MODEL_NAME,
    Conversation,
    TrainingData,
    encode_conversations,
    read_training_data,
    recipe_key,
)
from fsm_rollout.engine.local.thinking_model import (
    THINK_CLOSE,
    thinking_model_dir,
    thinking_model_name,
    thinking_recipe,
    thinking_training_data,
)
from fsm_rollout.engine.local.tiny import BUILD_MARKER, TINY_MODEL_NAME
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.chat_templates import chat_template

SAMPLING = {"max_new_tokens": 192, "temperature": 1.0, "top_p": 1.0, "stop": ["</tool_call>"], "no_stop_trim": True}
# a turn in the trained format: reasoning (no tags), the closing tag, then a tool call or the final boxed answer
WELL_FORMED = re.compile(r"(?s)[^<]+\n</think>\n\n(<tool_call>\{.*\}</tool_call>|The answer is \\boxed\{.*\}\.)")


class Spy(GenerateSpy):
    """Each generate request and its answer."""

    @property
    def generates(self) -> list[tuple[dict[str, Any], Any]]:
        return [(each.payload, each.answer) for each in self.seen]


def check_token_exact(generates: Sequence[tuple[dict[str, Any], dict[str, Any]]], sequences: Sequence[Sample]) -> None:
    """Each request continued exactly one exported sequence with the engine's tokens (mask 1 on them), and the
    trained tokens are the generated ones, each once, in order."""
    generated = [list(answer["choices"][0]["token_ids"]) for _, answer in generates]
    for (payload, _), tokens in zip(generates, generated, strict=True):
        sent = list(payload["token_ids"])
        holders = [s for s in sequences if s.tokens[: len(sent) + len(tokens)] == sent + tokens]
        assert len(holders) == 1, "no exported sequence (or more than one) continues this request"
        start = len(sent) - (len(holders[0].tokens) - holders[0].response_length)
        assert holders[0].loss_mask is not None and holders[0].loss_mask[start : start + len(tokens)] == [1] * len(
            tokens
        )
    trained = [
        token
        for s in sequences
        for token, bit in zip(s.tokens[len(s.tokens) - s.response_length :], s.loss_mask or [], strict=True)
        if bit
    ]
    assert sorted(trained) == sorted(token for tokens in generated for token in tokens)
    assert len(trained) == sum(len(tokens) for tokens in generated)


def test_thinking_turns_reason_then_answer_as_the_default_data_does() -> None:
    shipped = read_training_data()
    thinking = thinking_training_data(shipped)
    assert len(thinking.conversations) == len(shipped.conversations) and thinking.figure_size == shipped.figure_size
    for before, after in zip(shipped.conversations, thinking.conversations, strict=True):
        assert (after.prompt, after.observations) == (before.prompt, before.observations)
        for turn, rewritten in zip(before.turns, after.turns, strict=True):
            assert WELL_FORMED.fullmatch(rewritten), rewritten
            reasoning, answer = rewritten.split(THINK_CLOSE)
            assert turn.endswith(answer) and "<think>" not in reasoning  # the prompt opens the block
    assert recipe_key(thinking, thinking_recipe()) != recipe_key()  # never the default model's cache entry


def test_the_build_serves_the_template_and_reuse_trains_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    built = thinking_model_dir()
    assert built.name == f"{thinking_model_name()}-{recipe_key(thinking_training_data(), thinking_recipe())}"
    assert thinking_model_name() == f"{DEFAULT_MODEL_NAME}-qwen3_6"
    marker = json.loads((built / BUILD_MARKER).read_text(encoding="utf-8"))
    assert marker["recipe"] == thinking_recipe() and marker["base"] == TINY_MODEL_NAME
    assert marker["loss_first"] > 10 > 1 > marker["loss_last"]
    served = json.loads((built / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert served == chat_template("qwen3_6")  # the template as shipped, not the training one

    def no_training(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a finished build was trained again")

    monkeypatch.setattr(thinking_module, "train_model_dir", no_training)
    said: list[str] = []
    assert thinking_model_dir(log=said.append) == built and said == []
    with pytest.raises(ValueError, match="no thinking model for chat template 'qwen3'"):
        thinking_model_dir("qwen3")


async def test_rollouts_reason_fork_at_each_observation_and_are_token_exact() -> None:
    """What the model writes is a draw: each sample has its own seed, and the test bounds the share of well-formed
    turns far below what a build of the recipe shows, instead of asking it of every turn."""
    samples = practice_samples(8, seed=41)
    async with LocalEngine(thinking_model_dir(), served_model_name=thinking_model_name()) as engine:
        config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name,
                               tokenizer_path=str(engine.model_dir), image_merge_size=engine.image_merge_size,
                               max_turns=3, env_path="fsm_rollout.envs.geo3k", check_invariants=True)  # fmt: skip
        async with RolloutRunner(config, sampling_params=SAMPLING) as runner:
            assert runner.history_policy == "fork"  # auto: the template drops the reasoning of earlier turns
            client = runner.engine_client(engine.url)
            spy = Spy(client.transport)
            client.transport = spy
            results = await runner.run_batch(samples, concurrency=len(samples), seeds=list(range(len(samples))))
            tokenizer = runner.tokenizer
    sequences = training_sequences(results)
    check_token_exact(spy.generates, sequences)
    texts = [tokenizer.decode(answer["choices"][0]["token_ids"]) for _, answer in spy.generates]
    well_formed = [text for text in texts if WELL_FORMED.match(text)]
    assert len(well_formed) >= 0.7 * len(texts), texts
    forked = [sample for sample in results if sample.branches]
    assert len(forked) >= len(results) // 2  # a second turn re-renders without the first one's reasoning
    for sample in forked:
        assert all("</think>" in str(branch.response) for branch in sample.branches)
    # each first prompt is the one the training encoded (its template keeps reasoning and renders prompts alike)
    from transformers import AutoTokenizer

    base = thinking_model_dir().parent / f"{thinking_model_name()}-training" / TINY_MODEL_NAME
    training = encode_conversations(
        TrainingData(tuple(Conversation(str(s.prompt), ("x",), ()) for s in results), FIGURE_SIZE),
        AutoTokenizer.from_pretrained(str(base), local_files_only=True),
    )
    for sample, example in zip(results, training, strict=True):
        first = training_sequences([sample])[0]
        prompt = first.tokens[: len(first.tokens) - first.response_length]
        assert example.token_ids[: len(prompt)] == prompt and not any(example.trainable[: len(prompt)])


async def test_the_gateway_hands_the_reasoning_back_apart_from_the_answer() -> None:
    question = practice_samples(1, seed=43)[0]
    async with LocalEngine(thinking_model_dir(), served_model_name=thinking_model_name()) as engine:
        config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name,
                               tokenizer_path=str(engine.model_dir), max_turns=10, check_invariants=True)  # fmt: skip
        runner = RolloutRunner(config, sampling_params={**SAMPLING, "max_new_tokens": 400})
        async with AgentGateway(runner) as gateway:
            client_of_engine = runner.engine_client(engine.url)
            spy = Spy(client_of_engine.transport)
            client_of_engine.transport = spy
            answers = []
            for seed in range(4):
                session = await gateway.open_session()
                client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
                reply = await client.chat.completions.create(
                    model=engine.served_model_name, messages=[{"role": "user", "content": str(question.prompt)}],
                    max_tokens=96, seed=seed, stop=["</tool_call>"],
                )  # fmt: skip
                answers.append(reply.choices[0].message)
                check_token_exact(spy.generates[-1:], await session.close(reward=1.0))
    # vLLM's field with a reasoning parser, beside the content; the SDK keeps unknown fields as extras
    reasoned = [(answer.model_extra or {}).get("reasoning_content") for answer in answers]
    assert sum(bool(reasoning) for reasoning in reasoned) >= 3, answers
    for answer, reasoning in zip(answers, reasoned, strict=True):
        assert "think>" not in (answer.content or "") and "think>" not in (reasoning or "")


async def test_run_with_the_thinking_template_says_auto_forks_and_writes_reasoned_turns(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", "--chat-template", "qwen3_6", "--limit", "2",
               "--n-samples-per-prompt", "2", "--seed", "5", "--quiet", "--out", str(out)]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(None)
    )
    stdout, stderr = (part.decode() for part in await asyncio.wait_for(process.communicate(), timeout=300))
    assert process.returncode == 0, stderr
    [policy] = [line for line in stderr.splitlines() if line.startswith("history policy:")]
    assert policy.startswith("history policy: auto chose fork"), policy
    assert re.search(r"history: [1-9]\d* fork\(s\)", stdout), stdout
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4 and all(row["status"] in ("completed", "truncated") for row in rows)
    turns = [branch["response"] for row in rows for branch in row["branches"]] + [row["response"] for row in rows]
    assert sum(bool(WELL_FORMED.match(turn)) for turn in turns) >= 0.7 * len(turns), turns


async def test_a_vllm_url_refuses_the_chat_template_before_anything_starts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", "--chat-template", "qwen3_6", "--engine-url",
               "http://127.0.0.1:9", "--out", str(tmp_path / "r.jsonl")]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(None)
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 2
    assert "--chat-template qwen3_6 picks the embedded engine's thinking model" in one_error_line(stderr.decode())


async def test_serve_with_the_thinking_template_serves_the_thinking_model() -> None:
    import aiohttp

    command = [sys.executable, "-m", "fsm_rollout.cli", "serve", "--chat-template", "qwen3_6", "--port", "0",
               "--stop-on-stdin-eof"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=cli_env(None),
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    try:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=300)).decode().strip()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as response:
            models = await response.json()
        [model] = models["data"]
        assert model["id"] == thinking_model_name() and model["root"] == str(thinking_model_dir())
    finally:
        process.stdin.close()  # --stop-on-stdin-eof: the engine stops
        await asyncio.wait_for(process.wait(), timeout=60)
    assert process.returncode == 0


async def test_serve_refuses_the_thinking_template_with_a_model_directory(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "fsm_rollout.cli", "serve", "--chat-template", "qwen3_6", "--model",
               str(tmp_path)]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(None)
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 1
    assert "--model DIR serves the directory's own template" in stderr.decode()
