"""The gateway's OpenAI Responses API over real HTTP, driven by the ``openai`` SDK's ``responses`` client against the
scripted fake engine: token-exact sessions, streams, stored responses, errors, auto sessions and the session list."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "strict": False,
}
# tools Codex sends beside its functions: they cannot be called through chat markup, so they are dropped
HOSTED = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch", "description": "Patch files."}]
THINKING = "<think>\nThe user wants a sum; the add tool does it.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
FINAL = "The sum is 5.<|im_end|>"


def runner_for(server: FakeVLLMServer, tokenizer: Any, **overrides: Any) -> RolloutRunner:
    values: dict[str, Any] = {"engine_url": server.url, "model": "fake-model", "max_turns": 50}
    values["check_invariants"] = True
    values.update(overrides)
    return RolloutRunner(RolloutConfig(**values), sampling_params=SAMPLING, tokenizer=tokenizer)


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> AsyncIterator[AgentGateway]:
    async with AgentGateway(runner_for(fake_vllm, tokenizer)) as gateway:
        yield gateway


def check_one_sequence(
    server: FakeVLLMServer, session_id: str, sample: Sample, texts: list[str], tokenizer: Any
) -> None:
    """The session is one sequence: each generate request sent the sequence so far, the engine's tokens follow it
    with mask 1 (exactly the generated ones), and the observations between them have mask 0."""
    requests = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session_id]
    assert len(requests) == len(texts)
    generated = [tokenizer.encode(text) for text in texts]
    assert sample.tokens == requests[-1].body["token_ids"] + generated[-1]
    prompt_length = len(requests[0].body["token_ids"])
    assert len(sample.tokens) - sample.response_length == prompt_length
    expected_mask: list[int] = []
    for index, request in enumerate(requests):
        sent = request.body["token_ids"]
        assert sample.tokens[: len(sent)] == sent  # a prefix of the exported sequence: nothing re-tokenized
        observed = len(sent) - prompt_length - len(expected_mask)
        expected_mask += [0] * observed + [1] * len(generated[index])
        assert sample.tokens[len(sent) : len(sent) + len(generated[index])] == generated[index]
    assert sample.loss_mask == expected_mask


async def test_sdk_tool_session_with_reasoning_is_token_exact_and_no_fork(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session(metadata={"task": "add"})
    fake_vllm.script([ScriptedTurn(text=THINKING + CALL), ScriptedTurn(text=FINAL)], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]}
    first = await client.responses.create(
        model="fake-model",
        instructions="You add numbers.",
        input=[user],  # type: ignore[list-item]
        tools=[ADD, *HOSTED],  # type: ignore[list-item]
        include=["reasoning.encrypted_content"],
        store=False,
        reasoning={"summary": "auto"},
        prompt_cache_key="conversation-1",
        parallel_tool_calls=False,
    )
    assert first.status == "completed" and first.object == "response"
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert [part.text for part in reasoning.summary] == ["The user wants a sum; the add tool does it."]
    assert reasoning.encrypted_content
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert first.usage is not None and first.usage.output_tokens == len(tokenizer.encode(THINKING + CALL))
    # the thinking's share: the generated tokens through the one whose text completes </think>
    generated = tokenizer.encode(THINKING + CALL)
    thinking = next(n for n in range(len(generated)) if "</think>" in tokenizer.decode(generated[:n]))
    assert first.usage.output_tokens_details.reasoning_tokens == thinking
    assert 0 < thinking < first.usage.output_tokens and "<tool_call>" not in tokenizer.decode(generated[:thinking])
    assert first.parallel_tool_calls is False and first.prompt_cache_key == "conversation-1"
    # the hosted and freeform tools never reached the engine's render; the session lists them
    rendered = fake_vllm.requests_to(RENDER_PATH)[0].body
    assert [tool["function"]["name"] for tool in rendered["tools"]] == ["add"]
    assert rendered["messages"][0] == {"role": "system", "content": "You add numbers."}
    assert session.metadata["dropped_tools"] == [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]
    # Codex's way: store false and the whole input each time, the model's reasoning (opaque content and all) and
    # its call echoed back with the call's output
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    second = await client.responses.create(
        model="fake-model",
        instructions="You add numbers.",
        input=[user, *echoed, {"type": "function_call_output", "call_id": call.call_id, "output": "5"}],  # type: ignore[list-item]
        tools=[ADD, *HOSTED],  # type: ignore[list-item]
        include=["reasoning.encrypted_content"],
        store=False,
        max_output_tokens=40,
        temperature=0.25,
    )
    assert second.output_text == "The sum is 5."
    assert [item.type for item in second.output] == ["message"]
    samples = await session.close(reward=1.0)
    assert len(samples) == 1  # the echoed reasoning item is no fork
    sample = samples[0]
    assert sample.metadata["rollout_reason"] == "session_closed" and "history_rewritten" not in sample.metadata
    assert sample.metadata["gateway_session"]["dropped_tools"][1]["name"] == "apply_patch"
    check_one_sequence(fake_vllm, session.session_id, sample, [THINKING + CALL, FINAL], tokenizer)
    params = fake_vllm.requests_to(GENERATE_PATH)[1].body["sampling_params"]
    assert params["temperature"] == 0.25 and params["max_tokens"] <= 40
    # the tool output is the only observation: a tool message answering the model's call
    observed = tokenizer.decode(sample.tokens[len(fake_vllm.requests_to(GENERATE_PATH)[0].body["token_ids"]) :])
    assert "<tool_response>\n5\n</tool_response>" in observed


async def test_sdk_streams_the_responses_event_grammar(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text=THINKING + "Hello there.<|im_end|>"), ScriptedTurn(text=CALL)], session=session.session_id
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    stream = await client.responses.create(model="m", input="Hi", tools=[ADD], stream=True)  # type: ignore[list-item]
    events = [event async for event in stream]
    # how many deltas a text comes in depends on how far the engine is ahead of the gateway: one kind per run
    kinds = [
        kind
        for index, kind in enumerate(event.type for event in events)
        if index == 0 or kind != events[index - 1].type
    ]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == "Hello there."
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == "Hello there."
    # the SDK's stream helper accumulates the events into the final response (store: true by default, so the next
    # call continues it by id with only its new input)
    async with client.responses.stream(
        model="m",
        input="Now add 2 and 3.",
        tools=[ADD],
        previous_response_id=completed.response.id,  # type: ignore[list-item]
    ) as helper:
        async for _ in helper:
            pass
        final = await helper.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    samples = await session.close()
    assert len(samples) == 1 and samples[0].metadata["rollout_reason"] == "session_closed"


async def test_stored_responses_continue_by_id_and_errors_are_openais(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=CALL), ScriptedTurn(text=FINAL)], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    first = await client.responses.create(model="m", input="What is 2 + 3?", tools=[ADD])  # type: ignore[list-item]
    call = first.output[0]
    assert call.type == "function_call"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert missing.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.create(model="m", input="x", max_output_tokens=0)
    assert bad.value.code == "max_output_tokens" and "max_output_tokens" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as unknown_item:
        await client.responses.create(model="m", input=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]
    assert "input[0]" in str(unknown_item.value)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="m", input="x", background=True)
    assert refused.value.code == "background"
    second = await client.responses.create(
        model="m",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        tools=[ADD],  # type: ignore[list-item]
        previous_response_id=first.id,
    )
    assert second.output_text == "The sum is 5." and second.previous_response_id == first.id
    samples = await session.close()
    assert len(samples) == 1
    check_one_sequence(fake_vllm, session.session_id, samples[0], [CALL, FINAL], tokenizer)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gateway.url}/sessions/nope/v1/responses", json={"input": "x"}) as response,
    ):
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "session_not_found"


async def test_an_image_item_reaches_the_engine_and_a_cut_answer_is_incomplete(tokenizer: Any) -> None:
    from fsm_rollout.testing.fake_vllm import QwenLikeImageRender

    async with (
        FakeVLLMServer(tokenizer, model="fake-model", render_features=QwenLikeImageRender(tokenizer)) as fake,
        AgentGateway(runner_for(fake, tokenizer, image_merge_size=2)) as gateway,
    ):
        session = await gateway.open_session()
        fake.script([ScriptedTurn(text="A red square, seen in full detail.<|im_end|>")], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        url = png_data_url()
        content = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]
        answer = await client.responses.create(
            model="m",
            input=[{"role": "user", "content": content}],  # type: ignore[list-item, misc]
            max_output_tokens=3,
        )
        assert answer.status == "incomplete"
        assert answer.incomplete_details is not None and answer.incomplete_details.reason == "max_output_tokens"
        await session.close()
        message = fake.requests_to(RENDER_PATH)[0].body["messages"][0]
        assert message["content"][1] == {"type": "image_url", "image_url": {"url": url}}


def png_data_url() -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 0, 0)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def test_auto_sessions_are_keyed_by_the_clients_header_and_listed(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with AgentGateway(runner_for(fake_vllm, tokenizer), auto_sessions=True, api_key="control") as gateway:
        metadata = {"session_id": "codex-1", "thread_id": "t-1", "agent_name": "main", "request_kind": "turn"}
        codex_headers = {"x-codex-turn-metadata": json.dumps(metadata), "x-codex-window-id": "codex-1:0"}
        agent = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, default_headers=codex_headers
        )
        fake_vllm.script([ScriptedTurn(text=CALL), ScriptedTurn(text=FINAL)])
        models = await agent.models.list()
        assert [model.id for model in models.data] == ["fake-model"]
        first = await agent.responses.create(model="m", input="What is 2 + 3?", tools=[ADD], store=False)  # type: ignore[list-item]
        call = first.output[0]
        assert call.type == "function_call"
        assert gateway.sessions == 1
        await agent.responses.create(
            model="m",
            input=[
                {"role": "user", "content": "What is 2 + 3?"},
                call.model_dump(exclude_none=True),  # type: ignore[list-item]
                {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
            ],
            tools=[ADD],  # type: ignore[list-item]
            store=False,
        )
        assert gateway.sessions == 1  # the same key: the same session
        # a chat client keyed by x-session-id opens its own
        chat = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, default_headers={"x-session-id": "chat-7"}
        )
        fake_vllm.script([ScriptedTurn(text="Hi!<|im_end|>")])
        hello = await chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hey"}])
        assert hello.choices[0].message.content == "Hi!"
        keyless = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as no_key:
            await keyless.responses.create(model="m", input="x")
        assert no_key.value.code == "session_key_missing" and "x-session-id" in str(no_key.value)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway.url}/sessions") as response:
                assert response.status == 401
            headers = {"Authorization": "Bearer control"}
            async with http.get(f"{gateway.url}/sessions", headers=headers) as response:
                listed = (await response.json())["sessions"]
            keys = {entry["metadata"]["session_key"]: entry for entry in listed}
            assert set(keys) == {"codex-1", "chat-7"}
            assert keys["codex-1"]["calls"] == 2 and keys["chat-7"]["calls"] == 1
            assert all(entry["created"] > 0 and entry["session_state"] == "waiting_for_agent" for entry in listed)
            for entry in listed:
                url = f"{gateway.url}/sessions/{entry['session_id']}/close"
                async with http.post(url, headers=headers, json={"reward": 1}) as response:
                    samples = (await response.json())["samples"]
                assert len(samples) == 1 and samples[0]["metadata"]["rollout_reason"] == "session_closed"
            async with http.get(f"{gateway.url}/sessions", headers=headers) as response:
                assert (await response.json())["sessions"] == []
        # a key whose session was closed opens a new one
        fake_vllm.script([ScriptedTurn(text="Again.<|im_end|>")])
        await chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hey"}])
        assert gateway.sessions == 1


async def test_the_codex_headers_reach_the_calls_hints(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text="Ok.<|im_end|>")], session=session.session_id)
    seen: list[Any] = []
    chat = session.chat

    async def spy(call: Any, **kwargs: Any) -> Any:
        seen.append(call.hints)
        return await chat(call, **kwargs)

    session.chat = spy  # type: ignore[method-assign]
    metadata = {"session_id": "s", "thread_id": "t2", "parent_thread_id": "t1", "agent_name": "explorer"}
    headers = {"x-codex-turn-metadata": json.dumps(metadata), "x-codex-window-id": "s:3"}
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0, default_headers=headers)
    await asyncio.wait_for(client.responses.create(model="m", input="Hi"), 30)
    assert seen == [
        {"session_key": "s", "lineage_key": "t2", "parent_lineage_key": "t1", "agent": "explorer", "window": "s:3"}
    ]
    await session.close()
