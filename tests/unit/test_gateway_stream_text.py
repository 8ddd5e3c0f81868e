"""What a streaming answer may show before its turn ends: text held back until it cannot turn out to be tool-call or
thinking markup or a stop string, and what was shown always a prefix of the finished answer's text."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from fsm_rollout.envs.step import Turn
from fsm_rollout.gateway.answers import TokenText, read_answer
from fsm_rollout.gateway.openai_wire import without_stop_string
from fsm_rollout.gateway.stream_text import AnswerStream, opens_thinking


def shown(
    tokenizer: Any, text: str, *, parse_calls: bool = True, stops: tuple[str, ...] = (), opened: bool = False
) -> tuple[list[str], str, str]:
    """Feed ``text``'s tokens one at a time: the content shown after each, and the reasoning and content shown."""
    stream = AnswerStream(TokenText(tokenizer, {}), parse_calls=parse_calls, stops=stops)
    seen = []
    for token in tokenizer.encode(text):
        stream.feed([token], opened=opened)
        seen.append(stream.content)
    return seen, stream.reasoning, stream.content


def finished(tokenizer: Any, text: str, *, parse_calls: bool = True, stops: tuple[str, ...] = ()) -> Any:
    ids = tokenizer.encode(text)
    turn = Turn(text=text, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", prompt_tokens=3)
    answer = read_answer(
        turn,
        TokenText(tokenizer, {}),
        parse_calls=parse_calls,
        max_tokens=None,
        with_top_logprobs=False,
        weight_version=None,
    )
    return without_stop_string(answer, list(stops))


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("Plain words, shown as they come.<|im_end|>", {}),
        ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>', {}),
        ('Kept as text: <tool_call>{"name": "f"}</tool_call><|im_end|>', {"parse_calls": False}),
        ("<think>\nweighing it\n</think>\n\nThe answer.<|im_end|>", {}),
        ("Counting: one, two, STOP", {"stops": ("STOP",)}),
        ("Fancy quotes \u201cthis\u201d and \u00e9t\u00e9 \U0001f600 too.<|im_end|>", {}),
    ],
)
def test_what_is_shown_is_always_a_prefix_of_the_finished_answer(tokenizer: Any, text: str, options: Any) -> None:
    seen, reasoning, content = shown(tokenizer, text, **options)
    answer = finished(tokenizer, text, **options)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(seen))
    assert (answer.content or "").startswith(content)
    assert (answer.reasoning or "").startswith(reasoning)
    if options.get("parse_calls", True):
        assert "<tool" not in content and "STOP" not in content and "<think" not in content


def test_text_is_shown_before_the_turn_ends(tokenizer: Any) -> None:
    seen, _, content = shown(tokenizer, "One two three four five six seven.<|im_end|>")
    assert content == "One two three four five six seven."
    assert seen[1] and len(set(seen)) > 3  # grows token by token


def test_a_tool_call_is_held_back_whole(tokenizer: Any) -> None:
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    seen, _, content = shown(tokenizer, text)
    assert content == "Sure." and all("<" not in each for each in seen)


def test_a_prompt_that_opened_thinking_streams_reasoning_first(tokenizer: Any) -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    _, reasoning, content = shown(tokenizer, "pondering\n</think>\n\nDone.<|im_end|>", opened=True)
    assert reasoning == "pondering" and content == "Done."
