"""The gateway's answers keep a thinking template's reasoning out of their content, whatever opens it."""

from __future__ import annotations

import pytest

from fsm_rollout.gateway.answers import split_reasoning
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
