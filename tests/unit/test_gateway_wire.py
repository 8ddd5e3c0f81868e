"""The gateway's request checks and its history comparison by meaning, without a server."""

from __future__ import annotations

import json

import pytest

from fsm_rollout.engine.schema import check_chat_message
from fsm_rollout.gateway.conversation import compare_history, same_message
from fsm_rollout.gateway.openai_wire import GatewayError, parse_chat_request, render_message
from fsm_rollout.tokens.chat_messages import template_messages


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
    # the render form is OpenAI's wire form (vLLM refuses object arguments), re-encoded from the decoded call
    rendered = render_message(checked(call('{"x":  false}'))[0])
    assert rendered["tool_calls"][0]["function"]["arguments"] == '{"x": false}'
    check_chat_message(rendered, 0)
    assert template_messages([rendered])[0]["tool_calls"][0]["function"]["arguments"] == {"x": False}
    for body, code in [
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),  # no logprobs=true
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [call("{not json")]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ]:
        with pytest.raises(GatewayError) as error:
            parse_chat_request(body)
        assert error.value.status == 400 and error.value.code == code


def test_top_logprobs_ask_the_engine_for_that_many_candidates() -> None:
    user = {"role": "user", "content": "x"}
    assert parse_chat_request({"messages": [user], "logprobs": True, "top_logprobs": 20}).sampling == {
        "top_logprobs": 20
    }
    # 0 is no candidates: nothing extra is asked of the engine
    assert parse_chat_request({"messages": [user], "logprobs": True, "top_logprobs": 0}).sampling == {}
    assert parse_chat_request({"messages": [user], "top_logprobs": 0}).sampling == {}
    with pytest.raises(GatewayError, match="from 0 to 20, got 21"):
        parse_chat_request({"messages": [user], "logprobs": True, "top_logprobs": 21})


def test_tool_choice_is_checked_and_a_forcing_one_becomes_structured_outputs() -> None:
    user = {"role": "user", "content": "Hi"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    # missing: OpenAI's default, "auto" with tools and "none" without (no tools, no tool calls)
    assert parse_chat_request({"messages": [user]}).tool_choice == "none"
    assert parse_chat_request({"messages": [user], "tools": tools}).tool_choice == "auto"
    assert parse_chat_request({"messages": [user], "tool_choice": "none"}).tool_choice == "none"
    assert parse_chat_request({"messages": [user], "tools": tools, "tool_choice": "required"}).tool_choice == (
        "required"
    )
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "f"}}, "f")):
        call = parse_chat_request({"messages": [user], "tools": tools, "tool_choice": choice})
        assert (call.tool_choice, call.tool_name) == ("required", name)
        tag = json.loads(call.sampling["structured_outputs"]["structural_tag"])
        assert tag["format"]["elements"][0]["value"] == '<tool_call>\n{"name": "f", "arguments": '
    assert "structured_outputs" not in parse_chat_request({"messages": [user], "tools": tools}).sampling
    refused = [
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tool_choice": "any"}, "is not one of"),
        ({"tool_choice": 3}, "must be"),
    ]
    for extra, words in refused:
        with pytest.raises(GatewayError) as error:
            parse_chat_request({"messages": [user], **extra})
        assert error.value.status == 400 and error.value.code == "tool_choice" and words in error.value.message


def test_image_url_parts_with_data_urls_are_kept_in_user_and_tool_messages() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "Look:"}
    (kept,) = checked({"role": "user", "content": [text, image]})
    assert kept["content"] == [text, image]
    assert checked({"role": "user", "content": [text, text]})[0]["content"] == "Look:Look:"  # text only: joined
    refused = [
        ({"role": "assistant", "content": [image]}, "user and tool messages"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}, "data:image"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}, "data:"),
    ]
    for message, words in refused:
        with pytest.raises(GatewayError) as error:
            checked(message)
        assert error.value.status == 400 and words in error.value.message
