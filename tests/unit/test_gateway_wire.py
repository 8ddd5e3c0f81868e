"""The gateway's request checks and its history comparison by meaning, without a server."""

from __future__ import annotations

import pytest

from fsm_rollout.gateway.conversation import compare_history, same_message
from fsm_rollout.gateway.openai_wire import GatewayError, parse_chat_request, render_message


def call(arguments: str, content: str | None = None) -> dict:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
    }


def checked(*messages: dict) -> list[dict]:
    return parse_chat_request({"messages": list(messages)}).messages


def test_tool_calls_compare_by_name_and_parsed_arguments() -> None:
    held, resent, changed = checked(
        call('{"a": 1, "flag": false}'), call('{"flag":false,"a":1}'), call('{"a": 1, "flag": true}')
    )
    assert same_message(held, resent)
    assert not same_message(held, changed)
    text, spaced, other = checked(
        {"role": "assistant", "content": "Hi"},
        {"role": "assistant", "content": "Hi\n"},
        {"role": "assistant", "content": "Ho"},
    )
    assert same_message(text, spaced) and not same_message(text, other)


def test_compare_history_extends_retries_and_rewrites() -> None:
    user, answer, more = checked(
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}
    )
    assert compare_history([user, answer], None, [user, answer, more], None, last_answered=True).new == [more]
    assert compare_history([user, answer], None, [user], None, last_answered=True).kind == "retry"
    edited = {"role": "user", "content": "other"}
    assert compare_history([user, answer], None, [edited, answer, more], None, last_answered=True).kind == "rewritten"
    tools = [{"type": "function", "function": {"name": "f"}}]
    found = compare_history([user, answer], None, [user, answer, more], tools, last_answered=True)
    assert (found.kind, found.detail) == ("rewritten", "the tools changed")


def test_requests_are_checked_and_normalised() -> None:
    parsed = parse_chat_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "stop": "END",
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "temperature": 0.5,
        }
    )
    assert parsed.messages[0]["content"] == "ab"
    assert parsed.sampling == {"stop": ["END"], "max_tokens": 5, "temperature": 0.5}
    assert render_message(checked(call('{"x": false}'))[0])["tool_calls"][0]["function"]["arguments"] == {"x": False}
    for body, code in [
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [call("{not json")]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ]:
        with pytest.raises(GatewayError) as error:
            parse_chat_request(body)
        assert error.value.status == 400 and error.value.code == code
