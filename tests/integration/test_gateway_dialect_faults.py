"""The Responses and Messages dialects under what chat already survives: a weight update while a call generates,
the idle reaper, the agents' API key and a second call in flight, each answered in the dialect's own shape. Against
the scripted fake engine; interruptions land where the fake holds a request, never on timing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest

from fsm_rollout.gateway import AgentGateway, GatewaySession
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from tests.integration.test_gateway import runner_for

TEXT = "An answer that the engine produces in two pieces.<|im_end|>"
DIALECTS = ("responses", "messages")


def caller(gateway: AgentGateway, session: GatewaySession, dialect: str, key: str = "unused") -> Callable[[str], Any]:
    """One call of the dialect's SDK on the session, its answer's text returned."""
    if dialect == "responses":
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=key, max_retries=0)

        async def respond(text: str) -> str:
            return (await client.responses.create(model="m", input=text, store=False)).output_text

        return respond
    messages = anthropic.AsyncAnthropic(
        base_url=f"{gateway.url}/sessions/{session.session_id}", api_key=key, max_retries=0
    )

    async def message(text: str) -> str:
        answer = await messages.messages.create(model="m", max_tokens=256, messages=[{"role": "user", "content": text}])
        return "".join(block.text for block in answer.content if block.type == "text")

    return message


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_weight_update_mid_call_gives_the_whole_answer_and_records_both_versions(
    fake_vllm: FakeVLLMServer, tokenizer: Any, dialect: str
) -> None:
    async with AgentGateway(runner_for(fake_vllm, tokenizer)) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True, held_after=5)], session=session.session_id)
        call = asyncio.ensure_future(caller(gateway, session, dialect)("Hi"))
        await fake_vllm.wait_until_waiting(1)  # five tokens generated under the old weights
        async with gateway.runner.weight_update(version="v2"):
            assert gateway.runner.metrics().suspended == 1
        assert await call == TEXT.removesuffix("<|im_end|>")
        [sample] = await session.close()
    generated = tokenizer.encode(TEXT)
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt:] == generated and sample.loss_mask == [1] * len(generated)
    spans = sample.metadata["weight_version_spans"]
    assert [(span["start"], span["end"]) for span in spans] == [(0, 5), (5, len(generated))]
    assert spans[0]["version"] != "v2" and spans[1]["version"] == "v2"
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2  # the cut request and its continuation


async def test_the_idle_reaper_ends_each_dialects_session_and_a_late_call_is_a_409_in_its_shape(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    # far longer than a first call takes to arrive on a loaded machine: the limit between calls is what is tested
    async with AgentGateway(runner_for(fake_vllm, tokenizer), session_idle_timeout_s=10.0) as gateway:
        sessions = {dialect: await gateway.open_session() for dialect in DIALECTS}
        calls = {dialect: caller(gateway, session, dialect) for dialect, session in sessions.items()}
        for dialect, session in sessions.items():
            fake_vllm.script([ScriptedTurn(text="Hello.<|im_end|>")], session=session.session_id)
            assert await calls[dialect]("Hi") == "Hello."
        ended: list[Awaitable[Any]] = []
        for session in sessions.values():
            assert session.rollout is not None
            ended.append(asyncio.shield(session.rollout))
        await asyncio.wait_for(asyncio.gather(*ended), 60)  # both sessions' own idle limits end them
        with pytest.raises(openai.ConflictError) as late_responses:
            await calls["responses"]("Late")
        assert late_responses.value.code == "session_ended" and "agent_timeout" in str(late_responses.value)
        with pytest.raises(anthropic.ConflictError) as late_messages:
            await calls["messages"]("Late")
        body: Any = late_messages.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "agent_timeout" in body["error"]["message"]
        samples = {dialect: await session.close() for dialect, session in sessions.items()}
    for [sample] in samples.values():
        assert sample.status.value == "truncated" and sample.metadata["rollout_reason"] == "agent_timeout"
        assert sum(sample.loss_mask or []) == len(tokenizer.encode("Hello.<|im_end|>"))


async def test_responses_refuses_a_wrong_key_and_a_second_call_in_flight_in_openais_shape(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with AgentGateway(runner_for(fake_vllm, tokenizer), agent_api_key="agent-key") as gateway:
        session = await gateway.open_session()
        fake_vllm.script(
            [ScriptedTurn(text="ok<|im_end|>"), ScriptedTurn(text="slow<|im_end|>", hang=True)],
            session=session.session_id,
        )
        with pytest.raises(openai.AuthenticationError) as refused:
            await caller(gateway, session, "responses", key="wrong")("a")
        assert isinstance(refused.value.body, dict) and refused.value.body["type"] == "authentication_error"
        call = caller(gateway, session, "responses", key="agent-key")
        assert await call("a") == "ok"
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="agent-key", max_retries=0)
        first = asyncio.ensure_future(client.responses.create(model="m", input="b", store=False))
        await fake_vllm.wait_until_waiting(1)
        with pytest.raises(openai.ConflictError) as conflict:  # another call of the same chain, not a retry
            await client.responses.create(model="m", input="c", store=False)
        assert isinstance(conflict.value.body, dict) and conflict.value.body["message"]
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await session.abort()
