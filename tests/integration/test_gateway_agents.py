"""A real agent framework from PyPI, unchanged, through the gateway: smolagents' ToolCallingAgent.

smolagents is the lightest of the three frameworks the issue names that installs here: it talks to the model
through the ``openai`` SDK (``OpenAIServerModel``) and pulls in no server stack (the OpenAI Agents SDK needs
``mcp``; LangGraph with ``langchain-openai`` needs ``tiktoken``'s encodings from the network). Its tool-calling
agent is the multi-step loop the gateway must carry: tool calls by the API's ``tool_calls``, tool results as
messages, a ``final_answer`` tool to finish.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


async def test_a_smolagents_tool_calling_agent_runs_a_multi_step_task_unchanged(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=20, check_invariants=True)
    runner = RolloutRunner(
        config, sampling_params={"max_new_tokens": 1024, "temperature": 1.0, "top_p": 1.0}, tokenizer=tokenizer
    )
    async with AgentGateway(runner) as gateway:
        session = await gateway.open_session(label=42)
        fake_vllm.script(
            [
                ScriptedTurn(text=tool_call("multiply", {"a": 6, "b": 7})),
                ScriptedTurn(text=tool_call("final_answer", {"answer": "42"})),
            ],
            session=session.session_id,
        )
        model = OpenAIServerModel(model_id="fake-model", api_base=session.base_url, api_key="unused")
        agent = ToolCallingAgent(tools=[multiply], model=model, max_steps=4, verbosity_level=0)
        answer = await asyncio.to_thread(agent.run, "What is 6 times 7?")
        assert str(answer) == "42"
        samples = await session.close(reward=1.0)
    # smolagents writes its own history: the model's tool call comes back as an assistant text "Calling tools:
    # [...]" and the result as a user "Observation:" message. That is not what the model saw, so the session forks:
    # each model call is its own training sequence, whose prompt is the render of the conversation as sent.
    assert samples[-1].branches == samples[:-1] and len(samples) == 2
    assert samples[-1].metadata["rollout_reason"] == "session_closed"
    assert samples[0].metadata["history_rewritten"].startswith("messages[")
    assert "Calling tools:" in tokenizer.decode(samples[1].tokens)
    assert all(s.label == 42 and s.reward == 1.0 for s in samples)
    generates = fake_vllm.requests_to(GENERATE_PATH)
    assert len(generates) == 2
    scripted = [tool_call("multiply", {"a": 6, "b": 7}), tool_call("final_answer", {"answer": "42"})]
    for sample, request, text in zip(samples, generates, scripted, strict=True):
        # each sequence is exactly what its engine request sent plus what the engine generated for it (mask 1)
        sent = request.body["token_ids"]
        assert sample.tokens == sent + tokenizer.encode(text)
        assert sample.loss_mask == [1] * len(tokenizer.encode(text))
