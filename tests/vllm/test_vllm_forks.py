"""Trajectories that fork against real vLLM serving a chat template that strips the thinking of earlier turns
(``--chat-template``): under ``fork`` and ``per_turn`` every sequence's prompt is one of vLLM's own renders, each
render is that template's rendering of the conversation sent, and the trainable tokens are exactly vLLM's answers.

The random model is made to think: each turn is sampled from the tokens of ``</think>`` and `` ok`` only
(``allowed_token_ids``, set on the rollout's request parameters) and stops on the stop string ``</think>``, so the
template drops what the turn wrote once a user observation follows, and the fork policy forks at each observation.
This module starts a server of its own (the session's serves the model's own template).
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import build_vllm_env
import pytest
from conftest import RecordingProxy, VLLMServer, start_server
from vllm_helpers import GENERATE_PATH, RENDER_PATH, SERVED_MODEL

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, VLLMClient, training_sequences
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.templates import THINK_STRIPPING_CHAT_TEMPLATE
from fsm_rollout.tokens.parity import template_token_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def stripping_server(tmp_path_factory: pytest.TempPathFactory, vllm_python: pathlib.Path) -> Iterator[VLLMServer]:
    folder = tmp_path_factory.mktemp("vllm-stripping")
    template = folder / "stripping.jinja"
    template.write_text(THINK_STRIPPING_CHAT_TEMPLATE)
    venv = build_vllm_env.ensure_vllm_venv()
    server = start_server(
        venv, build_vllm_env.ensure_tiny_model(), folder / "vllm-serve.log", ("--chat-template", str(template))
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stripping_tokenizer(stripping_server: VLLMServer) -> Any:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(stripping_server.model_dir), local_files_only=True)
    tokenizer.chat_template = THINK_STRIPPING_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
async def recording(stripping_server: VLLMServer) -> AsyncIterator[RecordingProxy]:
    async with RecordingProxy(stripping_server.url) as proxy:
        yield proxy


def prompt_of(sequence: Sample) -> list[int]:
    return sequence.tokens[: len(sequence.tokens) - sequence.response_length]


def trained(sequence: Sample) -> list[int]:
    response = sequence.tokens[len(sequence.tokens) - sequence.response_length :]
    return [token for token, mask in zip(response, sequence.loss_mask or [], strict=True) if mask == 1]


def thinking_tokens(tokenizer: Any) -> list[int]:
    return [*tokenizer.encode("</think>", add_special_tokens=False), *tokenizer.encode(" ok", add_special_tokens=False)]


@pytest.mark.parametrize("policy", ["fork", "per_turn"])
async def test_every_sequence_is_prompted_with_vllms_render_and_trained_on_vllms_tokens(
    policy: str, recording: RecordingProxy, stripping_tokenizer: Any
) -> None:
    forks = 0
    async with VLLMClient(recording.url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.05)) as client:
        for seed in range(3):
            recording.exchanges.clear()
            rollout = Rollout(
                Sample(prompt=f"What is 6 * 7? ({seed})", index=seed),
                config=RolloutConfig(
                    engine_url=recording.url,
                    model=SERVED_MODEL,
                    max_turns=3,
                    check_invariants=True,
                    request_timeout_s=300.0,
                    history_policy=policy,
                ),
                sampling_params={
                    "max_new_tokens": 600,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "seed": seed,
                    "stop": ["</think>"],
                    "no_stop_trim": True,
                },
                client=client,
                tokenizer=stripping_tokenizer,
                env_factory=ScriptedEnvFactory(),
            )
            rollout.inference_params["allowed_token_ids"] = thinking_tokens(stripping_tokenizer)
            sample = await rollout.run()
            sequences = training_sequences([sample])
            renders = [exchange for exchange in recording.to(RENDER_PATH)]
            rendered = [list(exchange.response["token_ids"]) for exchange in renders]
            for exchange, token_ids in zip(renders, rendered, strict=True):  # vLLM serves the stripping template
                local = stripping_tokenizer.apply_chat_template(
                    exchange.body["messages"], tokenize=True, add_generation_prompt=True
                )
                assert token_ids == template_token_ids(local, what="local render")
            generated = [
                token
                for exchange in recording.to(GENERATE_PATH)
                for token in exchange.response["choices"][0]["token_ids"]
            ]
            assert [token for sequence in sequences for token in trained(sequence)] == generated
            for sequence in sequences:
                assert prompt_of(sequence) in rendered
                sequence.check_invariants(len(prompt_of(sequence)))
            if policy == "per_turn":
                assert len(sequences) == len(recording.to(GENERATE_PATH))
            if policy == "fork":  # every observation rewrote the history: one fork each
                assert len(sample.branches) == sample.metadata.get("branch", 0) == len(rendered) - 1
            forks += len(sample.branches)
    assert forks >= 3
