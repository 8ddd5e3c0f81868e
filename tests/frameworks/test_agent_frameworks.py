"""Agent frameworks users train with, unchanged, through the gateway: each runs one tool-using session (the model
calls a tool, the framework runs it and sends the result, the model answers), and the session's export is checked
token-exact against what the engine was sent and generated.

The engine is the fake vLLM server with scripted turns and the real Qwen tokenizer, so the model's tool call is
known; everything between the framework and the engine (the gateway's OpenAI surface, the framework's own message
history, tool schemas in its own key order, its retries) is real.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.sample import Sample
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

QUESTION = "What is 6 times 7? Use the multiply tool."
ANSWER = "The product is 42."
EOS = "<|im_end|>"


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>{EOS}"


SCRIPT = [tool_call_text("multiply", {"a": 6, "b": 7}), ANSWER + EOS]


def multiply_impl(a: int, b: int) -> int:
    return a * b


def make_runner(fake_vllm: FakeVLLMServer, tokenizer: Any) -> RolloutRunner:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=20, check_invariants=True)
    return RolloutRunner(
        config, sampling_params={"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}, tokenizer=tokenizer
    )


def assert_token_exact(samples: list[Sample], fake_vllm: FakeVLLMServer, tokenizer: Any, script: list[str]) -> None:
    """Every generated token is trained once with mask 1, in order, and every engine request continued a sequence
    the session exports."""
    generates = fake_vllm.requests_to(GENERATE_PATH)
    assert len(generates) == len(script), [request.body.get("token_ids", [])[-8:] for request in generates]
    generated = [tokenizer.encode(text) for text in script]
    trained = []
    for sample in samples:
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        trained.extend(t for t, bit in zip(response, sample.loss_mask or [], strict=True) if bit)
    assert trained == [t for run in generated for t in run]
    for request, output in zip(generates, generated, strict=True):
        sent = request.body["token_ids"]
        assert any(s.tokens[: len(sent) + len(output)] == sent + output for s in samples), (
            "a request and its answer are not a prefix of any exported sequence"
        )
    assert samples[-1].metadata["rollout_reason"] == "session_closed"


async def run_session(fake_vllm: FakeVLLMServer, tokenizer: Any, drive: Any) -> tuple[list[Sample], Any]:
    async with AgentGateway(make_runner(fake_vllm, tokenizer)) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=text) for text in SCRIPT], session=session.session_id)
        result = await drive(session.base_url)
        samples = list(await session.close(reward=1.0))
    return samples, result


async def test_openai_agents_runs_a_tool_using_session(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its default exporter posts traces to OpenAI's servers

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return multiply_impl(a, b)

    async def drive(base_url: str) -> str:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="fake-model", openai_client=client)
        agent = agents.Agent(name="calculator", instructions="Answer with the tool.", tools=[multiply], model=model)
        result = await agents.Runner.run(agent, QUESTION)
        return str(result.final_output)

    samples, output = await run_session(fake_vllm, tokenizer, drive)
    assert output == ANSWER
    assert_token_exact(samples, fake_vllm, tokenizer, SCRIPT)


async def test_pydantic_ai_runs_a_tool_using_session(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def drive(base_url: str) -> str:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        model = OpenAIChatModel("fake-model", provider=OpenAIProvider(openai_client=client))
        agent = pydantic_ai.Agent(model, instructions="Answer with the tool.")

        @agent.tool_plain
        def multiply(a: int, b: int) -> int:
            """Multiply two integers."""
            return multiply_impl(a, b)

        result = await agent.run(QUESTION)
        return str(result.output)

    samples, output = await run_session(fake_vllm, tokenizer, drive)
    assert output == ANSWER
    assert_token_exact(samples, fake_vllm, tokenizer, SCRIPT)


# litellm and openai-agents send a tool's parameters as {"type", "properties", "required"}, langchain as
# {"properties", "required", "type"}: the order a chat template renders
LITELLM_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def litellm_session(base_url: str) -> str:
    litellm = pytest.importorskip("litellm")
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        response = await litellm.acompletion(
            model="openai/fake-model", api_base=base_url, api_key="unused", messages=messages, tools=[LITELLM_TOOL],
            num_retries=0,
        )  # fmt: skip
        message = response.choices[0].message
        calls = message.tool_calls or []
        if not calls:
            return str(message.content)
        messages.append(message.model_dump(exclude_none=True))
        for call in calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(multiply_impl(**arguments))})
    raise AssertionError("the model never answered")


async def test_litellm_runs_a_tool_using_session(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    samples, output = await run_session(fake_vllm, tokenizer, litellm_session)
    assert output == ANSWER
    assert_token_exact(samples, fake_vllm, tokenizer, SCRIPT)


async def langgraph_session(base_url: str) -> str:
    langchain_openai = pytest.importorskip("langchain_openai")
    prebuilt = pytest.importorskip("langgraph.prebuilt")
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return multiply_impl(a, b)

    llm = langchain_openai.ChatOpenAI(model="fake-model", base_url=base_url, api_key="unused", max_retries=0)
    agent = prebuilt.create_react_agent(llm, [multiply])
    state = await agent.ainvoke({"messages": [("user", QUESTION)]})
    return str(state["messages"][-1].content)


async def test_langgraph_with_langchain_openai_runs_a_tool_using_session(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    samples, output = await run_session(fake_vllm, tokenizer, langgraph_session)
    assert output == ANSWER
    assert_token_exact(samples, fake_vllm, tokenizer, SCRIPT)


async def test_two_frameworks_key_orders_share_one_gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    """langchain's and litellm's tool schemas differ only in key order; both sessions of one gateway finish (a
    cache keyed on sorted JSON once failed the second at its first tool result)."""
    async with AgentGateway(make_runner(fake_vllm, tokenizer)) as gateway:
        exported = []
        for drive in (langgraph_session, litellm_session):
            session = await gateway.open_session()
            fake_vllm.script([ScriptedTurn(text=text) for text in SCRIPT], session=session.session_id)
            assert await drive(session.base_url) == ANSWER
            exported.append(list(await session.close(reward=1.0)))
    for samples in exported:
        assert samples[-1].metadata["rollout_reason"] == "session_closed"
        assert samples[-1].status.value == "completed"
