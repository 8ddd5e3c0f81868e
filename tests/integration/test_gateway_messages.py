"""The gateway's Anthropic Messages API over real HTTP, driven by the ``anthropic`` SDK against the scripted fake."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import pytest

from fsm_rollout import Sample
from fsm_rollout.gateway import AgentGateway, GatewaySession
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from tests.integration.test_gateway import CALL, png_data_url, runner_for

TOOLS: Any = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}},
            "required": ["a", "b"],
        },
    }
]
SYSTEM: Any = [{"type": "text", "text": "You add numbers.", "cache_control": {"type": "ephemeral"}}]
THOUGHT_CALL = "<think>\nI should add them.\n</think>\n\n" + CALL
ANSWER = "The sum is 5.<|im_end|>"
GREETING = "<think>\nhm\n</think>\n\nHello there.<|im_end|>"


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> AsyncIterator[AgentGateway]:
    async with AgentGateway(runner_for(fake_vllm, tokenizer)) as gateway:
        yield gateway


def client_for(gateway: AgentGateway, session: GatewaySession, **options: Any) -> anthropic.AsyncAnthropic:
    # the base URL Claude Code and the SDK take: they build <base>/v1/messages themselves
    options.setdefault("api_key", "unused")
    return anthropic.AsyncAnthropic(base_url=f"{gateway.url}/sessions/{session.session_id}", max_retries=0, **options)


def body_of(error: anthropic.APIStatusError) -> Any:
    return error.body


def check_exact(server: FakeVLLMServer, session_id: str, sample: Sample, texts: list[str], tokenizer: Any) -> None:
    """The sample's tokens are the first prompt, then each generated turn with mask 1 and, between turns, the
    observation with mask 0: each generate request sent exactly the tokens so far, nothing re-tokenized."""
    requests = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session_id]
    assert len(requests) == len(texts)
    prompt_length = len(sample.tokens) - sample.response_length
    mask: list[int] = []
    for index, (request, text) in enumerate(zip(requests, texts, strict=True)):
        sent = request.body["token_ids"]
        generated = tokenizer.encode(text)
        mask.extend([0] * (len(sent) - prompt_length - len(mask)))
        assert sample.tokens[: len(sent)] == sent
        assert sample.tokens[len(sent) : len(sent) + len(generated)] == generated, index
        mask.extend([1] * len(generated))
    assert sample.loss_mask == mask
    assert len(sample.tokens) == prompt_length + len(mask)


async def test_sdk_tool_session_is_token_exact_and_echoed_thinking_is_no_fork(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session(metadata={"task": "add"})
    fake_vllm.script([ScriptedTurn(text=THOUGHT_CALL), ScriptedTurn(text=ANSWER)], session=session.session_id)
    client = client_for(gateway, session)
    messages: Any = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await client.messages.create(
        model="claude-any-name",
        max_tokens=256,
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,
        metadata={"user_id": "user-7"},
        extra_headers={"X-Claude-Code-Session-Id": "cc-session-1"},
    )
    assert isinstance(first, anthropic.types.Message)
    assert first.id.startswith("msg_") and first.role == "assistant" and first.model == "fake-model"
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    thinking, tool_use = first.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == "I should add them."
    assert thinking.signature
    assert isinstance(tool_use, anthropic.types.ToolUseBlock)
    assert tool_use.id.startswith("toolu_") and tool_use.name == "add"
    assert tool_use.input == {"a": 2, "b": 3, "exact": False}
    assert first.usage.output_tokens == len(tokenizer.encode(THOUGHT_CALL)) and first.usage.input_tokens > 0
    assert first.usage.cache_read_input_tokens == 0
    # the client sends the thinking block back (with our signature) and the call, then the tool's result
    messages.append({"role": "assistant", "content": [block.model_dump() for block in first.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "5"}]})
    second = await client.messages.create(
        model="claude-any-name",
        max_tokens=64,
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,
        extra_body={"temperature": 0.25, "top_k": 20},
    )
    assert [block.type for block in second.content] == ["text"]
    assert isinstance(second.content[0], anthropic.types.TextBlock) and second.content[0].text == "The sum is 5."
    assert second.stop_reason == "end_turn"
    samples = await session.close(reward=1.0)
    assert len(samples) == 1 and samples[0].branches == []  # the echoed thinking block is no rewrite
    assert gateway.runner.metrics().forks == 0
    sample = samples[0]
    assert sample.metadata["rollout_reason"] == "session_closed" and sample.reward == 1.0
    check_exact(fake_vllm, session.session_id, sample, [THOUGHT_CALL, ANSWER], tokenizer)
    generates = fake_vllm.requests_to(GENERATE_PATH)
    params = generates[1].body["sampling_params"]
    assert params["temperature"] == 0.25 and params["top_k"] == 20 and params["max_tokens"] <= 64
    # the prompt: the system block's text, the tool as a function with its schema; the observation: the result
    render = fake_vllm.requests_to(RENDER_PATH)[-1].body
    assert render["messages"][0] == {"role": "system", "content": "You add numbers."}
    assert render["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    text = tokenizer.decode(sample.tokens)
    assert "<tool_response>\n5\n</tool_response>" in text


async def test_sdk_streams_thinking_text_and_tool_use(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text=GREETING), ScriptedTurn(text=CALL)],
        session=session.session_id,
    )
    client = client_for(gateway, session)
    messages: Any = [{"role": "user", "content": "Hi"}]
    async with client.messages.stream(
        model="m",
        max_tokens=128,
        messages=messages,
        tools=TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello there."
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert isinstance(final.content[0], anthropic.types.ThinkingBlock) and final.content[0].thinking == "hm"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    messages.append({"role": "assistant", "content": [block.model_dump() for block in final.content]})
    messages.append({"role": "user", "content": "Add 2 and 3."})
    raw: Any = await client.messages.create(model="m", max_tokens=128, messages=messages, tools=TOOLS, stream=True)
    events = [event async for event in raw]
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[1]
    assert isinstance(start, anthropic.types.RawContentBlockStartEvent)
    assert start.content_block.type == "tool_use" and start.content_block.name == "add"
    delta = events[2]
    assert isinstance(delta, anthropic.types.RawContentBlockDeltaEvent) and delta.delta.type == "input_json_delta"
    assert json.loads(delta.delta.partial_json) == {"a": 2, "b": 3, "exact": False}
    assert events[-2].delta.stop_reason == "tool_use"
    samples = await session.close()
    assert len(samples) == 1 and samples[0].branches == []
    check_exact(fake_vllm, session.session_id, samples[0], [GREETING, CALL], tokenizer)


async def test_count_tokens_is_the_first_calls_prompt(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text="ok<|im_end|>")], session=session.session_id)
    client = client_for(gateway, session)
    request: dict[str, Any] = {
        "model": "m",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}],
        "tools": TOOLS,
    }
    counted = await client.messages.count_tokens(**request)
    answer = await client.messages.create(max_tokens=16, **request)
    assert counted.input_tokens == answer.usage.input_tokens > 0
    assert counted.input_tokens == len(fake_vllm.requests_to(GENERATE_PATH)[0].body["token_ids"])
    await session.close()


async def test_errors_come_in_anthropics_shape_and_the_sdk_raises_its_classes(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with (
        AgentGateway(runner_for(fake_vllm, tokenizer), agent_api_key="agent-key") as gateway,
        aiohttp.ClientSession() as http,
    ):
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text="slow<|im_end|>", hang=True)], session=session.session_id)
        base = f"{gateway.url}/sessions/{session.session_id}"
        hi: Any = [{"role": "user", "content": "hi"}]
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await client_for(gateway, session, api_key="wrong").messages.create(model="m", max_tokens=8, messages=hi)
        assert refused.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or wrong API key"},
        }
        unknown = anthropic.AsyncAnthropic(base_url=f"{gateway.url}/sessions/nope", api_key="agent-key", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as missing:
            await unknown.messages.create(model="m", max_tokens=8, messages=hi)
        assert body_of(missing.value)["error"]["type"] == "not_found_error"
        client = client_for(gateway, session, api_key="agent-key")  # x-api-key
        url_image: Any = [
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]}
        ]
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="m", max_tokens=8, messages=url_image)
        assert body_of(bad.value)["error"]["type"] == "invalid_request_error"
        for body in (
            {"model": "m", "messages": hi},  # no max_tokens
            {"model": "m", "max_tokens": 8, "messages": hi, "frobnicate": 1},  # not a Messages field
            {"model": "m", "max_tokens": 8, "messages": [{"role": "wizard", "content": "x"}]},
        ):
            async with http.post(base + "/v1/messages", json=body, headers={"x-api-key": "agent-key"}) as response:
                assert response.status == 400
                error = await response.json()
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        async with http.post(base + "/v1/messages", data=b"{", headers={"x-api-key": "agent-key"}) as response:
            assert response.status == 400 and (await response.json())["error"]["type"] == "invalid_request_error"
        # a Bearer token (ANTHROPIC_AUTH_TOKEN) is the key too; a second call while one is in flight is a 409
        bearer = client_for(gateway, session, api_key=None, auth_token="agent-key")
        first = bearer.messages.create(model="m", max_tokens=8, messages=hi)
        pending = asyncio.ensure_future(first)
        await fake_vllm.wait_until_waiting(1)
        with pytest.raises(anthropic.ConflictError) as conflict:
            await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "other"}])
        assert body_of(conflict.value)["error"]["type"] == "invalid_request_error"
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await session.abort()


async def test_fields_the_gateway_does_not_use_are_accepted_and_a_claude_code_sized_request_runs(
    tokenizer: Any,
) -> None:
    async with (
        FakeVLLMServer(tokenizer, model="fake-model", max_model_len=32768) as fake_vllm,
        AgentGateway(runner_for(fake_vllm, tokenizer)) as gateway,
    ):
        await claude_code_sized_request(gateway, fake_vllm)


async def claude_code_sized_request(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=CALL)], session=session.session_id)
    tools: list[dict[str, Any]] = [
        {
            "name": f"tool_{index}",
            "description": "A tool of the harness. " * 40,
            "input_schema": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "what to run " * 10}},
                "required": ["command"],
            },
            "cache_control": {"type": "ephemeral"} if index == 19 else None,
        }
        for index in range(20)
    ]
    tools = [{key: value for key, value in tool.items() if value is not None} for tool in tools]
    tools += [*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    tools.append({"type": "bash_20250124", "name": "bash"})
    body = {
        "model": "claude-sonnet-9",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Instructions. " * 1500, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                    {"type": "text", "text": "Add 2 and 3.", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
        "tools": tools,
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account__session_123"},
        "service_tier": "auto",
        "container": None,
        "mcp_servers": [],
        "speed": "standard",
    }
    raw = json.dumps(body).encode()
    assert len(raw) > 45_000
    headers = {
        "x-api-key": "unused",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
        "X-Claude-Code-Session-Id": "cc-1",
        "content-type": "application/json",
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{gateway.url}/sessions/{session.session_id}/v1/messages?beta=true", data=raw, headers=headers
        ) as response,
    ):
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        stream = await response.text()
    names = [line.removeprefix("event: ") for line in stream.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert '"name":"add"' in stream
    # the typed tools are out of the prompt and named in the session's metadata; the function tools are in it
    assert session.metadata["dropped_tools"] == ["web_search", "bash"]
    render = fake_vllm.requests_to(RENDER_PATH)[-1].body
    assert [tool["function"]["name"] for tool in render["tools"]] == [*(f"tool_{i}" for i in range(20)), "add"]
    samples = await session.close()
    assert samples[0].metadata["gateway_session"]["dropped_tools"] == ["web_search", "bash"]


async def test_image_blocks_reach_the_engine_as_images_in_the_prompt_and_a_tool_result(tokenizer: Any) -> None:
    from fsm_rollout.testing.fake_vllm import QwenLikeImageRender

    red, blue = png_data_url((200, 0, 0)), png_data_url((0, 0, 200))

    def block(url: str) -> dict[str, Any]:
        media, data = url.removeprefix("data:").split(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}

    async with (
        FakeVLLMServer(tokenizer, model="fake-model", render_features=QwenLikeImageRender(tokenizer)) as fake,
        AgentGateway(runner_for(fake, tokenizer, image_merge_size=2)) as gateway,
    ):
        session = await gateway.open_session()
        fake.script([ScriptedTurn(text=CALL), ScriptedTurn(text=ANSWER)], session=session.session_id)
        client = client_for(gateway, session)
        messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Add these."}, block(red)]}]
        first = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=TOOLS)
        tool_use = first.content[0]
        assert isinstance(tool_use, anthropic.types.ToolUseBlock)
        result = {
            "type": "tool_result",
            "tool_use_id": tool_use.id,
            "content": [{"type": "text", "text": "5"}, block(blue)],
        }
        messages += [
            {"role": "assistant", "content": [item.model_dump() for item in first.content]},
            {"role": "user", "content": [result]},
        ]
        second = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=TOOLS)
        assert second.stop_reason == "end_turn"
        samples = await session.close()
    assert len(samples) == 1 and samples[0].branches == []
    sample = samples[0]
    check_exact(fake, session.session_id, sample, [CALL, ANSWER], tokenizer)
    urls = [
        part["image_url"]["url"]
        for request in fake.requests_to(RENDER_PATH)
        for message in request.body["messages"]
        for part in (message["content"] if isinstance(message["content"], list) else [])
        if part.get("type") == "image_url"
    ]
    assert red in urls and blue in urls and urls.index(red) < urls.index(blue)
    assert sample.multimodal_train_inputs is not None and len(sample.multimodal_train_inputs["image_grid_thw"]) == 2


async def test_a_stop_sequence_is_cut_from_the_text_and_the_answer_sent_back_so_is_no_fork(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session()
    # the engine cuts the scripted turn at the stop string, which its tokens keep
    fake_vllm.script(
        [ScriptedTurn(text="Result: 5 END and more<|im_end|>"), ScriptedTurn(text="ok<|im_end|>")],
        session=session.session_id,
    )
    client = client_for(gateway, session)
    messages: Any = [{"role": "user", "content": "go"}]
    first = await client.messages.create(model="m", max_tokens=64, messages=messages, stop_sequences=["STOP", "END"])
    assert (first.stop_reason, first.stop_sequence) == ("stop_sequence", "END")
    assert [block.model_dump() for block in first.content] == [{"type": "text", "text": "Result: 5", "citations": None}]
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": "more"},
    ]
    second = await client.messages.create(model="m", max_tokens=64, messages=messages, stop_sequences=["END"])
    assert second.stop_reason == "end_turn"
    samples = await session.close()
    assert len(samples) == 1 and gateway.runner.metrics().forks == 0
    check_exact(fake_vllm, session.session_id, samples[0], ["Result: 5 END", "ok<|im_end|>"], tokenizer)
