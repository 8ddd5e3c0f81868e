"""Observation boundary tokens (the dummy-prefix method) and the stop-string EOS rule, with the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_rollout.errors import (
    ImageObservationError,
    ObservationError,
    TemplateError,
    TemplateNotPrefixStable,
    VideoObservationError,
)
from fsm_rollout.tokens.chat import (
    DUMMY_MESSAGES,
    TOOL_DUMMY_MESSAGES,
    ObservationEncoder,
    observation_shape,
    record_observation,
    stop_string_eos_due,
    template_identity,
    template_token_ids,
    validate_observation,
    validate_text_observation,
)

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
    import fsm_rollout.tokens.chat as chat

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


# --- observations that are lists of messages, and the per-shape dummy prefix ---------------------------------


@pytest.fixture(scope="module")
def grouped() -> Any:
    from fsm_rollout.testing.templates import GROUPED_TOOLS_CHAT_TEMPLATE, qwen_tokenizer_with_template

    return qwen_tokenizer_with_template(GROUPED_TOOLS_CHAT_TEMPLATE)


def tool_results(count: int) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "content": f"result {i}", "tool_call_id": f"call_{i}", "name": "calc"} for i in range(count)
    ]


def template_suffix(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """What the template renders for ``messages`` after the tool-call dummy prefix, from the prefix's last EOS."""
    prefix = tokenizer.apply_chat_template(list(TOOL_DUMMY_MESSAGES), tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(
        [*TOOL_DUMMY_MESSAGES, *messages], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert whole[: len(prefix)] == prefix
    eos_at = len(prefix) - 1 - prefix[::-1].index(tokenizer.eos_token_id)
    return prefix[eos_at:] + whole[len(prefix) :]


@pytest.mark.parametrize("count", [2, 3, 4])
def test_consecutive_tool_results_encode_as_one_suffix_grouped_as_the_template_groups_them(
    grouped: Any, count: int
) -> None:
    ids = ObservationEncoder(grouped).encode(tool_results(count), ends_with_eos=False)
    assert ids == template_suffix(grouped, tool_results(count))
    text = grouped.decode(ids)
    responses = "\n".join(f"<tool_response>\nresult {i}\n</tool_response>" for i in range(count))
    assert text == f"<|im_end|>\n<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n"
    assert text.count("<|im_start|>user") == 1  # one user turn, not one per result


def test_encoding_tool_results_one_by_one_would_not_be_what_the_template_renders(grouped: Any) -> None:
    encoder = ObservationEncoder(grouped)
    together = encoder.encode(tool_results(2), ends_with_eos=True)
    one_by_one = [token for message in tool_results(2) for token in encoder.encode(message, ends_with_eos=True)]
    assert together != one_by_one


def test_a_list_with_one_message_encodes_like_the_message(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    assert encoder.encode([OBSERVATION], ends_with_eos=False) == encoder.encode(OBSERVATION, ends_with_eos=False)
    assert encoder.encode((OBSERVATION,), ends_with_eos=True) == encoder.encode(OBSERVATION, ends_with_eos=True)


def test_a_user_observation_keeps_the_plain_dummy_prefix(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    encoder.encode(OBSERVATION, ends_with_eos=True)
    ((shape, _),) = encoder._prefixes
    assert shape == "user"
    ((prefix, _),) = encoder._prefixes.values()
    assert prefix == tokenizer.apply_chat_template(list(DUMMY_MESSAGES), tokenize=True, return_dict=False)


def test_a_tool_observation_gets_a_prefix_ending_with_a_tool_call_rendered_once(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    encoder = ObservationEncoder(counting)
    encoder.encode(OBSERVATION, ends_with_eos=True)
    assert counting.renders == 2
    encoder.encode(tool_results(1), ends_with_eos=True)
    assert counting.renders == 4  # the tool-shape prefix, then the observation
    encoder.encode(tool_results(3), ends_with_eos=True)
    assert counting.renders == 5  # the prefix is cached per shape
    shapes = sorted(shape for shape, _ in encoder._prefixes)
    assert shapes == ["tool", "user"]
    tool_prefix = next(prefix for (shape, _), (prefix, _) in encoder._prefixes.items() if shape == "tool")
    assert "<tool_call>" in tokenizer.decode(tool_prefix)


def test_the_shape_is_the_first_messages_role() -> None:
    assert observation_shape(tool_results(2)) == "tool"
    assert observation_shape([OBSERVATION, *tool_results(1)]) == "user"
    assert observation_shape([{"role": "system", "content": "x"}]) == "user"


def test_a_template_that_needs_a_tool_call_before_a_tool_result_encodes_with_the_tool_prefix() -> None:
    from fsm_rollout.testing.templates import TOOL_CALL_REQUIRED_CHAT_TEMPLATE, qwen_tokenizer_with_template

    strict = qwen_tokenizer_with_template(TOOL_CALL_REQUIRED_CHAT_TEMPLATE)
    with pytest.raises(Exception, match="must follow an assistant message with tool_calls"):
        strict.apply_chat_template([*DUMMY_MESSAGES, *tool_results(1)], tokenize=True)  # the plain prefix
    ids = ObservationEncoder(strict).encode(tool_results(2), ends_with_eos=True)
    assert strict.decode(ids).startswith("\n<|im_start|>user\n<tool_response>\nresult 0")


class ToolRewritingTokenizer(RewritingTokenizer):
    """Prefix-stable before user messages, but rewrites the assistant turn before a tool message."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        ids: list[int] = []
        for index, message in enumerate(messages):
            before_tool = index + 1 < len(messages) and messages[index + 1]["role"] == "tool"
            ids += [13] if message["role"] == "assistant" and before_tool else [12]
            ids.append(2)
        return ids


def test_prefix_stability_is_checked_for_every_shape() -> None:
    encoder = ObservationEncoder(ToolRewritingTokenizer())
    encoder.encode(OBSERVATION, ends_with_eos=True)
    with pytest.raises(TemplateNotPrefixStable, match="for tool observations"):
        encoder.encode(tool_results(1), ends_with_eos=True)


def test_the_prefix_stability_error_names_the_template(tokenizer: Any) -> None:
    with pytest.raises(TemplateNotPrefixStable, match=r"RewritingTokenizer \(no chat_template attribute\)"):
        ObservationEncoder(RewritingTokenizer()).encode(OBSERVATION, ends_with_eos=True)
    assert template_identity(tokenizer).startswith(tokenizer.name_or_path + " (chat template sha256:")


def test_an_empty_list_is_not_an_observation(tokenizer: Any) -> None:
    with pytest.raises(ObservationError, match="at least one message"):
        ObservationEncoder(tokenizer).encode([], ends_with_eos=True)


# --- validating what format_observation returned ----------------------------------------------------------------


def test_validate_observation_takes_image_parts_in_any_role() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [
        {"role": "tool", "content": [image], "tool_call_id": "call_0"},
        {"role": "user", "content": [{"type": "text", "text": "Now:"}, {"type": "image", "image": "b.png"}, image]},
    ]
    assert validate_observation(messages) == messages


def test_validate_observation_returns_the_messages_as_a_list() -> None:
    assert validate_observation(OBSERVATION) == [OBSERVATION]
    assert validate_observation(OBSERVATION)[0] is OBSERVATION
    results = tool_results(2)
    assert validate_observation(results) == results
    assert validate_observation(tuple(results)) == results


@pytest.mark.parametrize(
    ("observation", "error", "match"),
    [
        ([], ObservationError, "empty list"),
        ("text", ObservationError, "or a non-empty list of them"),
        (None, ObservationError, "or a non-empty list of them"),
        ([OBSERVATION, "text"], ObservationError, r"observation message \[1\]: format_observation must return"),
        ([OBSERVATION, {"role": "tool"}], ObservationError, r"message \[1\]"),
        (
            [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}],
            VideoObservationError,
            r"observation message \[0\]: observation message \[0\] content\[0\] is a 'video' part",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}}]}],
            ImageObservationError,
            r"content\[0\] is a remote image \('https://x.invalid/a.png'\): pass the image itself",
        ),
        (
            [{"role": "user", "content": [{"type": "image", "image": "http://x.invalid/b.png"}]}],
            ImageObservationError,
            "is a remote image",
        ),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            ImageObservationError,
            r"content\[0\] is a 'input_audio' part",
        ),
        (
            [{"role": "tool", "content": "1", "tool_call_id": 3}],
            ObservationError,
            r"\[0\]: a tool observation's 'tool_call_id' must be a string, got int",
        ),
        ({"role": "tool", "content": "1", "name": None}, ObservationError, "'name' must be a string"),
    ],
)
def test_bad_observations_are_specific_errors(observation: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        validate_observation(observation)


def test_tool_messages_may_carry_a_call_id_and_a_name() -> None:
    message = {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "call_0", "name": "calc"}
    assert validate_text_observation(message) is message


def test_observation_records_are_added_without_changing_a_shared_list() -> None:
    shared: list[dict[str, Any]] = []
    metadata: dict[str, Any] = {"observations": shared}
    record_observation(metadata, tool_results(2), start=3, end=9)
    record_observation(metadata, [OBSERVATION], start=12, end=20)
    assert shared == []
    assert metadata["observations"] == [
        {"start": 3, "end": 9, "messages": tool_results(2)},
        {"start": 12, "end": 20, "messages": [OBSERVATION]},
    ]
    assert metadata["observations"][1]["messages"][0] is not OBSERVATION  # a copy: later edits do not reach it
