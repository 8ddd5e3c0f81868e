"""Template parity of whole conversations, and the start-up probe, over the templates the tests can build.

Samples are built the way a rollout builds them: the prompt rendered with the generation prompt, each turn's tokens
appended trainable, the masked EOS after a stop string, each observation's boundary from the encoder appended
masked and recorded in ``metadata["observations"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import pytest

from fsm_rollout import Sample
from fsm_rollout.errors import ParityInputError, TemplateError, TemplateNotPrefixStable
from fsm_rollout.testing.templates import (
    GROUPED_TOOLS_CHAT_TEMPLATE,
    MINIMAL_CHATML_TEMPLATE,
    THINK_STRIPPING_CHAT_TEMPLATE,
    TOOL_CALL_REQUIRED_CHAT_TEMPLATE,
    qwen_tokenizer_with_template,
)
from fsm_rollout.tokens.chat import ObservationEncoder, record_observation
from fsm_rollout.tokens.parity import check_template_parity, rebuild_conversation

Ending = Literal["eos", "stop_eos", "open", "none"]
"""How a turn ends: the model's EOS, the masked EOS after a stop string, a stop string without the EOS (the
boundary then starts with it), or cut by the length limit (no observation may follow)."""

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
PROMPT = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "6 * 7?"}]
THINKING = "<think>\nLet me compute.\n</think>\n\nIt is 42."
TOOL_TURN = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def templates(tokenizer: Any) -> dict[str, Any]:
    return {
        "bundled": tokenizer,
        "grouped": qwen_tokenizer_with_template(GROUPED_TOOLS_CHAT_TEMPLATE),
        "minimal": qwen_tokenizer_with_template(MINIMAL_CHATML_TEMPLATE),
    }


@pytest.fixture(scope="module")
def thinking_stripper() -> Any:
    return qwen_tokenizer_with_template(THINK_STRIPPING_CHAT_TEMPLATE)


def tool_results(count: int) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "content": f"result {i}", "tool_call_id": f"call_{i}", "name": "calc"} for i in range(count)
    ]


def build_sample(
    tokenizer: Any,
    turns: Sequence[tuple[str, Ending]],
    observations: Sequence[list[dict[str, Any]]],
    *,
    tools: list[dict[str, Any]] | None = None,
    prompt: Any = None,
    one_by_one: bool = False,
) -> Sample:
    """A sample as a rollout leaves it: turn, observation, turn, ... (an observation after the last turn when
    ``observations`` has as many entries as ``turns``)."""
    encoder = ObservationEncoder(tokenizer)
    prompt = prompt if prompt is not None else PROMPT
    sample = Sample(prompt=prompt, metadata={"tools": tools} if tools else {})
    sample.tokens = tokenizer.apply_chat_template(
        prompt, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    eos = tokenizer.eos_token_id
    for number, (text, ending) in enumerate(turns):
        ids = tokenizer.encode(text, add_special_tokens=False) + ([eos] if ending == "eos" else [])
        sample.append_response_tokens(ids, [-0.5] * len(ids), trainable=True)
        if ending == "stop_eos":
            sample.append_response_tokens([eos], trainable=False)
        if number >= len(observations):
            continue
        ends_with_eos = sample.tokens[-1] == eos
        messages = observations[number]
        parts = [[message] for message in messages] if one_by_one else [messages]
        boundary = [token for part in parts for token in encoder.encode(part, ends_with_eos=ends_with_eos, tools=tools)]
        start = sample.response_length
        sample.append_response_tokens(boundary, trainable=False)
        record_observation(sample.metadata, messages, start=start, end=sample.response_length)
    return sample


SHAPES = {
    "one user message": [{"role": "user", "content": "Are you sure?"}],
    "one tool result": tool_results(1),
    "two tool results": tool_results(2),
    "three tool results": tool_results(3),
    "four tool results": tool_results(4),
}


@pytest.mark.parametrize("template", ["bundled", "grouped", "minimal"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_conversations_of_every_shape_render_as_the_appended_tokens(
    templates: dict[str, Any], template: str, shape: str
) -> None:
    tokenizer = templates[template]
    observation = SHAPES[shape]
    turn = TOOL_TURN if observation[0]["role"] == "tool" else THINKING
    sample = build_sample(
        tokenizer, [(turn, "eos"), (turn, "eos"), ("Done.", "eos")], [observation, observation], tools=TOOLS
    )
    report = check_template_parity(sample, tokenizer)
    assert report.ok, report.describe()
    assert report.position is None
    assert report.trailing == len(tokenizer.encode("\n", add_special_tokens=False))  # what closes the last turn


@pytest.mark.parametrize("template", ["bundled", "grouped", "minimal"])
@pytest.mark.parametrize("ending", ["stop_eos", "open"])
def test_a_turn_that_stopped_on_a_stop_string_is_closed_by_the_eos_either_way(
    templates: dict[str, Any], template: str, ending: Ending
) -> None:
    tokenizer = templates[template]
    sample = build_sample(tokenizer, [(TOOL_TURN, ending), ("Done.", "eos")], [tool_results(2)])
    assert check_template_parity(sample, tokenizer).ok


def test_a_last_turn_cut_by_the_length_limit_matches_up_to_the_sample_end(templates: dict[str, Any]) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(THINKING, "eos"), ("It is", "none")], [SHAPES["one user message"]])
    report = check_template_parity(sample, tokenizer)
    assert report.ok
    assert report.trailing == 2  # the EOS the sample does not have, and the newline


def test_a_sample_that_ends_with_an_observation_renders_with_the_generation_prompt(templates: dict[str, Any]) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(TOOL_TURN, "eos")], [tool_results(3)])
    assert rebuild_conversation(sample, tokenizer).add_generation_prompt
    report = check_template_parity(sample, tokenizer)
    assert report.ok and report.trailing == 0


def test_an_empty_turn_between_observations_is_still_a_turn(templates: dict[str, Any]) -> None:
    tokenizer = templates["bundled"]
    sample = build_sample(
        tokenizer,
        [(THINKING, "eos"), ("", "open"), ("Done.", "eos")],
        [SHAPES["one user message"], SHAPES["one user message"]],
    )
    conversation = rebuild_conversation(sample, tokenizer)
    assert [segment.label for segment in conversation.segments] == [
        "the prompt",
        "assistant turn 0",
        "observation 0",
        "assistant turn 1",
        "observation 1",
        "assistant turn 2",
    ]
    assert conversation.messages[4] == {"role": "assistant", "content": ""}
    assert check_template_parity(sample, tokenizer).ok


def test_the_rebuilt_conversation_is_prompt_turns_and_recorded_observations(templates: dict[str, Any]) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(TOOL_TURN, "stop_eos"), ("Done.", "eos")], [tool_results(2)])
    conversation = rebuild_conversation(sample, tokenizer)
    assert conversation.messages == [
        *PROMPT,
        {"role": "assistant", "content": TOOL_TURN},
        *tool_results(2),
        {"role": "assistant", "content": "Done."},
    ]
    assert not conversation.add_generation_prompt


def test_tools_default_to_the_samples_own(templates: dict[str, Any]) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(TOOL_TURN, "eos"), ("Done.", "eos")], [tool_results(1)], tools=TOOLS)
    assert check_template_parity(sample, tokenizer).ok
    without = check_template_parity(sample, tokenizer, tools=[])
    assert not without.ok
    assert without.segment == "the prompt"
    assert "# Tools" in without.sample_text


# --- reported differences ---------------------------------------------------------------------------------------


def test_a_template_that_strips_earlier_thinking_is_reported_at_the_first_turn(thinking_stripper: Any) -> None:
    sample = build_sample(thinking_stripper, [(THINKING, "eos"), (THINKING, "eos")], [SHAPES["one user message"]])
    report = check_template_parity(sample, thinking_stripper)
    assert not report.ok
    prompt_length = len(sample.tokens) - sample.response_length
    assert report.position == report.rendered_position == prompt_length
    assert report.segment == "assistant turn 0"
    assert report.before.endswith("<|im_start|>assistant\n")
    assert report.sample_text.startswith("<think>")
    assert report.rendered_text.startswith("It is 42.")
    assert report.sample_token == sample.tokens[prompt_length]
    assert "first difference at token" in report.describe() and "assistant turn 0" in str(report)


def test_tool_results_appended_one_by_one_under_a_grouping_template_differ_in_the_observation(
    templates: dict[str, Any],
) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(TOOL_TURN, "eos"), ("Done.", "eos")], [tool_results(2)], one_by_one=True)
    report = check_template_parity(sample, tokenizer)
    assert not report.ok
    assert report.segment == "observation 0"
    # the first result's user turn is closed where the template goes on with the second result
    assert "<|im_end|>" in report.sample_text.split("<tool_response>")[0]
    assert "<tool_response>\nresult 1" in report.rendered_text


def test_a_changed_token_is_found_where_it_is(templates: dict[str, Any]) -> None:
    tokenizer = templates["minimal"]
    sample = build_sample(tokenizer, [(THINKING, "eos"), ("Done.", "eos")], [SHAPES["two tool results"]])
    observation = sample.metadata["observations"][0]
    prompt_length = len(sample.tokens) - sample.response_length
    where = prompt_length + observation["start"] + 3
    sample.tokens[where] = tokenizer.encode("X", add_special_tokens=False)[0]
    report = check_template_parity(sample, tokenizer)
    assert (report.ok, report.position, report.segment) == (False, where, "observation 0")
    assert report.sample_token != report.rendered_token


def test_a_rendering_that_goes_on_after_a_final_observation_is_a_difference_at_the_end(
    templates: dict[str, Any],
) -> None:
    tokenizer = templates["grouped"]
    sample = build_sample(tokenizer, [(TOOL_TURN, "eos")], [tool_results(1)])
    for values in (sample.tokens, sample.loss_mask, sample.rollout_log_probs):
        del values[-1]  # the generation prompt's last token
    sample.response_length -= 1
    sample.metadata["observations"][0]["end"] -= 1
    report = check_template_parity(sample, tokenizer)
    assert (report.ok, report.position, report.segment) == (False, len(sample.tokens), "the end")
    assert report.sample_token is None and report.sample_text == ""
    assert report.rendered_text == "\n"


def test_first_difference_handles_prefixes_and_placeholder_runs() -> None:
    from fsm_rollout.tokens.parity import _first_difference

    assert _first_difference([1, 2, 3], [1, 2, 3], None) is None
    assert _first_difference([1, 2], [1, 2, 3], None) == (2, 2)
    assert _first_difference([1, 2, 3], [1, 2], None) == (2, 2)
    assert _first_difference([1, 9, 9, 9, 2], [1, 9, 2], 9) is None
    assert _first_difference([1, 9, 9, 3], [1, 9, 2], 9) == (3, 2)
    assert _first_difference([1, 9, 9], [1, 9, 9, 9, 4], 9) == (3, 4)


# --- images in the prompt ---------------------------------------------------------------------------------------


def test_image_placeholder_runs_compare_as_one_unit(tokenizer: Any) -> None:
    from PIL import Image

    image = Image.new("RGB", (4, 4), "red")
    sample = build_sample(
        tokenizer,
        [(THINKING, "eos"), ("Done.", "eos")],
        [SHAPES["one user message"]],
        prompt=[
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is shown?"}]}
        ],
    )
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = sample.tokens.index(pad)
    sample.tokens[at:at] = [pad] * 5  # vLLM's render expands the placeholder to the image's tokens
    report = check_template_parity(sample, tokenizer)
    assert report.ok, report.describe()
    where = len(sample.tokens) - sample.response_length + sample.metadata["observations"][0]["start"] + 3
    sample.tokens[where] = tokenizer.encode("X", add_special_tokens=False)[0]
    report = check_template_parity(sample, tokenizer)
    assert (report.position, report.segment) == (where, "observation 0")
    assert report.rendered_position == where - 5


# --- samples that cannot be rebuilt -----------------------------------------------------------------------------


def test_masked_tokens_without_an_observation_record_cannot_be_rebuilt(templates: dict[str, Any]) -> None:
    tokenizer = templates["bundled"]
    sample = build_sample(tokenizer, [(THINKING, "eos"), ("Done.", "eos")], [SHAPES["one user message"]])
    del sample.metadata["observations"]
    with pytest.raises(ParityInputError, match=r"masked response token \d+ is neither"):
        check_template_parity(sample, tokenizer)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"start": 0, "end": 10**6, "messages": []}, "must be"),
        ({"start": 5, "end": 2, "messages": []}, "must be"),
        ({"start": 0, "end": 3, "messages": "x"}, "must be"),
        ("record", "must be"),
        ({"start": 0, "end": 3, "messages": []}, "covers trainable tokens"),
    ],
)
def test_malformed_observation_records_are_input_errors(templates: dict[str, Any], record: Any, match: str) -> None:
    tokenizer = templates["bundled"]
    sample = build_sample(tokenizer, [(THINKING, "eos")], [])
    sample.metadata["observations"] = [record]
    with pytest.raises(ParityInputError, match=match):
        check_template_parity(sample, tokenizer)


def test_overlapping_records_are_input_errors(templates: dict[str, Any]) -> None:
    tokenizer = templates["bundled"]
    sample = build_sample(
        tokenizer,
        [(THINKING, "eos"), ("a", "eos"), ("b", "eos")],
        [SHAPES["one user message"], SHAPES["one user message"]],
    )
    first, second = sample.metadata["observations"]
    sample.metadata["observations"] = [first, {**second, "start": first["end"] - 1}]
    with pytest.raises(ParityInputError):
        check_template_parity(sample, tokenizer)


# --- the start-up probe -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["bundled", "grouped", "minimal"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_probe_passes_append_only_templates(templates: dict[str, Any], template: str, tools: Any) -> None:
    ObservationEncoder(templates[template]).probe(tools=tools)


def test_the_probe_fails_a_thinking_stripping_template_naming_it(thinking_stripper: Any) -> None:
    encoder = ObservationEncoder(thinking_stripper)
    encoder.encode({"role": "user", "content": "x"}, ends_with_eos=True)  # the dummy prefix alone does not see it
    with pytest.raises(TemplateNotPrefixStable) as caught:
        encoder.probe()
    message = str(caught.value)
    assert thinking_stripper.name_or_path in message
    assert "chat template sha256:" in message
    assert "for user observations" in message
    assert "assistant turn 0" in message and "<think>" in message


class Counting:
    """The tokenizer, counting template renders."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.renders = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def test_the_probe_runs_once_per_tools_kwargs_and_shapes(templates: dict[str, Any]) -> None:
    counting = Counting(templates["grouped"])
    encoder = ObservationEncoder(counting)
    encoder.probe(tools=TOOLS)
    renders = counting.renders
    assert renders > 0
    encoder.probe(tools=TOOLS)
    assert counting.renders == renders
    encoder.probe(tools=TOOLS, shapes=["user"])
    assert counting.renders > renders


def test_the_probe_checks_tool_results_only_when_there_are_tools_or_when_asked(templates: dict[str, Any]) -> None:
    strict = qwen_tokenizer_with_template(TOOL_CALL_REQUIRED_CHAT_TEMPLATE)
    ObservationEncoder(strict).probe()  # user observations only
    with pytest.raises(TemplateError, match=r"cannot render tool observations: TemplateError: a tool message"):
        ObservationEncoder(strict).probe(tools=TOOLS)
    with pytest.raises(TemplateError, match="cannot render tool observations"):
        ObservationEncoder(strict).probe(shapes=["tool"])


def test_the_probe_knows_its_shapes(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="unknown observation shape"):
        ObservationEncoder(tokenizer).probe(shapes=["assistant"])


def test_the_probe_needs_a_tokenizer_that_encodes_and_decodes() -> None:
    class TemplateOnly:
        eos_token_id = 2

        def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
            return [1, 2] * len(messages)

    with pytest.raises(TemplateError, match=r"needs tokenizer\.encode and tokenizer\.decode"):
        ObservationEncoder(TemplateOnly()).probe()
