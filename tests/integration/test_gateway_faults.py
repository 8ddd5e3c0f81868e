"""The gateway under weight updates, disconnects and idle agents, against the scripted fake engine. Every
interruption lands where the fake server holds a request (``held_after`` tokens produced), never on timing."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import ABORT_PATH, GENERATE_PATH, FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
TEXT = "An answer that the engine produces in two pieces.<|im_end|>"


def gateway_for(server: FakeVLLMServer, tokenizer: Any, **options: Any) -> AgentGateway:
    config = RolloutConfig(engine_url=server.url, model="fake-model", max_turns=20, check_invariants=True)
    return AgentGateway(RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer), **options)


async def test_a_weight_update_mid_call_is_one_ordinary_answer(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True, held_after=5)], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        call = asyncio.ensure_future(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        )
        await fake_vllm.wait_until_waiting(1)
        async with gateway.runner.weight_update(version="v2"):
            assert gateway.runner.metrics().suspended == 1
        answer = await call
        assert answer.choices[0].message.content == TEXT.removesuffix("<|im_end|>")
        assert answer.choices[0].finish_reason == "stop"
        samples = await session.close()
    sample = samples[0]
    assert sample.metadata["rollout_reason"] == "session_closed"
    generated = tokenizer.encode(TEXT)
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt:] == generated and sample.loss_mask == [1] * len(generated)
    spans = sample.metadata["weight_version_spans"]
    assert [span["version"] for span in spans][-1] == "v2" and spans[0]["start"] == 0
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2  # the cut request and its continuation


async def test_an_agent_that_disconnects_and_never_retries_aborts_the_engine_request_and_keeps_earlier_turns(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer, disconnect_grace_s=0.0) as gateway:
        session = await gateway.open_session()
        fake_vllm.script(
            [ScriptedTurn(text="First.<|im_end|>"), ScriptedTurn(text=TEXT, hang=True)], session=session.session_id
        )
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Hi"}]
        await client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": "First."}, {"role": "user", "content": "Again"}]
        async with aiohttp.ClientSession() as http:

            async def call() -> str:
                async with http.post(f"{session.base_url}/chat/completions", json={"messages": messages}) as answer:
                    return await answer.text()

            pending = asyncio.ensure_future(call())
            await fake_vllm.wait_until_waiting(1)
            pending.cancel()  # the agent goes away: its connection closes mid-call
            assert session.rollout is not None
            await asyncio.wait_for(asyncio.shield(session.rollout), 30)  # the sequence's rollout ends
            assert fake_vllm.requests_to(ABORT_PATH)  # after naming the request to the engine
        status = session.status()
        samples = await session.close()
    assert status["status"] == "aborted" and status["reason"] == "agent_disconnected"
    sample = samples[0]
    assert sample.metadata["rollout_reason"] == "agent_disconnected"
    first = tokenizer.encode("First.<|im_end|>")
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt : prompt + len(first)] == first
    assert sum(sample.loss_mask or []) == len(first)


async def test_an_idle_agent_ends_its_session_truncated_agent_timeout(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    # far longer than the first call takes to arrive, even on a loaded machine: a session never called is reaped
    # once the limit passes (see the next test), and this test is about the limit between calls
    async with gateway_for(fake_vllm, tokenizer, session_idle_timeout_s=10.0) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text="Hello.<|im_end|>")], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Hi"}]
        await client.chat.completions.create(model="m", messages=messages)
        ended = session.rollout
        assert ended is not None
        await asyncio.wait_for(asyncio.shield(ended), 30)  # the session's own idle limit ends it
        messages += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Late"}]
        try:
            await client.chat.completions.create(model="m", messages=messages)
        except openai.ConflictError as error:
            assert "agent_timeout" in str(error)
        else:
            raise AssertionError("a call after the session timed out was answered")
        samples = await session.close()
    assert samples[0].status.value == "truncated" and samples[0].metadata["rollout_reason"] == "agent_timeout"
    assert sum(samples[0].loss_mask or []) == len(tokenizer.encode("Hello.<|im_end|>"))


async def test_a_session_never_called_is_reaped_truncated_agent_timeout(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer, session_idle_timeout_s=0.05) as gateway:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gateway.url}/sessions", json={}) as response:
                opened = await response.json()
            session = gateway.session(opened["session_id"])
            await asyncio.wait_for(session.wait_ended(), 30)  # the idle limit's timer ends it; no call came
            assert (session.status()["status"], session.status()["reason"]) == ("truncated", "agent_timeout")
            assert gateway.sessions == 0 and gateway.runner.metrics().sessions_open == 0
            async with http.get(f"{gateway.url}/sessions/{opened['session_id']}") as response:
                assert (await response.json())["session_state"] == "expired"  # kept for a late close
            chat = {"messages": [{"role": "user", "content": "late"}]}
            async with http.post(f"{opened['base_url']}/chat/completions", json=chat) as response:
                assert response.status == 409 and "agent_timeout" in await response.text()
            async with http.post(f"{gateway.url}/sessions/{opened['session_id']}/close") as response:
                assert response.status == 200 and (await response.json())["samples"] == []
        assert await session.close() == []
    assert not fake_vllm.requests_to(GENERATE_PATH)


async def test_a_client_timeout_and_the_sdks_own_retry_get_one_answer_generated_once(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True)], session=session.session_id)
        # each attempt gives up after 10 s; the engine holds the first attempt's generate until the retry came. The
        # retry is released as soon as it attached, so 10 s leaves a loaded machine ample room for its answer.
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=1, timeout=10.0)
        call = asyncio.ensure_future(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        )
        await fake_vllm.wait_until_waiting(1)
        await asyncio.wait_for(_until(lambda: session.calls == 2), 60)  # the SDK's retry attached
        assert session.state == "answering"
        (held,) = fake_vllm.held_request_ids
        fake_vllm.release(held)
        answer = await call
        assert answer.choices[0].message.content == TEXT.removesuffix("<|im_end|>")
        samples = await session.close()
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1 and not fake_vllm.requests_to(ABORT_PATH)
    (sample,) = samples
    assert sample.metadata["rollout_reason"] == "session_closed"
    generated = tokenizer.encode(TEXT)
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt:] == generated and sample.loss_mask == [1] * len(generated)  # the turn, once


async def test_a_retry_after_the_client_went_away_gets_the_answer_already_generated(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway, aiohttp.ClientSession() as http:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True)], session=session.session_id)
        body = {"messages": [{"role": "user", "content": "Hi"}]}

        async def call() -> Any:
            async with http.post(f"{session.base_url}/chat/completions", json=body) as response:
                return response.status, await response.json()

        gone = asyncio.ensure_future(call())
        await fake_vllm.wait_until_waiting(1)
        gone.cancel()  # the client goes away mid-call
        await asyncio.wait_for(_until(lambda: session.waiting_calls == 0), 30)  # the handler saw it go
        fake_vllm.release(fake_vllm.held_request_ids[0])
        await asyncio.wait_for(_until(lambda: session.state == "waiting_for_agent"), 30)  # answered to nobody
        status, answer = await call()  # the retry
        assert status == 200 and answer["choices"][0]["message"]["content"] == TEXT.removesuffix("<|im_end|>")
        # a retry naming the first call by its Idempotency-Key is that call too, whatever its body says
        headers = {"Idempotency-Key": "k-1"}
        first = {"messages": [*body["messages"], answer["choices"][0]["message"], {"role": "user", "content": "2?"}]}
        fake_vllm.script([ScriptedTurn(text="Two.<|im_end|>")], session=session.session_id)
        async with http.post(f"{session.base_url}/chat/completions", json=first, headers=headers) as response:
            assert (await response.json())["choices"][0]["message"]["content"] == "Two."
        again = {**first, "temperature": 0.3}
        async with http.post(f"{session.base_url}/chat/completions", json=again, headers=headers) as response:
            assert (await response.json())["choices"][0]["message"]["content"] == "Two."
        samples = await session.close()
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2 and not fake_vllm.requests_to(ABORT_PATH)
    (sample,) = samples
    assert sample.status.value == "completed"
    assert sum(sample.loss_mask or []) == len(tokenizer.encode(TEXT)) + len(tokenizer.encode("Two.<|im_end|>"))


async def _until(predicate: Any) -> None:
    """Wait (bounded by the caller) until ``predicate()`` holds: for what the gateway does on its own time."""
    while not predicate():  # noqa: ASYNC110 - the gateway has no event for it; bounded by the caller
        await asyncio.sleep(0.01)
