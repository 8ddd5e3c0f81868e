"""Tool-call turns re-rendered by real vLLM under ``fork`` and ``per_turn``.

The re-render sends vLLM the whole conversation, so the assistant turn that called a tool travels as an OpenAI
message with ``tool_calls``, which vLLM validates against OpenAI's schema (``function.arguments`` a JSON string)
and then decodes for the chat template. The random tiny model does not write tool calls, so the first turn's answer
is replaced on its way back from vLLM by the tokens of one (:class:`ToolCallingClient`): every render request still
goes to vLLM as the library builds it, which is what this tier checks. Also here: the render accepts and refuses
the same messages as the fake server and the embedded engine (the measured cases of
``tests/fixtures/vllm_chat_messages.json``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from conftest import RecordingProxy, VLLMServer
from vllm_helpers import RENDER_PATH, SERVED_MODEL

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, VLLMClient, training_sequences
from fsm_rollout.engine.schema import RequestError, check_chat_message
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.tokens.parity import template_token_ids
from fsm_rollout.types import GeneratedTurn

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}, "exact": {"type": "boolean"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7", "exact": false}}\n</tool_call>'
RESULT = {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"}
CASES = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "vllm_chat_messages.json").read_text())["cases"]


class ToolCallingClient(VLLMClient):
    """vLLM's first answer of each sample, with its tokens replaced by a tool call's (and its EOS)."""

    def __init__(self, *args: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_tokens = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
        self.first_turns = 0

    async def generate(self, body: Mapping[str, Any], **kwargs: Any) -> GeneratedTurn:
        turn = await super().generate(body, **kwargs)
        prompt = body["token_ids"]
        if prompt[-len(self.call_tokens) :] == self.call_tokens or self._answered(prompt):
            return turn
        self.first_turns += 1
        tokens = list(self.call_tokens)
        meta = dataclasses.replace(  # what vLLM would say of these tokens: no spans or masks of the tokens replaced
            turn.meta,
            finish_reason="stop",
            completion_tokens=len(tokens),
            weight_version_spans=None,
            top_p_token_ids=None,
            top_p_token_offsets=None,
            routed_experts=None,
        )
        return dataclasses.replace(turn, finish="stop", token_ids=tokens, logprobs=[0.0] * len(tokens), meta=meta)

    def _answered(self, prompt: list[int]) -> bool:
        """The prompt holds the call already: this is a later turn."""
        size = len(self.call_tokens) - 1
        return any(prompt[i : i + size] == self.call_tokens[:-1] for i in range(len(prompt) - size + 1))


@pytest.fixture
async def recording(vllm_server: VLLMServer) -> AsyncIterator[RecordingProxy]:
    async with RecordingProxy(vllm_server.url) as proxy:
        yield proxy


@pytest.mark.parametrize("policy", ["fork", "per_turn"])
async def test_a_tool_call_turn_is_re_rendered_by_vllm(
    policy: str, recording: RecordingProxy, vllm_tokenizer: Any
) -> None:
    tokenizer = vllm_tokenizer
    async with ToolCallingClient(recording.url, retry=RetryPolicy(max_attempts=1), tokenizer=tokenizer) as client:
        rollout = Rollout(
            Sample(prompt="What is 6 * 7? Use the tool.", index=0, metadata={"tools": TOOLS}),
            config=RolloutConfig(
                engine_url=recording.url,
                model=SERVED_MODEL,
                max_turns=2,
                check_invariants=True,
                request_timeout_s=300.0,
                history_policy=policy,
            ),
            sampling_params={"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "seed": 3},
            client=client,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(steps=[(RESULT, False)]),
        )
        sample = await rollout.run()
    assert client.first_turns == 1
    assert "rollout_error" not in sample.metadata, sample.metadata.get("rollout_error")
    renders = recording.to(RENDER_PATH)
    assert len(renders) == 2 and all(exchange.status == 200 for exchange in renders)
    sent = renders[1].body["messages"]
    assert sent[1]["tool_calls"][0]["function"] == {
        "name": "calc",
        "arguments": '{"expression": "6*7", "exact": false}',
    }
    # vLLM decoded the arguments for its template: its render is the local template's with the call as an object
    conversation = [
        *sent[:1],
        {
            **sent[1],
            "tool_calls": [
                {
                    **sent[1]["tool_calls"][0],
                    "function": {"name": "calc", "arguments": {"expression": "6*7", "exact": False}},
                }
            ],
        },
        *sent[2:],
    ]
    local = template_token_ids(
        tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=True, add_generation_prompt=True),
        what="local render",
    )
    assert list(renders[1].response["token_ids"]) == local
    sequences = training_sequences([sample])
    assert len(sequences) == (2 if policy == "per_turn" else 1)
    for sequence in sequences:
        sequence.check_invariants(len(sequence.tokens) - sequence.response_length)


async def test_vllms_render_accepts_and_refuses_what_our_servers_do(vllm_server: VLLMServer) -> None:
    """Schema-level parity: messages with content-part lists are left out, because vLLM checks each part once more
    when it parses the content (a text part's ``text`` must be a string there), which our servers do not mirror."""
    differ = []
    async with aiohttp.ClientSession() as http:
        for index, case in enumerate(CASES):
            message = case["message"]
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                continue
            body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}, message]}
            async with http.post(vllm_server.url + RENDER_PATH, json=body) as response:
                status = response.status
                answer = await response.text()
            try:
                check_chat_message(message, 1)
                ours = 200
            except RequestError as error:
                ours = error.status
            if not ((status == 200) == (ours == 200) == case["vllm_accepts"]):
                differ.append((index, status, ours, answer[:200]))
    assert differ == []
