"""A conversation over the model's context is the agent's 400, and the session goes on when the agent trims it.

The first call over the context never got a prompt, so it leaves no sequence; a later call over it ends the sequence
that held the earlier turns, which is kept. Either way the agent's trimmed call starts a new sequence of the same
lineage, and every generated token is trained exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
TOO_LONG = "word " * 1500


@pytest.fixture
async def served(tokenizer: Any) -> AsyncIterator[tuple[AgentGateway, FakeVLLMServer]]:
    async with FakeVLLMServer(tokenizer, model=MODEL, max_model_len=1024) as server:
        config = RolloutConfig(
            engine_url=server.url, model=MODEL, max_turns=10, check_invariants=True, history_policy="append"
        )
        runner = RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer)
        async with AgentGateway(runner) as gateway:
            yield gateway, server


def _trained(samples: list[Sample]) -> list[int]:
    return [
        token
        for sample in samples
        for token, bit in zip(
            sample.tokens[len(sample.tokens) - sample.response_length :], sample.loss_mask or [], strict=True
        )
        if bit == 1
    ]


def _generated(server: FakeVLLMServer, texts: list[str], tokenizer: Any) -> list[int]:
    """What the fake generated: its scripted turns' tokens, one per generate request it answered."""
    assert len(server.requests_to(GENERATE_PATH)) == len(texts)
    return [token for text in texts for token in tokenizer.encode(text, add_special_tokens=False)]


async def test_a_first_call_over_the_context_leaves_nothing_and_the_trimmed_call_is_answered(
    served: tuple[AgentGateway, FakeVLLMServer], tokenizer: Any
) -> None:
    gateway, server = served
    session = await gateway.open_session()
    server.script([ScriptedTurn(text="Forty-two.<|im_end|>")], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TOO_LONG}])
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "context_length_exceeded"
    answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "6*7?"}])
    assert answer.choices[0].message.content == "Forty-two."
    samples = await session.close(reward=1.0)
    assert [(sample.status, sample.metadata["rollout_reason"]) for sample in samples] == [
        (Status.COMPLETED, "session_closed")
    ]
    assert _trained(samples) == _generated(server, ["Forty-two.<|im_end|>"], tokenizer)


async def test_a_later_call_over_the_context_keeps_the_earlier_turns_and_the_trimmed_call_goes_on(
    served: tuple[AgentGateway, FakeVLLMServer], tokenizer: Any
) -> None:
    gateway, server = served
    session = await gateway.open_session()
    server.script(
        [ScriptedTurn(text="Forty-two.<|im_end|>"), ScriptedTurn(text="Fifty-six.<|im_end|>")],
        session=session.session_id,
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "6*7?"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model=MODEL, messages=[*messages, {"role": "user", "content": TOO_LONG}])
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "context_length_exceeded"
    status = await session_status(gateway, session.session_id)
    assert status["session_state"] == "rollout_ended"
    trimmed = [*messages, {"role": "user", "content": "And 7*8?"}]
    second = await client.chat.completions.create(model=MODEL, messages=trimmed)
    assert second.choices[0].message.content == "Fifty-six."
    samples = await session.close(reward=1.0)
    assert len(samples) == 2  # the sequence that held the first turn, then the trimmed conversation's
    assert samples[-1].branches == samples[:-1]
    # the ended sequence keeps why it ended (the session's outcome is every sequence's status and reward)
    assert [sample.metadata["rollout_reason"] for sample in samples] == [
        "insufficient_budget_for_next_turn",
        "session_closed",
    ]
    assert samples[-1].status == Status.COMPLETED
    assert all(sample.metadata["lineage"] == "l0" for sample in samples)
    texts = ["Forty-two.<|im_end|>", "Fifty-six.<|im_end|>"]
    assert _trained(samples) == _generated(server, texts, tokenizer)  # every generated token trained once, in order
    assert all(sample.reward == 1.0 for sample in samples)


async def test_a_max_tokens_over_the_engines_context_is_cut_to_what_it_leaves(tokenizer: Any) -> None:
    """Claude Code asks every call for max_tokens 128000. A runner with no context length and no response budget
    takes the engine's context (its model list's max_model_len), as `fsm-rollout gateway` does, instead of sending
    what the engine refuses at each call."""
    async with FakeVLLMServer(tokenizer, model=MODEL, max_model_len=1024) as server:
        config = RolloutConfig(engine_url=server.url, model=MODEL, max_turns=10, check_invariants=True)
        sampling = {"max_new_tokens": None, "temperature": 1.0, "top_p": 1.0}
        runner = RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer)
        async with AgentGateway(runner) as gateway:
            assert gateway.runner.config.rollout_max_context_len == 1024
            session = await gateway.open_session()
            server.script([ScriptedTurn(text="Forty-two.<|im_end|>")], session=session.session_id)
            client = anthropic.AsyncAnthropic(
                base_url=f"{gateway.url}/sessions/{session.session_id}", api_key="unused", max_retries=0
            )
            # streamed, as Claude Code streams (the SDK refuses a whole answer this long)
            async with client.messages.stream(
                model=MODEL, max_tokens=128_000, messages=[{"role": "user", "content": "6*7?"}]
            ) as stream:
                answer = await stream.get_final_message()
            assert [block.text for block in answer.content if block.type == "text"] == ["Forty-two."]
            (request,) = server.requests_to(GENERATE_PATH)
            assert len(request.body["token_ids"]) + request.body["sampling_params"]["max_tokens"] == 1024
            await session.close()


async def session_status(gateway: AgentGateway, session_id: str) -> dict[str, Any]:
    return gateway.session(session_id).status()
