"""An image observation after a tool call, against real vLLM serving a tiny Qwen2-VL.

After a tool call the observation opens with the tool's result, so its boundary is cut after the dummy prefix that
ends with a tool call, and vLLM renders that prefix with the image (``append``); under ``fork`` vLLM re-renders the
whole conversation, the tool-call turn included. Either way an assistant message with ``tool_calls`` reaches vLLM,
which validates it against OpenAI's schema (``function.arguments`` a JSON string). The random model writes no tool
call, so its first answer is replaced on the way back by a tool call's tokens (every render still goes to vLLM as
the library builds it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
from test_vllm_vl_images import PROMPT, image_message, sampling

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer
from fsm_rollout.types import GeneratedTurn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the agent.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string"}},
                "required": ["direction"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "right"}}\n</tool_call>'
OBSERVATION = [
    {"role": "tool", "content": "moved", "tool_call_id": "call_0", "name": "move"},
    image_message((1, 0), text="The board:"),
]


class ToolCallingClient(VLLMClient):
    """vLLM's first answer, with its tokens replaced by a tool call's (and its EOS)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tokenizer = load_qwen_tokenizer()
        self.call_tokens = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
        self.calls = 0

    async def generate(self, body: Mapping[str, Any], **kwargs: Any) -> GeneratedTurn:
        turn = await super().generate(body, **kwargs)
        self.calls += 1
        if self.calls > 1:
            return turn
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


@pytest.mark.parametrize("policy", ["append", "fork"])
def test_an_image_observation_after_a_tool_call(vl_server: Any, policy: str) -> None:
    sample = Sample(prompt=PROMPT, index=1, metadata={"tools": TOOLS})

    async def run() -> None:
        config = RolloutConfig(engine_url=vl_server.url, model=vl_server.model, max_turns=2, image_merge_size=2,
                               check_invariants=True, history_policy=policy)  # fmt: skip
        envs = ScriptedEnvFactory(steps=[(OBSERVATION, False)])
        async with ToolCallingClient(vl_server.url) as client:
            await Rollout(sample, config=config, sampling_params=sampling(), client=client,
                          tokenizer=load_qwen_tokenizer(), env_factory=envs).run()  # fmt: skip

    asyncio.run(run())
    assert "rollout_error" not in sample.metadata, sample.metadata.get("rollout_error")
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
    tokenizer = load_qwen_tokenizer()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    last = sample  # under fork the image is in the last sequence's prompt
    assert last.tokens.count(pad) == 16  # one 112x112 board: 8x8 patches, merged 2x2
    inputs = last.multimodal_train_inputs
    assert inputs is not None and inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert "<tool_call>" in tokenizer.decode([*sample.branches[0].tokens] if sample.branches else sample.tokens)
