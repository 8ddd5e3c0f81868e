"""The gateway's answers keep a thinking template's reasoning out of their content, whatever opens it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsm_rollout.gateway.answers import THINK_CLOSE, TokenText, split_reasoning
from fsm_rollout.gateway.chat_answers import chat_completion, stream_chunks
from fsm_rollout.gateway.openai_wire import TurnAnswer


@pytest.mark.parametrize(
    ("text", "reasoning", "rest"),
    [
        ("<think>\nadd them\n</think>\n\n4", "add them", "\n\n4"),  # the model opens its thinking
        ("add them\n</think>\n\n4", "add them", "\n\n4"),  # the generation prompt opened it
        ("<think>\n\n</think>\n\n4", "", "\n\n4"),  # thinking off: an empty block
        ("<think>\nstill thinking", "still thinking", ""),  # cut by the token limit inside the thinking
        ("4", None, "4"),  # no thinking template
        ("I write <think> and </think> in prose", None, "I write <think> and </think> in prose"),
    ],
)
def test_split_reasoning(text: str, reasoning: str | None, rest: str) -> None:
    assert split_reasoning(text) == (reasoning, rest)


def _answer(reasoning: str | None) -> TurnAnswer:
    return TurnAnswer(
        content="4",
        tool_calls=[],
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=2,
        token_ids=[1, 2],
        logprobs=[-0.1, -0.2],
        text="x",
        reasoning=reasoning,
    )


def test_chat_answers_carry_the_reasoning_apart_only_when_there_is_some() -> None:
    message = chat_completion(_answer("add them"), completion_id="c", model="m")["choices"][0]["message"]
    assert message["content"] == "4" and message["reasoning_content"] == "add them"
    assert (
        "reasoning_content" not in chat_completion(_answer(None), completion_id="c", model="m")["choices"][0]["message"]
    )
    deltas = [
        chunk["choices"][0]["delta"]
        for chunk in stream_chunks(_answer("add them"), completion_id="c", model="m", include_usage=False)
    ]
    assert {"reasoning_content": "add them"} in deltas
    assert [delta.get("content") for delta in deltas if "content" in delta] == ["", "4"]


@pytest.mark.parametrize("vocabulary", ["qwen2", "qwen3_6"])
def test_the_thinking_is_counted_in_generated_tokens_up_to_the_one_that_closes_it(vocabulary: str) -> None:
    """``reasoning_tokens``: the turn's tokens through the one that completes ``</think>`` (Qwen2's vocabulary
    spells the tag in pieces, Qwen3.6's has it as one token); a turn cut inside its thinking is all thinking."""
    from fsm_rollout.testing.qwen3_6_tokenizer import load_qwen3_6_tokenizer
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer() if vocabulary == "qwen2" else load_qwen3_6_tokenizer()
    text_of = TokenText(tokenizer, {})
    ids = tokenizer.encode("<think>\nAdd 2 and 3: that is 5.\n</think>\n\nThe sum is 5.", add_special_tokens=False)
    count = text_of.thinking_length(ids)
    assert THINK_CLOSE in tokenizer.decode(ids[:count]) and THINK_CLOSE not in tokenizer.decode(ids[: count - 1])
    assert "The sum" not in tokenizer.decode(ids[:count])
    if vocabulary == "qwen3_6":  # one token for the tag: the count is its position, plus one
        assert count == ids.index(tokenizer.convert_tokens_to_ids(THINK_CLOSE)) + 1
    cut = tokenizer.encode("<think>\nAdd 2 and", add_special_tokens=False)
    assert text_of.thinking_length(cut) == len(cut)
    usage = chat_completion(replace(_answer("add them"), reasoning_tokens=count), completion_id="c", model="m")["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": count}
    assert "completion_tokens_details" not in chat_completion(_answer(None), completion_id="c", model="m")["usage"]
