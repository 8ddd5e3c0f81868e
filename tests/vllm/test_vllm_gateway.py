"""The agent gateway in front of a real ``vllm serve``: one ``openai`` SDK session, token-exact.

The tiny model has random weights, so it cannot be asked for a tool call; the session is a plain multi-turn
conversation, greedy and cut by the agent's ``max_completion_tokens``. Every request the gateway sends reaches vLLM
through the tier's recording proxy, so the exported sequences are checked against what vLLM was sent and what it
generated, token for token.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from vllm_helpers import GENERATE_PATH, RENDER_PATH, SERVED_MODEL, check_exported_as_generated

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner

pytestmark = pytest.mark.vllm

QUESTIONS = ["What is 6 * 7?", "And 6 * 8?", "Thanks. One more: 7 * 8?"]


async def test_an_sdk_session_exports_exactly_what_vllm_was_sent_and_generated(proxy: Any, vllm_tokenizer: Any) -> None:
    config = RolloutConfig(
        engine_url=proxy.url, model=SERVED_MODEL, max_turns=10, check_invariants=True, request_timeout_s=300.0
    )
    runner = RolloutRunner(
        config, sampling_params={"max_new_tokens": 200, "temperature": 0.0, "top_p": 1.0}, tokenizer=vllm_tokenizer
    )
    async with AgentGateway(runner) as gateway:
        session = await gateway.open_session(metadata={"tier": "vllm"})
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0, timeout=300.0)
        models = await client.models.list()
        assert [model.id for model in models.data] == [SERVED_MODEL]
        messages: list[Any] = [{"role": "system", "content": "You are a calculator."}]
        answers = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = await client.chat.completions.create(
                model=SERVED_MODEL, messages=messages, max_completion_tokens=8, temperature=0.0, logprobs=True
            )
            answers.append(answer)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        samples = await session.close(reward=1.0)

    generates = proxy.to(GENERATE_PATH)
    assert len(generates) == len(QUESTIONS)
    assert all(exchange.status == 200 for exchange in generates)
    # every request the session made names it (the runner's own start-up check of the engine does not)
    session_requests = [exchange for exchange in proxy.exchanges if exchange.path not in {"/health", "/v1/models"}]
    assert session_requests and all(
        exchange.headers.get("x-session-id") == session.session_id for exchange in session_requests
    )
    # the requests carried the agent's settings
    assert all(exchange.body["sampling_params"]["max_tokens"] <= 8 for exchange in generates)
    assert all(exchange.body["sampling_params"]["temperature"] == 0.0 for exchange in generates)
    assert samples[-1].metadata["rollout_reason"] == "session_closed"
    assert samples[-1].branches == samples[:-1]
    assert all(sample.reward == 1.0 for sample in samples)
    # each request continued an exported sequence with vLLM's tokens, each trained exactly once, in order
    generated = check_exported_as_generated(generates, samples)
    # each sequence's prompt is a render vLLM answered, and the first is the first call's
    renders = [list(exchange.response["token_ids"]) for exchange in proxy.to(RENDER_PATH)]
    for sample in samples:
        assert sample.tokens[: len(sample.tokens) - sample.response_length] in renders
    assert samples[0].tokens[: len(renders[0])] == renders[0]
    # the agent saw vLLM's tokens: answer text and logprobs are read from them, never re-tokenized
    for answer, exchange, tokens in zip(answers, generates, generated, strict=True):
        choice = answer.choices[0]
        eos = vllm_tokenizer.eos_token_id
        text_ids = tokens[:-1] if tokens[-1] == eos else tokens
        assert (choice.message.content or "") == vllm_tokenizer.decode(text_ids, skip_special_tokens=False).strip()
        assert answer.usage is not None and answer.usage.completion_tokens == len(tokens)
        assert choice.logprobs is not None and choice.logprobs.content is not None
        vllm_logprobs = exchange.response["choices"][0]["logprobs"]["content"]
        assert [item.logprob for item in choice.logprobs.content] == pytest.approx(
            [item["logprob"] for item in vllm_logprobs]
        )
