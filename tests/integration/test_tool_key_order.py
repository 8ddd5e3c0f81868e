"""Tool schemas that differ only in key order (langchain's ``{"properties","required","type"}`` and litellm's and
openai-agents' ``{"type","properties","required"}``) through one runner and one gateway: templates write keys in the
order given, so each order renders its own tokens and neither may take the other's cached ones. Also the gateway's
OpenAI contract around tools, stop strings and errors: a call without tools gets no tool call, the stop string is
not in the content, and no answer shows an internal URL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnv
from fsm_rollout.testing.fake_vllm import RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.tokens.parity import check_template_parity

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
PROPERTIES = {"expression": {"type": "string"}}
LANGCHAIN: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate.",
            "parameters": {"properties": PROPERTIES, "required": ["expression"], "type": "object"},
        },
    }
]
LITELLM: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate.",
            "parameters": {"type": "object", "properties": PROPERTIES, "required": ["expression"]},
        },
    }
]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>'
RESULT = {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"}


def config_for(server: FakeVLLMServer, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": MODEL,
        "max_turns": 2,
        "check_invariants": True,
        "history_policy": "append",
    }
    values.update(overrides)
    return RolloutConfig(**values)


async def test_two_key_orders_through_one_runner_each_render_their_own_tokens(tokenizer: Any) -> None:
    samples = [
        Sample(prompt="What is 6 * 7?", index=index, metadata={"tools": tools})
        for index, tools in enumerate((LANGCHAIN, LITELLM, LANGCHAIN))
    ]
    async with FakeVLLMServer(tokenizer, model=MODEL) as server:
        server.script([ScriptedTurn(text=text) for _ in samples for text in (CALL, "It is 42.<|im_end|>")])

        def factory(*, sample: Sample, args: Any) -> ScriptedEnv:
            # each sample's own tool result: equal ones would share a cached boundary and hide a shared prefix
            return ScriptedEnv(steps=[({**RESULT, "content": str(40 + (sample.index or 0))}, False)])

        async with RolloutRunner(
            config_for(server), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory
        ) as runner:
            done = await runner.run_batch(samples, concurrency=1)
        renders = server.requests_to(RENDER_PATH)
    assert [sample.metadata.get("rollout_error") for sample in done] == [None, None, None]
    assert [sample.status for sample in done] == [Status.TRUNCATED] * 3  # max_turns, after both turns
    assert [list(render.body["tools"][0]["function"]["parameters"]) for render in renders] == [
        ["properties", "required", "type"],
        ["type", "properties", "required"],
        ["properties", "required", "type"],
    ]
    for sample, tools in zip(done, (LANGCHAIN, LITELLM, LANGCHAIN), strict=True):
        # the whole sample is the template's rendering of its conversation with its own tools, in their order
        report = check_template_parity(sample, tokenizer, tools=tools)
        assert report.ok, report.describe()
        assert json.dumps(tools[0]["function"]["parameters"]) in tokenizer.decode(sample.tokens)


@pytest.fixture
async def served(tokenizer: Any) -> AsyncIterator[tuple[AgentGateway, FakeVLLMServer]]:
    async with FakeVLLMServer(tokenizer, model=MODEL, max_model_len=1024) as server:
        runner = RolloutRunner(config_for(server, max_turns=10), sampling_params=SAMPLING, tokenizer=tokenizer)
        async with AgentGateway(runner) as gateway:
            yield gateway, server


async def tool_session(gateway: AgentGateway, server: FakeVLLMServer, tools: Any) -> Sample:
    session = await gateway.open_session()
    server.script([ScriptedTurn(text=CALL), ScriptedTurn(text="It is 42.<|im_end|>")], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    (call,) = first.choices[0].message.tool_calls or []
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    second = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    assert second.choices[0].message.content == "It is 42."
    (sample,) = await session.close()
    return sample


async def test_langchain_and_litellm_key_orders_in_one_gateway(
    served: tuple[AgentGateway, FakeVLLMServer], tokenizer: Any
) -> None:
    gateway, server = served
    for tools in (LANGCHAIN, LITELLM, LANGCHAIN):
        sample = await tool_session(gateway, server, tools)
        assert sample.status == Status.COMPLETED and not sample.branches
        report = check_template_parity(sample, tokenizer, tools=tools)
        assert report.ok, report.describe()


async def test_a_call_without_tools_never_gets_a_tool_call(served: tuple[AgentGateway, FakeVLLMServer]) -> None:
    gateway, server = served
    session = await gateway.open_session()
    server.script([ScriptedTurn(text=CALL)], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "6*7?"}])
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL.removesuffix("<|im_end|>").strip()
    await session.close()


async def test_the_stop_string_is_left_out_of_the_content_and_kept_in_the_tokens(
    served: tuple[AgentGateway, FakeVLLMServer], tokenizer: Any
) -> None:
    gateway, server = served
    session = await gateway.open_session()
    server.script([ScriptedTurn(text="It is 42. DONE and more")], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "6*7?"}], stop=["DONE"]
    )
    assert answer.choices[0].message.content == "It is 42."
    (sample,) = await session.close()
    assert "It is 42. DONE" in tokenizer.decode(sample.tokens)  # the fake cut after the stop string, as vLLM does
    assert "and more" not in tokenizer.decode(sample.tokens)


async def test_a_prompt_over_the_context_is_a_400_without_the_engines_url(
    served: tuple[AgentGateway, FakeVLLMServer],
) -> None:
    gateway, server = served
    session = await gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1500}])
    body = raised.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in body["message"]
    assert server.url not in body["message"] and "http" not in body["message"]
    await session.close()
