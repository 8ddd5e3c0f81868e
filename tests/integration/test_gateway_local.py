"""The agent gateway in front of the embedded engine (the tiny random model): the example runs, and an SDK
session's exported tokens are exactly what the engine was sent and generated."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from spy_transport import GenerateSpy

from fsm_rollout import RolloutConfig
from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
from fsm_rollout.examples import agent_gateway
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner


class Spy(GenerateSpy):
    """Each generate request, its answer and its headers."""

    @property
    def generates(self) -> list[tuple[dict[str, Any], Any, dict[str, str]]]:
        return [(each.payload, each.answer, each.headers) for each in self.seen]


async def test_the_example_runs_on_the_embedded_engine() -> None:
    samples = await agent_gateway.main(tiny_model_dir())
    assert len(samples) >= len(agent_gateway.QUESTIONS)
    # a sequence ended with its session, or closed into a branch because the agent rewrote the history
    assert all(
        s.metadata.get("rollout_reason") in {"session_closed", "length"} or "history_rewritten" in s.metadata
        for s in samples
    )
    for sample in samples:
        assert sample.reward in (0.0, 1.0)
        assert sample.loss_mask is not None and sum(sample.loss_mask) > 0
        assert agent_gateway.describe(sample).startswith(f"session {sample.index} sequence")


async def test_an_sdk_session_on_the_embedded_engine_is_token_exact() -> None:
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url,
            model="policy",
            tokenizer_path=str(engine.model_dir),
            max_turns=10,
            check_invariants=True,
        )
        runner = RolloutRunner(config, sampling_params={"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0})
        async with AgentGateway(runner) as gateway:
            spy = Spy(runner.engine_client(engine.url).transport)
            runner.engine_client(engine.url).transport = spy
            session = await gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "Say something."}]
            for step in range(3):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=24, seed=step, stream=step == 1
                ) if step != 1 else None  # fmt: skip
                if reply is None:  # a streamed call: the text is assembled from the chunks
                    stream = await client.chat.completions.create(
                        model="policy", messages=messages, max_tokens=24, seed=step, stream=True
                    )
                    content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                else:
                    content = reply.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"More {step}."}]
            samples = await session.close(reward=0.5)
    assert len(spy.generates) == 3
    assert all(headers.get("x-session-id") == session.session_id for _, _, headers in spy.generates)
    assert [payload["sampling_params"]["seed"] for payload, _, _ in spy.generates] == [0, 1, 2]
    # the model's texts come back as the agent saw them: if any re-tokenization changed them, the session forks
    generated = [answer["choices"][0]["token_ids"] for _, answer, _ in spy.generates]
    sequences = list(samples)
    trained = [
        [t for t, bit in zip(s.tokens[len(s.tokens) - s.response_length :], s.loss_mask or [], strict=True) if bit]
        for s in sequences
    ]
    assert [t for run in trained for t in run] == [t for run in generated for t in run]
    for payload, _, _ in spy.generates:  # each request continued a sequence the session exports
        assert any(s.tokens[: len(payload["token_ids"])] == payload["token_ids"] for s in sequences)
    last = sequences[-1]
    final_payload = spy.generates[-1][0]
    assert last.tokens[: len(final_payload["token_ids"])] == final_payload["token_ids"]
    assert last.tokens[len(final_payload["token_ids"]) :][: len(generated[-1])] == generated[-1]
    assert last.metadata["rollout_reason"] == "session_closed" and last.reward == 0.5


async def _responses_turns(base_url: str) -> None:
    """Two Responses calls as Codex makes them: the whole input each time, the second streamed."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}]
    for step in range(2):
        request: dict[str, Any] = dict(model="policy", input=items, max_output_tokens=24, store=False)
        if step:
            stream = await client.responses.create(**request, stream=True)
            ends = [e.response async for e in stream if e.type in ("response.completed", "response.incomplete")]
            response = ends[-1]
        else:
            response = await client.responses.create(**request)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]})


async def _messages_turns(base_url: str) -> None:
    """Two Messages calls as Claude Code makes them: the whole history each time, the second streamed."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Hi."}]
    for step in range(2):
        if step:
            async with client.messages.stream(model="policy", messages=messages, max_tokens=24) as stream:
                message = await stream.get_final_message()
        else:
            message = await client.messages.create(model="policy", messages=messages, max_tokens=24)
        content = [block.model_dump(exclude_none=True) for block in message.content] or [{"type": "text", "text": ""}]
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "More."}]


@pytest.mark.parametrize("dialect", ["responses", "messages"])
async def test_a_responses_or_messages_session_on_the_embedded_engine_is_token_exact(dialect: str) -> None:
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url, model="policy", tokenizer_path=str(engine.model_dir), max_turns=10,
            check_invariants=True,
        )  # fmt: skip
        runner = RolloutRunner(config, sampling_params={"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0})
        async with AgentGateway(runner) as gateway:
            spy = Spy(runner.engine_client(engine.url).transport)
            runner.engine_client(engine.url).transport = spy
            session = await gateway.open_session()
            await (_responses_turns if dialect == "responses" else _messages_turns)(session.base_url)
            samples = await session.close(reward=1.0)
    assert len(spy.generates) == 2
    generated = [answer["choices"][0]["token_ids"] for _, answer, _ in spy.generates]
    trained = [
        t
        for s in samples
        for t, bit in zip(s.tokens[len(s.tokens) - s.response_length :], s.loss_mask or [], strict=True)
        if bit
    ]
    assert trained == [t for run in generated for t in run]  # every generated token trained once, in order
    for payload, _, _ in spy.generates:  # each request continued a sequence the session exports
        assert any(s.tokens[: len(payload["token_ids"])] == payload["token_ids"] for s in samples)
    assert len(samples) == 1, [s.metadata.get("rollout_reason") for s in samples]  # the echoed answers: no fork
