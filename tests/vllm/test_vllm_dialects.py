"""The gateway's Responses and Messages dialects in front of a real ``vllm serve``: one session each, token-exact.

As in ``test_vllm_gateway.py``, the tiny model has random weights, so the sessions are plain multi-turn
conversations, greedy and cut by the client's token limit. The Responses session sends its whole input each time,
as Codex does (``store: false``); the Messages session sends its whole history, as Claude Code does. Every request
the gateway sends reaches vLLM through the tier's recording proxy, so the exported sequences are checked against
what vLLM was sent and what it generated, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anthropic
import openai
import pytest
from vllm_helpers import GENERATE_PATH, SERVED_MODEL, check_exported_as_generated

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.sample import Sample

pytestmark = pytest.mark.vllm

QUESTIONS = ["What is 6 * 7?", "And 6 * 8?"]
LIMIT = 8


def _runner(proxy: Any, tokenizer: Any) -> RolloutRunner:
    config = RolloutConfig(
        engine_url=proxy.url, model=SERVED_MODEL, max_turns=10, check_invariants=True, request_timeout_s=300.0
    )
    return RolloutRunner(
        config, sampling_params={"max_new_tokens": 200, "temperature": 0.0, "top_p": 1.0}, tokenizer=tokenizer
    )


def _check_token_exact(proxy: Any, samples: Sequence[Sample], texts: Sequence[str], tokenizer: Any) -> None:
    generates = [exchange for exchange in proxy.to(GENERATE_PATH) if exchange.status == 200]
    assert len(generates) == len(texts)
    generated = check_exported_as_generated(generates, samples)
    for text, tokens in zip(texts, generated, strict=True):  # the client read vLLM's tokens, never re-tokenized
        eos = tokenizer.eos_token_id
        text_ids = tokens[:-1] if tokens[-1] == eos else tokens
        assert text == tokenizer.decode(text_ids, skip_special_tokens=False).strip()


async def test_a_responses_session_with_the_whole_input_each_call_is_token_exact(
    proxy: Any, vllm_tokenizer: Any
) -> None:
    async with AgentGateway(_runner(proxy, vllm_tokenizer)) as gateway:
        session = await gateway.open_session(metadata={"tier": "vllm", "dialect": "responses"})
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0, timeout=300.0)
        items: list[Any] = []
        texts = []
        for number, question in enumerate(QUESTIONS):
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
            request = dict(
                model=SERVED_MODEL,
                instructions="You are a calculator.",
                input=items,
                max_output_tokens=LIMIT,
                temperature=0.0,
                store=False,
            )
            if number % 2:  # streamed, as Codex calls it; cut by the token limit, it ends `response.incomplete`
                async with client.responses.stream(**request) as stream:
                    ends = [
                        event.response
                        async for event in stream
                        if event.type in ("response.completed", "response.incomplete")
                    ]
                assert len(ends) == 1
                response = ends[0]
            else:
                response = await client.responses.create(**request)
            texts.append(response.output_text)
            items += [item.model_dump(exclude_none=True) for item in response.output]
        samples = await session.close(reward=1.0)
    assert [sample.metadata["rollout_reason"] for sample in samples][-1] == "session_closed"
    assert all(sample.metadata["rollout_reason"] != "history_rewritten" for sample in samples)
    _check_token_exact(proxy, samples, texts, vllm_tokenizer)


async def test_a_messages_session_is_token_exact(proxy: Any, vllm_tokenizer: Any) -> None:
    async with AgentGateway(_runner(proxy, vllm_tokenizer)) as gateway:
        session = await gateway.open_session(metadata={"tier": "vllm", "dialect": "messages"})
        base = session.base_url.removesuffix("/v1")  # Anthropic clients add /v1/messages themselves
        client = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0, timeout=300.0)
        messages: list[Any] = []
        texts = []
        for number, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            request = dict(
                model=SERVED_MODEL,
                system=[{"type": "text", "text": "You are a calculator.", "cache_control": {"type": "ephemeral"}}],
                messages=messages,
                max_tokens=LIMIT,  # greedy: the runner's temperature (this SDK no longer takes one)
            )
            if number % 2:  # streamed, as Claude Code calls it
                async with client.messages.stream(**request) as stream:
                    message = await stream.get_final_message()
            else:
                message = await client.messages.create(**request)
            text = "".join(block.text for block in message.content if block.type == "text")
            texts.append(text)
            messages.append({"role": "assistant", "content": [block.model_dump() for block in message.content]})
        samples = await session.close(reward=1.0)
    assert all(sample.metadata["rollout_reason"] != "history_rewritten" for sample in samples)
    _check_token_exact(proxy, samples, texts, vllm_tokenizer)
