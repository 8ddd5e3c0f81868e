"""The Messages dialect's wire module: requests read into chat calls, answers checked against the SDK's types."""

from __future__ import annotations

from typing import Any

import anthropic
import pydantic
import pytest

from fsm_rollout.gateway import GatewayError
from fsm_rollout.gateway.messages_wire import (
    ERROR_PREFIX,
    IGNORED_FIELDS,
    is_messages_path,
    message_events,
    message_object,
    messages_error_body,
    parse_messages_request,
    sse,
    stop_reason,
)
from fsm_rollout.gateway.openai_wire import TurnAnswer, without_stop_string

TOOL = {"name": "add", "description": "Add.", "input_schema": {"type": "object", "properties": {}}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def read(**body: Any) -> Any:
    body.setdefault("max_tokens", 16)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_messages_request(body, {"X-Claude-Code-Session-Id": "cc-1"})


def refused(**body: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        read(**body)
    assert caught.value.status == 400
    return caught.value


def test_system_blocks_tool_results_and_text_keep_their_order() -> None:
    call = read(
        system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
                    {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
        tools=[TOOL],
    ).call
    assert call.messages == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "one\n\ntwo"},
        {
            "role": "assistant",
            "content": "calling",  # the thinking blocks are the model's own: dropped
            "tool_calls": [
                {"id": "toolu_1", "name": "add", "arguments": {"a": 1}},
                {"id": "toolu_2", "name": "add", "arguments": {}},
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": ERROR_PREFIX + "no", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "go on"},
    ]
    assert call.tools == [
        {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": TOOL["input_schema"]}}
    ]
    assert call.tool_choice == "auto" and call.hints == {"session_key": "cc-1"}


def test_images_are_data_url_parts_and_a_url_image_is_refused() -> None:
    call = read(
        messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "source": PNG}]}]
    )
    assert call.call.messages[0]["content"] == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    result = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [{"type": "image", "source": PNG}],
        "is_error": True,
    }
    tool = read(messages=[{"role": "user", "content": [result]}]).call.messages[0]
    assert tool["content"][0] == {"type": "text", "text": ERROR_PREFIX} and tool["content"][1]["type"] == "image_url"
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert refused(messages=[{"role": "user", "content": [url]}]).code == "unsupported_content"
    image = {"type": "image", "source": PNG}
    refused(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [image]}])


def test_typed_tools_are_dropped_and_tool_choice_maps_to_chats() -> None:
    typed = [TOOL, {"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"}]
    read_call = read(tools=typed)
    assert read_call.dropped_tools == ("web_search", "bash") and len(read_call.call.tools) == 1
    assert read(tools=[TOOL], tool_choice={"type": "auto"}).call.tool_choice == "auto"
    assert read(tools=[TOOL], tool_choice={"type": "none"}).call.tool_choice == "none"
    forced = read(tools=[TOOL], tool_choice={"type": "any"}).call
    assert forced.tool_choice == "required" and "structured_outputs" in forced.sampling
    named = read(tools=[TOOL], tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}).call
    assert named.tool_choice == "required" and named.tool_name == "add"
    # under auto, disable_parallel_tool_use is accepted (not enforced), never a 400
    assert (
        read(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}).call.tool_choice == "auto"
    )
    refused(tools=[TOOL], tool_choice={"type": "tool", "name": "web_search"})
    refused(tools=[{"name": "x"}])


def test_sampling_fields_hints_and_fields_accepted_without_effect() -> None:
    read_call = read(
        stop_sequences=["A", "B", "C", "D", "E"],  # more than chat's four
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        metadata={"user_id": "u-1"},
        thinking={"type": "enabled", "budget_tokens": 2048},
        output_config={"effort": "high"},
        **{field: {} for field in IGNORED_FIELDS},
    )
    assert read_call.call.sampling == {
        "max_tokens": 16,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["A", "B", "C", "D", "E"],
        "top_k": 40,
    }
    assert read_call.stop_sequences == ("A", "B", "C", "D", "E")
    assert read_call.call.hints == {"session_key": "cc-1", "user": "u-1"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    formatted = read(output_config={"format": {"type": "json_schema", "schema": schema}}).call.sampling
    assert formatted["structured_outputs"] == {"json": schema, "disable_any_whitespace": True}
    assert refused(max_tokens=None).code == "max_tokens"
    assert (
        parse_messages_request({"messages": [{"role": "user", "content": "hi"}]}, count_only=True).call.sampling == {}
    )
    assert refused(frobnicate=1).code == "frobnicate"
    refused(top_k=0)
    refused(stop_sequences="END")
    refused(messages=[])
    refused(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])


def answer(**fields: Any) -> TurnAnswer:
    values: dict[str, Any] = {
        "content": "Hi.",
        "tool_calls": [],
        "finish_reason": "stop",
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "token_ids": [1, 2, 3],
        "logprobs": [-0.1] * 3,
        "text": "Hi.",
    }
    values.update(fields)
    return TurnAnswer(**values)


def test_stop_reasons_and_the_stop_sequence_cut_from_the_text() -> None:
    assert stop_reason(answer(), ()) == ("end_turn", None)
    assert stop_reason(answer(finish_reason="length"), ()) == ("max_tokens", None)
    calls = [{"id": "call_ab", "name": "add", "arguments": {}}]
    assert stop_reason(answer(tool_calls=calls, finish_reason="tool_calls"), ()) == ("tool_use", None)
    stopped = answer(content="Result: 5 END", text="Result: 5 END")
    assert stop_reason(stopped, ("STOP", "END")) == ("stop_sequence", "END")
    cut = without_stop_string(stopped, ["END"])
    message = message_object(cut, message_id="msg_1", model="m", stop_sequences=("END",))
    assert message["content"] == [{"type": "text", "text": "Result: 5"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


def test_the_message_and_its_events_are_the_sdks_types() -> None:
    calls = [{"id": "call_ab12", "name": "add", "arguments": {"a": 2, "ü": "é"}}]
    full = answer(content="Adding.", reasoning="think", tool_calls=calls, finish_reason="tool_calls")
    message = message_object(full, message_id="msg_1", model="m")
    parsed = anthropic.types.Message.model_validate(message)
    thinking, text, tool_use = parsed.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == "think" and thinking.signature
    assert isinstance(text, anthropic.types.TextBlock) and text.text == "Adding."
    assert isinstance(tool_use, anthropic.types.ToolUseBlock)
    assert tool_use.id == "toolu_ab12" and tool_use.input == {"a": 2, "ü": "é"}
    assert parsed.stop_reason == "tool_use" and parsed.usage.input_tokens == 7 and parsed.usage.output_tokens == 3
    events = message_events(full, message_id="msg_1", model="m")
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in events:
        if name != "ping":
            assert adapter.validate_python(data).type == name
    wire = sse(events).decode()
    assert wire.startswith("event: message_start\ndata: {") and wire.endswith(
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


def test_errors_are_anthropics_shape_and_types() -> None:
    assert messages_error_body(404, "gone") == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "gone"},
    }
    kinds = {
        status: messages_error_body(status, "x")["error"]["type"]
        for status in (400, 401, 403, 409, 413, 429, 500, 502, 529)
    }
    assert kinds == {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        409: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        502: "api_error",
        529: "overloaded_error",
    }
    assert is_messages_path("/sessions/x/v1/messages") and is_messages_path("/sessions/x/v1/messages/count_tokens")
    assert not is_messages_path("/sessions/x/v1/chat/completions")
