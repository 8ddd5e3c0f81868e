"""The Qwen/Hermes tool-call parser: several calls per turn in order, and every malformed block as a problem."""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest

from fsm_rollout.tokens.tool_calls import ToolCall, ToolCallProblem, parse_tool_calls


def block(payload: Any, *, newlines: bool = False) -> str:
    body = json.dumps(payload)
    return f"<tool_call>\n{body}\n</tool_call>" if newlines else f"<tool_call>{body}</tool_call>"


def test_text_without_tool_calls_parses_to_nothing() -> None:
    parse = parse_tool_calls("Just thinking out loud. </tool_call> is only text here.")
    assert parse.calls == () and parse.problems == () and parse.ok


def test_several_calls_come_back_in_order_with_their_positions() -> None:
    first = block({"name": "search", "arguments": {"query": "x", "k": 3}}, newlines=True)
    second = block({"name": "calc", "arguments": {"expr": "1+1"}})
    text = f"Let me look. {first} and then {second} done."
    parse = parse_tool_calls(text)
    assert parse.ok
    assert [(call.name, call.arguments) for call in parse.calls] == [
        ("search", {"query": "x", "k": 3}),
        ("calc", {"expr": "1+1"}),
    ]
    for call, written in zip(parse.calls, (first, second), strict=True):
        assert text[call.start : call.end] == written
        assert call.raw == written[len("<tool_call>") : -len("</tool_call>")]
        assert call.closed
    assert [call.index for call in parse.calls] == [0, 1]


def test_arguments_written_as_a_json_string_are_decoded() -> None:
    (call,) = parse_tool_calls(block({"name": "calc", "arguments": json.dumps({"expr": "2*3"})})).calls
    assert call.arguments == {"expr": "2*3"}


def test_missing_arguments_read_as_an_empty_object_and_extra_keys_stay_in_the_payload() -> None:
    (call,) = parse_tool_calls(block({"name": "now", "id": "call_7"})).calls
    assert call.arguments == {}
    assert call.payload == {"name": "now", "id": "call_7"}


def test_a_code_fence_around_the_body_is_ignored() -> None:
    (call,) = parse_tool_calls('<tool_call>```json\n{"name": "a", "arguments": {}}\n```</tool_call>').calls
    assert call.name == "a"


@pytest.mark.parametrize(
    ("body", "kind", "name", "detail"),
    [
        ('{"name": "calc", "arguments": {"x": }', "malformed_json", None, "Expecting value at character 36"),
        ("[1, 2]", "not_an_object", None, "array"),
        ('"calc"', "not_an_object", None, "string"),
        ('{"arguments": {}}', "missing_name", None, None),
        ('{"name": "", "arguments": {}}', "missing_name", "", None),
        ('{"name": 5, "arguments": {}}', "missing_name", 5, None),
        ('{"name": "calc", "arguments": [1]}', "arguments_not_object", "calc", "array"),
        ('{"name": "calc", "arguments": null}', "arguments_not_object", "calc", "null"),
        (
            '{"name": "calc", "arguments": "{x"}',
            "malformed_arguments",
            "calc",
            "Expecting property name enclosed in double quotes at character 1",
        ),
        ('{"name": "calc", "arguments": "7"}', "arguments_not_object", "calc", "number"),
    ],
)
def test_malformed_blocks_are_problems_not_errors(body: str, kind: str, name: Any, detail: str | None) -> None:
    text = f"prefix <tool_call>{body}</tool_call>"
    parse = parse_tool_calls(text)
    assert parse.calls == ()
    (problem,) = parse.problems
    assert not parse.ok
    assert (problem.kind, problem.name, problem.detail) == (kind, name, detail)
    assert problem.raw == body
    assert (problem.start, problem.end) == (len("prefix "), len(text))
    assert problem.message.endswith(".")


def test_good_calls_around_a_bad_block_are_kept_and_blocks_keep_text_order() -> None:
    text = block({"name": "a", "arguments": {}}) + "<tool_call>{oops}</tool_call>" + block({"name": "b"})
    parse = parse_tool_calls(text)
    assert [call.name for call in parse.calls] == ["a", "b"]
    assert [problem.index for problem in parse.problems] == [1]
    kinds = [block.name if isinstance(block, ToolCall) else block.kind for block in parse.blocks]
    assert kinds == ["a", "malformed_json", "b"]


def test_an_unclosed_last_tag_is_a_problem_unless_asked_to_read_it() -> None:
    text = 'ok <tool_call>{"name": "calc", "arguments": {"x": 1}}'
    (problem,) = parse_tool_calls(text).problems
    assert problem.kind == "unclosed_tag"
    assert problem.end == len(text)
    (call,) = parse_tool_calls(text, read_unclosed=True).calls
    assert (call.name, call.arguments, call.closed, call.end) == ("calc", {"x": 1}, False, len(text))


def test_an_unclosed_tag_before_another_block_ends_where_that_block_starts() -> None:
    later = block({"name": "b", "arguments": {}})
    text = '<tool_call>{"name": "a"' + " then " + later
    for read_unclosed in (False, True):  # only the last block may be read unclosed
        parse = parse_tool_calls(text, read_unclosed=read_unclosed)
        (problem,) = parse.problems
        assert problem.kind == "unclosed_tag"
        assert problem.end == text.index(later)
        assert [call.name for call in parse.calls] == ["b"]


def test_an_unclosed_last_block_read_anyway_can_still_be_malformed() -> None:
    (problem,) = parse_tool_calls('<tool_call>{"name": "calc", "argu', read_unclosed=True).problems
    assert problem.kind == "malformed_json"


def test_a_custom_decoder_is_used_for_bodies_and_argument_strings() -> None:
    seen: list[str] = []

    def loads(text: str) -> Any:
        seen.append(text)
        return ast.literal_eval(text)  # single-quoted keys, as some models write them

    (call,) = parse_tool_calls("<tool_call>{'name': 'a', 'arguments': \"{'x': 1}\"}</tool_call>", loads=loads).calls
    assert call.arguments == {"x": 1}
    assert len(seen) == 2


def test_a_custom_decoder_that_raises_anything_value_like_is_a_problem() -> None:
    def loads(text: str) -> Any:
        raise ValueError("nope")

    (problem,) = parse_tool_calls(block({"name": "a"}), loads=loads).problems
    assert (problem.kind, problem.detail) == ("malformed_json", "nope")


def test_problems_are_values() -> None:
    problem = parse_tool_calls("<tool_call>x</tool_call>").problems[0]
    assert isinstance(problem, ToolCallProblem)
    with pytest.raises(AttributeError):
        problem.kind = "missing_name"  # type: ignore[misc]
