"""Structured output and forced tool calls by constrained decoding on the embedded engine (xgrammar, the extra
``structured``): every seed's answer parses and matches the schema, a named tool choice calls that tool, and the
sample says which tokens were constrained."""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import openai
import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH

pytest.importorskip("xgrammar", reason="the extra 'structured' (xgrammar) is not installed")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 99},
        "unit": {"type": "string", "enum": ["cm", "m"]},
    },
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calc_score",
            "description": "Check an answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    },
]


def _matches(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"answer", "unit"}
        and type(value["answer"]) is int
        and 0 <= value["answer"] <= 99
        and value["unit"] in ("cm", "m")
    )


async def test_json_schema_and_a_named_tool_choice_are_enforced_on_the_default_model() -> None:
    async with LocalEngine(default_model_dir(), served_model_name="policy") as engine:
        config = RolloutConfig(engine_url=engine.url, model="policy", tokenizer_path=str(engine.model_dir), max_turns=4)
        runner = RolloutRunner(config, sampling_params={"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0})
        async with AgentGateway(runner) as gateway:
            parsed = []
            for seed in range(8):
                session = await gateway.open_session()
                client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "How long is the side? Answer in JSON."}],
                    max_tokens=48,
                    seed=seed,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "side", "schema": SCHEMA, "strict": seed % 2 == 0},
                    },
                )
                content = reply.choices[0].message.content
                assert content is not None
                parsed.append(json.loads(content))
                samples = await session.close()
                spans = samples[-1].metadata["constrained_spans"]
                assert spans == [{"start": 0, "end": samples[-1].response_length}]
            assert all(_matches(value) for value in parsed), parsed

            session = await gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            reply = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "Look up the word 'side'."}],
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "lookup"}},
                max_tokens=48,
                seed=3,
            )
            calls = reply.choices[0].message.tool_calls
            assert calls is not None and len(calls) == 1
            function = calls[0].function  # type: ignore[union-attr]
            assert function.name == "lookup"
            assert set(json.loads(function.arguments)) == {"word"}
            assert reply.choices[0].finish_reason == "tool_calls"
            await session.close()


async def test_logit_bias_and_a_regex_reach_the_embedded_engines_sampling() -> None:
    """A +100 bias makes one token the greedy pick every step; a regex grammar yields text matching it, with the
    logprob of each token taken from the masked distribution (so at most 0, and exactly 0 where one token fits)."""
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine, aiohttp.ClientSession() as http:
        prompt = [9707, 11, 1879, 0]

        async def generate(sampling: dict[str, Any]) -> dict[str, Any]:
            body = {"token_ids": prompt, "sampling_params": {"logprobs": 5, **sampling}}
            async with http.post(engine.url + GENERATE_PATH, json=body) as response:
                answer: dict[str, Any] = await response.json()
                assert response.status == 200, answer
                return answer

        biased = await generate({"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logit_bias": {"42": 100}})
        assert biased["choices"][0]["token_ids"] == [42] * 6

        answer = await generate(
            {"temperature": 1.0, "seed": 5, "max_tokens": 16, "structured_outputs": {"regex": "yes|no"}}
        )
        choice = answer["choices"][0]
        text = engine_text(engine, choice["token_ids"])
        assert text in ("yes", "no") and choice["finish_reason"] == "stop"
        # after the grammar ends only the end-of-turn tokens may follow: the masked distribution's mass is all on
        # them, so the top candidates listed at that step hold all of it (an unmasked random model spreads it thin)
        last = choice["logprobs"]["content"][-1]
        assert abs(sum(math.exp(top["logprob"]) for top in last["top_logprobs"]) - 1.0) < 1e-4


def engine_text(engine: LocalEngine, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine.model_dir))
    return str(tokenizer.decode(token_ids, skip_special_tokens=True))
