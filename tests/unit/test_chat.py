"""Observation boundary tokens (the dummy-prefix method) and the stop-string EOS rule, with the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_rollout.chat import ObservationEncoder, stop_string_eos_due, template_token_ids, validate_text_observation
from fsm_rollout.errors import ObservationError, TemplateError, TemplateNotPrefixStable

OBSERVATION = {"role": "user", "content": "Tool says: 42"}


def test_boundary_closes_the_turn_adds_the_observation_and_opens_the_next_turn(tokenizer: Any) -> None:
    ids = ObservationEncoder(tokenizer).encode(OBSERVATION, ends_with_eos=False)
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>user\nTool says: 42<|im_end|>\n<|im_start|>assistant\n"


def test_boundary_after_an_eos_does_not_repeat_it(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    with_eos = encoder.encode(OBSERVATION, ends_with_eos=False)
    assert encoder.encode(OBSERVATION, ends_with_eos=True) == with_eos[1:]
    assert with_eos[0] == tokenizer.eos_token_id


def test_text_parts_encode_like_plain_text(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    parts = {"role": "user", "content": [{"type": "text", "text": "Tool says: 42"}]}
    assert encoder.encode(parts, ends_with_eos=True) == encoder.encode(OBSERVATION, ends_with_eos=True)


class CountingTokenizer:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.eos_token_id = inner.eos_token_id
        self.renders = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def test_the_dummy_prefix_is_rendered_once_per_tools_and_kwargs(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    encoder = ObservationEncoder(counting)
    encoder.encode(OBSERVATION, ends_with_eos=True)
    assert counting.renders == 2
    encoder.encode({"role": "user", "content": "another"}, ends_with_eos=True)
    assert counting.renders == 3
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    encoder.encode(OBSERVATION, ends_with_eos=True, tools=tools)
    assert counting.renders == 5


def test_a_repeated_observation_costs_no_render_and_gives_the_same_tokens(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    encoder = ObservationEncoder(counting)
    first = encoder.encode(OBSERVATION, ends_with_eos=False)
    renders = counting.renders
    assert encoder.encode(OBSERVATION, ends_with_eos=False) == first
    assert encoder.encode(OBSERVATION, ends_with_eos=True) == first[1:]
    assert counting.renders == renders


def test_cached_boundaries_are_not_shared_with_callers(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    encoder.encode(OBSERVATION, ends_with_eos=False).append(-1)
    encoder.encode(OBSERVATION, ends_with_eos=True).append(-1)
    assert -1 not in encoder.encode(OBSERVATION, ends_with_eos=False)


def test_the_boundary_cache_is_bounded(tokenizer: Any, monkeypatch: Any) -> None:
    import fsm_rollout.chat as chat

    monkeypatch.setattr(chat, "BOUNDARY_CACHE_SIZE", 2)
    encoder = ObservationEncoder(tokenizer)
    for text in ("a", "b", "c"):
        encoder.encode({"role": "user", "content": text}, ends_with_eos=True)
    assert len(encoder._boundaries) == 2


def test_tools_change_the_prefix_but_not_the_boundary(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    assert encoder.encode(OBSERVATION, ends_with_eos=True, tools=tools) == encoder.encode(
        OBSERVATION, ends_with_eos=True
    )


class RewritingTokenizer:
    """A template that renders the last assistant turn differently from earlier ones (like Qwen3 thinking)."""

    eos_token_id = 2

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        ids: list[int] = []
        for index, message in enumerate(messages):
            last = index == len(messages) - 1
            ids += [10, 11] if message["role"] == "assistant" and last else [12]
            ids.append(2)
        return ids


def test_a_template_that_rewrites_history_is_not_prefix_stable() -> None:
    with pytest.raises(TemplateNotPrefixStable):
        ObservationEncoder(RewritingTokenizer()).encode(OBSERVATION, ends_with_eos=True)


def test_a_prefix_without_eos_is_a_template_error() -> None:
    tokenizer = RewritingTokenizer()
    tokenizer.eos_token_id = 99
    with pytest.raises(TemplateError, match="lacks eos_token_id=99"):
        ObservationEncoder(tokenizer).encode(OBSERVATION, ends_with_eos=True)


def test_a_tokenizer_without_integer_eos_is_a_template_error() -> None:
    tokenizer = RewritingTokenizer()
    tokenizer.eos_token_id = None  # type: ignore[assignment]
    with pytest.raises(TemplateError, match="eos_token_id must be an integer"):
        ObservationEncoder(tokenizer).encode(OBSERVATION, ends_with_eos=True)


def test_template_results_may_be_lists_or_mappings() -> None:
    assert template_token_ids([1, 2], what="x") == [1, 2]
    assert template_token_ids({"input_ids": [1, 2]}, what="x") == [1, 2]
    with pytest.raises(TemplateError):
        template_token_ids({"input_ids": [[1, 2]]}, what="x")
    with pytest.raises(TemplateError):
        template_token_ids("text", what="x")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
        {"role": "user", "content": [{"type": "text", "text": 3}]},
        {"role": "user", "content": None},
        {"content": "x"},
        "just text",
    ],
)
def test_only_text_observation_messages_pass(message: Any) -> None:
    with pytest.raises(ObservationError):
        validate_text_observation(message)


def test_text_observation_messages_pass_unchanged() -> None:
    assert validate_text_observation(OBSERVATION) is OBSERVATION


@pytest.mark.parametrize(
    ("text", "ids", "finish", "stop", "eos", "due"),
    [
        ("ans </a>", [1, 2], "stop", ["</a>"], 9, True),
        ("ans </a>", [1, 2], "stop", "</a>", 9, True),
        ("ans </a>", [1, 9], "stop", ["</a>"], 9, False),
        ("ans </a>", [1, 2], "length", ["</a>"], 9, False),
        ("ans </a> x", [1, 2], "stop", ["</a>"], 9, False),
        ("ans </a>", [1, 2], "stop", None, 9, False),
        ("ans </a>", [1, 2], "stop", [], 9, False),
        ("ans </a>", [1, 2], "stop", ["</a>"], None, False),
        ("ans </b>", [1, 2], "stop", ["</a>", "</b>"], 9, True),
    ],
)
def test_stop_string_eos_rule(text: str, ids: list[int], finish: str, stop: Any, eos: Any, due: bool) -> None:
    assert stop_string_eos_due(text, ids, finish=finish, stop=stop, eos_token_id=eos) is due
