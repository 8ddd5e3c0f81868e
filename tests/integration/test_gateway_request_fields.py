"""Every field of the Chat Completions request (as the installed ``openai`` SDK lists them) is handled by the
gateway: a sampling field reaches the generate request's ``sampling_params`` (as the fake engine recorded it), a
refused one is a 400 naming it, and the others are listed as shaping the call or as bookkeeping. A field the SDK
gains fails this test until the gateway handles it."""

from __future__ import annotations

import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai.types.chat import completion_create_params

from fsm_rollout import RolloutConfig
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.gateway.openai_wire import REQUEST_FIELDS
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}

# field: (a value a client sends, the sampling_params key it must reach and the value it must have there)
SAMPLING: dict[str, tuple[Any, str, Any]] = {
    "temperature": (0.5, "temperature", 0.5),
    "top_p": (0.9, "top_p", 0.9),
    "seed": (7, "seed", 7),
    "stop": (["a", "b", "c", "d"], "stop", ["a", "b", "c", "d"]),
    "frequency_penalty": (0.5, "frequency_penalty", 0.5),
    "presence_penalty": (-0.5, "presence_penalty", -0.5),
    "logit_bias": ({"15": 2.5, "16": -100}, "logit_bias", {"15": 2.5, "16": -100.0}),
    "max_tokens": (11, "max_tokens", 11),
    "max_completion_tokens": (12, "max_tokens", 12),
    "top_logprobs": (3, "logprobs", 3),
    "response_format": (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
        "structured_outputs",
        {"json": SCHEMA, "disable_any_whitespace": True},
    ),
    "tool_choice": ({"type": "function", "function": {"name": "add"}}, "structured_outputs", None),
}
CALL_FIELDS: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "fake-model",
    "tools": TOOLS,
    "n": 1,
    "stream": False,
    "stream_options": {"include_usage": True},
    "logprobs": True,
    "parallel_tool_calls": True,
}
BOOKKEEPING: dict[str, Any] = {
    "metadata": {"run": "1"},
    "store": False,
    "user": "someone",
    "safety_identifier": "abc",
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {},
}
REFUSED: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "moderation": {"type": "auto"},
}


def sdk_fields() -> set[str]:
    fields: set[str] = set()
    for params in (
        completion_create_params.CompletionCreateParamsNonStreaming,
        completion_create_params.CompletionCreateParamsStreaming,
    ):
        fields |= set(typing.get_type_hints(params))
    return fields


def test_every_sdk_field_has_a_disposition_and_an_example() -> None:
    fields = sdk_fields()
    assert fields - set(REQUEST_FIELDS) == set(), "fields the gateway does not handle"
    examples = {**SAMPLING, **CALL_FIELDS, **BOOKKEEPING, **REFUSED}
    assert fields - set(examples) == set(), "fields this test does not sweep"
    for name in fields:
        expected = (
            "sampling" if name in SAMPLING else "call" if name in CALL_FIELDS else "bookkeeping"
            if name in BOOKKEEPING else "refused"
        )  # fmt: skip
        assert REQUEST_FIELDS[name] == expected, name


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> AsyncIterator[AgentGateway]:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=50, check_invariants=True)
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    async with AgentGateway(RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer)) as gateway:
        yield gateway


async def _call(gateway: AgentGateway, fake: FakeVLLMServer, field: str, value: Any) -> tuple[int, Any, Any]:
    """One call with ``field`` set on top of a plain request; its status, answer and recorded sampling_params."""
    session = await gateway.open_session()
    forced = field == "tool_choice"
    fake.script([ScriptedTurn(text=CALL if forced else '{"x": 1}<|im_end|>')], session=session.session_id)
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    if forced or field == "parallel_tool_calls":
        body["tools"] = TOOLS
    if field == "top_logprobs":
        body["logprobs"] = True
    body[field] = value
    before = len(fake.requests_to(GENERATE_PATH))
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{session.base_url}/chat/completions", json=body) as response,
    ):
        status, answer = response.status, await response.json(content_type=None)
    generates = fake.requests_to(GENERATE_PATH)[before:]
    sampling = generates[-1].body["sampling_params"] if generates else None
    await session.close()
    return status, answer, sampling


@pytest.mark.parametrize("field", sorted(SAMPLING))
async def test_a_sampling_field_reaches_the_generate_request(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, field: str
) -> None:
    value, key, expected = SAMPLING[field]
    status, answer, sampling = await _call(gateway, fake_vllm, field, value)
    assert status == 200, answer
    assert sampling is not None and key in sampling, sampling
    if field == "tool_choice":  # the forced call, as a structural tag naming the function
        elements = json.loads(sampling[key]["structural_tag"])["format"]["elements"]
        assert elements[0] == {"type": "const_string", "value": '<tool_call>\n{"name": "add", "arguments": '}
        assert elements[1]["json_schema"] == TOOLS[0]["function"]["parameters"]
        assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    elif field == "response_format":
        assert {name: sampling[key].get(name) for name in expected} == expected
        assert json.loads(answer["choices"][0]["message"]["content"]) == {"x": 1}
    else:
        assert sampling[key] == expected


@pytest.mark.parametrize("field", sorted(REFUSED))
async def test_a_refused_field_is_a_400_naming_it(gateway: AgentGateway, fake_vllm: FakeVLLMServer, field: str) -> None:
    status, answer, sampling = await _call(gateway, fake_vllm, field, REFUSED[field])
    assert status == 400 and answer["error"]["code"] == field and field in answer["error"]["message"], answer
    assert sampling is None  # nothing was generated


@pytest.mark.parametrize("field", sorted({**CALL_FIELDS, **BOOKKEEPING}))
async def test_a_call_or_bookkeeping_field_is_accepted(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, field: str
) -> None:
    value = {**CALL_FIELDS, **BOOKKEEPING}[field]
    status, answer, _ = await _call(gateway, fake_vllm, field, value)
    assert status == 200, answer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", ["a", "b", "c", "d", "e"]),
        ("frequency_penalty", 2.5),
        ("presence_penalty", "high"),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"15": 101}),
        ("response_format", {"type": "xml"}),
        ("tool_choice", {"type": "function", "function": {"name": "missing"}}),
        ("an_unknown_field", 1),
    ],
)
async def test_a_bad_value_is_a_400_naming_the_field(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, field: str, value: Any
) -> None:
    status, answer, sampling = await _call(gateway, fake_vllm, field, value)
    assert status == 400 and answer["error"]["code"] == field, answer
    assert sampling is None
