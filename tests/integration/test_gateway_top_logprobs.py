"""``logprobs: true, top_logprobs: k`` through the agent gateway, driven by the ``openai`` SDK: against the scripted
fake engine (plain, streamed, with a tool call, across a weight update, recorded and replayed) and against the
embedded engine. The engine is asked for ``k`` candidates per token and the answer lists them in OpenAI's shape;
the training sequence keeps only the sampled tokens' logprobs."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import openai
import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def gateway_for(server: FakeVLLMServer, tokenizer: Any, **config: Any) -> AgentGateway:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": "fake-model",
        "max_turns": 20,
        "check_invariants": True,
        **config,
    }
    return AgentGateway(RolloutRunner(RolloutConfig(**values), sampling_params=SAMPLING, tokenizer=tokenizer))


def check_candidates(content: list[Any], k: int, tokenizer: Any) -> None:
    """Each token lists ``k`` candidates in OpenAI's shape, the first the sampled token (the argmax: the fake
    engine's sampled token is its likeliest), the others less likely, in rank order."""
    assert content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        top = entry.top_logprobs
        assert len(top) == k
        assert (top[0].token, top[0].logprob, top[0].bytes) == (entry.token, entry.logprob, entry.bytes)
        assert all(later.logprob < earlier.logprob for earlier, later in itertools.pairwise(top))
        assert all(candidate.bytes == list(candidate.token.encode()) for candidate in top)


def generated_logprobs(sample: Sample) -> list[float]:
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    return [lp for lp, bit in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if bit == 1]


async def test_sdk_top_logprobs_plain_streamed_and_with_a_tool_call(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script(
            [
                ScriptedTurn(text="The sum is coming.<|im_end|>"),
                ScriptedTurn(text=CALL),
                ScriptedTurn(text="Five.<|im_end|>"),
            ],
            session=session.session_id,
        )
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0.0, logprobs=True, top_logprobs=3
        )  # type: ignore[call-overload]
        choice = first.choices[0]
        assert choice.message.content == "The sum is coming."
        assert choice.logprobs is not None and choice.logprobs.content is not None
        check_candidates(choice.logprobs.content, 3, tokenizer)
        sampled = [entry.logprob for entry in choice.logprobs.content]

        # streamed, and the answer is a tool call only: the logprobs ride on the tool-call chunk
        messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Add."}]
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, logprobs=True, top_logprobs=2, stream=True
        )  # type: ignore[call-overload]
        chunks = [chunk async for chunk in stream]
        streamed = [
            entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content
        ]
        check_candidates(streamed, 2, tokenizer)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [call.function.name for call in calls] == ["add"]
        sampled += [entry.logprob for entry in streamed]

        # logprobs without top_logprobs: the sampled tokens only, and the engine is asked for the runner's default
        messages += [
            {"role": "assistant", "tool_calls": [call.model_dump(exclude={"index"}) for call in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
        ]
        last = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, logprobs=True)  # type: ignore[call-overload]
        assert last.choices[0].logprobs is not None and last.choices[0].logprobs.content
        assert all(entry.top_logprobs == [] for entry in last.choices[0].logprobs.content)
        sampled += [entry.logprob for entry in last.choices[0].logprobs.content]
        samples = await session.close()

    asked = [request.body["sampling_params"]["logprobs"] for request in fake_vllm.requests_to(GENERATE_PATH)]
    assert asked == [3, 2, 1]
    # the training sequence holds the sampled tokens' logprobs, whatever the calls asked to see
    (sample,) = samples
    assert generated_logprobs(sample) == sampled
    assert "top_logprobs" not in sample.to_dict()


async def test_a_bad_top_logprobs_is_a_400_and_nothing_is_generated(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": "Hi"}]
        for extra, words in [
            ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer from 0 to 20, got 21"),
            ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
        ]:
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="m", messages=messages, **extra)
            assert error.value.status_code == 400
            assert error.value.body["code"] == "top_logprobs"  # type: ignore[index]
            assert words in error.value.body["message"]  # type: ignore[index]
        await session.close()
    assert fake_vllm.requests_to(GENERATE_PATH) == []


async def test_top_logprobs_survive_a_weight_update_mid_call(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    text = "An answer that the engine produces in two pieces.<|im_end|>"
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=text, hang=True, held_after=5)], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        call = asyncio.ensure_future(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=4
            )
        )
        await fake_vllm.wait_until_waiting(1)
        async with gateway.runner.weight_update(version="v2"):
            pass
        answer = await call
        await session.close()
    requests = fake_vllm.requests_to(GENERATE_PATH)
    assert len(requests) == 2 and all(r.body["sampling_params"]["logprobs"] == 4 for r in requests)
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(tokenizer.encode(text))
    check_candidates(content, 4, tokenizer)  # the cut request's tokens and the continuation's


async def test_a_recorded_session_with_top_logprobs_replays_identically(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any, capsys: Any
) -> None:
    trace = tmp_path / "gateway.jsonl"
    async with gateway_for(fake_vllm, tokenizer, trace=str(trace), record=True) as gateway:
        session = await gateway.open_session()
        fake_vllm.script(
            [ScriptedTurn(text="One.<|im_end|>"), ScriptedTurn(text="Two.<|im_end|>")], session=session.session_id
        )
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Count."}]
        first = await client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=5)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
        await client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=2)
        await session.close(reward=1.0)
    from fsm_rollout.cli import main

    capsys.readouterr()
    # the calls' top_logprobs are in the recorded observations, so the replay sends the same generate requests
    assert await asyncio.to_thread(main, ["replay", str(trace)]) == 0, capsys.readouterr()
    replayed = capsys.readouterr().out
    assert "re-executed 2 turns" in replayed and "identical 1" in replayed, replayed


async def test_top_logprobs_on_the_embedded_engine_are_the_engines_ranked_candidates() -> None:
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url,
            model="policy",
            tokenizer_path=str(engine.model_dir),
            max_turns=5,
            check_invariants=True,
        )
        runner = RolloutRunner(config, sampling_params={"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0})
        async with AgentGateway(runner) as gateway:
            session = await gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            messages: Any = [{"role": "user", "content": "Say something."}]
            greedy = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3
            )
            content = greedy.choices[0].logprobs.content  # type: ignore[union-attr]
            assert content is not None and len(content) == greedy.usage.completion_tokens  # type: ignore[union-attr]
            for entry in content:
                top = entry.top_logprobs
                assert len(top) == 3
                # greedy: the sampled token is the argmax, so vLLM's "sampled first" is also rank order
                assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)
                assert top[0].logprob >= top[1].logprob >= top[2].logprob
            samples = await session.close()
    assert generated_logprobs(samples[0]) == [entry.logprob for entry in content]
