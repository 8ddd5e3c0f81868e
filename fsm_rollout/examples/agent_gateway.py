"""A black-box agent trained token-exact: an ``openai``-SDK tool-using agent, run through the agent gateway.

Run it with ``python -m fsm_rollout.examples.agent_gateway``. It serves the default model in process (the
embedded engine), puts an :class:`~fsm_rollout.gateway.AgentGateway` in front of it, and runs a few sessions of a
small calculator agent written against the plain OpenAI SDK: the agent knows nothing of rollouts, it is only given
a session's ``base_url``. Each session's reward is whether the agent's final answer holds the right number; closing
a session returns its training sequences, and each one's tokens, loss mask and logprobs are printed. The agent's
loop is ordinary: call the model with the tool, run the tool calls it makes and send the results back, stop when
it answers without one (or after a few calls).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from fsm_rollout import RolloutConfig, RolloutRunner, Sample
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.gateway import AgentGateway

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTIONS = [(6, 7), (12, 11), (9, 8)]
MAX_CALLS = 3


def multiply(a: float, b: float) -> float:
    return a * b


async def agent(client: openai.AsyncOpenAI, model: str, question: str, seed: int) -> str:
    """A plain OpenAI tool loop: the program a team would deploy, unchanged for training."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful calculator. Use the multiply tool."},
        {"role": "user", "content": question},
    ]
    answer = ""
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=1.0,
            seed=seed,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            if not isinstance(call, ChatCompletionMessageFunctionToolCall):
                continue  # only function tools are offered
            try:
                arguments = json.loads(call.function.arguments)
                result = str(multiply(float(arguments["a"]), float(arguments["b"])))
            except (KeyError, TypeError, ValueError) as error:  # the model's call was wrong: tell it so
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


async def run_session(gateway: AgentGateway, model: str, a: int, b: int, seed: int) -> list[Sample]:
    session = await gateway.open_session(metadata={"question": [a, b]})
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    answer = await agent(client, model, f"What is {a} times {b}?", seed)
    reward = 1.0 if str(a * b) in re.findall(r"\d+", answer) else 0.0
    return await session.close(reward=reward)


async def main(model_dir: Path | None = None) -> list[Sample]:
    # model_dir=None serves the default model (built and trained on first use, then cached)
    async with LocalEngine(model_dir, served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url,
            model=engine.served_model_name,
            tokenizer_path=str(engine.model_dir),
            max_turns=2 * MAX_CALLS,
        )
        sampling = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}
        async with AgentGateway(RolloutRunner(config, sampling_params=sampling)) as gateway:
            runs = [run_session(gateway, config.model, a, b, seed) for seed, (a, b) in enumerate(QUESTIONS)]
            sessions = await asyncio.gather(*runs)
            metrics = gateway.runner.metrics()
            print(f"{metrics.sessions_total} sessions, {metrics.turns} turns, {metrics.tokens_generated} tokens")
    return [sample for sequences in sessions for sample in sequences]


def describe(sample: Sample) -> str:
    """One exported training sequence in a line: its outcome, reward and token counts."""
    mask = sample.loss_mask or []
    return (
        f"session {sample.index} sequence {sample.metadata['branch']}: {sample.status.value} "
        f"({sample.metadata['rollout_reason']}), reward {sample.reward}, {len(sample.tokens)} tokens "
        f"({len(sample.tokens) - sample.response_length} prompt, {sum(mask)} generated and trained, "
        f"{len(mask) - sum(mask)} tool results and templates masked)"
    )


if __name__ == "__main__":
    for sample in asyncio.run(main()):
        print(describe(sample))
