"""The Responses dialect's conversion (request items to a chat call, answers to ``response`` objects and events),
checked against the ``openai`` SDK's own types, and the Codex header hints."""

from __future__ import annotations

import base64
import json
import pathlib
from typing import Any

import pydantic
import pytest
from multidict import CIMultiDict
from openai.types.responses import Response, ResponseStreamEvent

from fsm_rollout.gateway import GatewayError
from fsm_rollout.gateway.conversation import compare_history
from fsm_rollout.gateway.hints import header_hints
from fsm_rollout.gateway.openai_wire import TurnAnswer
from fsm_rollout.gateway.responses_events import sse_bytes, stream_events
from fsm_rollout.gateway.responses_wire import (
    ENCRYPTED_PREFIX,
    StoredResponses,
    parse_responses_request,
    response_object,
)

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
SHELL = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False}


def answer(
    content: str | None = "Done.",
    calls: list[dict[str, Any]] | None = None,
    *,
    reasoning: str | None = None,
    finish: str = "stop",
) -> TurnAnswer:
    return TurnAnswer(
        content=content,
        tool_calls=calls or [],
        finish_reason=finish,
        prompt_tokens=11,
        completion_tokens=7,
        token_ids=[1] * 7,
        logprobs=[0.0] * 7,
        text="",
        reasoning=reasoning,
    )


def test_codex_style_input_becomes_chat_messages() -> None:
    request = parse_responses_request(
        {
            "model": "gpt-5-codex",
            "instructions": "You are Codex.",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: ro"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
                {"type": "function_call", "name": "exec_command", "arguments": '{"cmd":"ls"}', "call_id": "c1"},
                {"type": "function_call", "name": "exec_command", "arguments": '{"cmd":"pwd"}', "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/w"}]},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [SHELL, {"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
            "text": {"verbosity": "low"},
        }
    )
    call = request.chat_call(hints={"session_key": "s"})
    calls = [{"id": "c1", "name": "exec_command", "arguments": {"cmd": "ls"}}]
    calls.append({"id": "c2", "name": "exec_command", "arguments": {"cmd": "pwd"}})
    assert call.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "Sandbox: ro"},  # a developer message: a role chat templates render
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "Listing.", "tool_calls": calls},  # one turn, the reasoning item dropped
        {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
        {"role": "tool", "content": "/w", "tool_call_id": "c2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert call.tools == [
        {"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}, "strict": False}}
    ]
    assert request.dropped_tools == [{"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}]
    assert call.stream and call.tool_choice == "auto" and call.hints == {"session_key": "s"}
    assert request.encrypted_reasoning and not request.store
    assert "parallel_tool_calls" not in request.chat_fields  # Codex's preference with "auto": accepted, not enforced


def test_an_echoed_reasoning_item_matches_the_held_answer() -> None:
    """The session holds the answer without its thinking; the client's echo (reasoning, message, call) matches it."""
    said = answer("Listing.", [{"id": "call_1", "name": "exec_command", "arguments": {"cmd": "ls"}}], reasoning="hm")
    first = parse_responses_request({"input": "List files", "tools": [SHELL]}).chat_call()
    held = [*first.messages, said.message()]
    items = response_object(said, parse_responses_request({"input": "x"}), response_id="resp_1", model="m")["output"]
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    output = {"type": "function_call_output", "call_id": items[2]["call_id"], "output": "a.txt"}
    again = parse_responses_request({"input": [{"role": "user", "content": "List files"}, *items, output]})
    found = compare_history(held, first.tools, again.chat_call().messages, first.tools, last_answered=True)
    assert found.kind == "extends" and found.new == [{"role": "tool", "content": "a.txt", "tool_call_id": "call_1"}]


def codex_tools() -> list[dict[str, Any]]:
    """The tools Codex 0.169.0 really sent (captured): functions, its ``multi_agent_v1`` namespace, web search."""
    fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "harness" / "codex-request-1.json"
    tools: list[dict[str, Any]] = json.loads(fixture.read_text(encoding="utf-8"))["body"]["tools"]
    return tools


def test_codex_namespace_tools_are_offered_flat_and_a_call_goes_back_namespaced() -> None:
    tools = codex_tools()
    [namespace] = [tool for tool in tools if tool["type"] == "namespace"]
    members = [member["name"] for member in namespace["tools"]]
    assert "spawn_agent" in members and namespace["name"] == "multi_agent_v1"
    request = parse_responses_request({"input": "Delegate.", "tools": tools})
    offered = [tool["function"]["name"] for tool in request.chat_call().tools or ()]
    in_place: list[str] = []  # each namespace's functions where the namespace stood
    for tool in tools:
        if tool["type"] == "function":
            in_place.append(tool["name"])
        elif tool["type"] == "namespace":
            in_place += [f"multi_agent_v1__{name}" for name in members]
    assert offered == in_place and len(offered) == len(tools) - 2 + len(members)
    spawn = next(
        t["function"] for t in request.chat_call().tools or () if t["function"]["name"].endswith("spawn_agent")
    )
    assert spawn["parameters"] == next(m for m in namespace["tools"] if m["name"] == "spawn_agent")["parameters"]
    assert request.dropped_tools == [{"type": "web_search"}]  # the namespace is no longer dropped
    # the model's call of the flat name comes back as OpenAI's API returns a namespaced call
    call = {"id": "call_5", "name": "multi_agent_v1__spawn_agent", "arguments": {"message": "Count the files."}}
    said = answer(None, [call])
    body = response_object(said, request, response_id="resp_n", model="m")
    [item] = Response.model_validate(body).output
    assert item.type == "function_call" and (item.name, item.namespace) == ("spawn_agent", "multi_agent_v1")
    events = [EVENTS.validate_python(event) for event in stream_events(body)]
    [done] = [event for event in events if event.type == "response.output_item.done"]
    assert done.item.type == "function_call" and done.item.namespace == "multi_agent_v1"
    # echoed back as Codex does (with its namespace), it is the call the session holds: no fork
    first = request.chat_call()
    held = [*first.messages, said.message()]
    output = {"type": "function_call_output", "call_id": "call_5", "output": "agent 7 started"}
    echo = {**body["output"][0], "status": "completed"}
    again = parse_responses_request({"input": [{"role": "user", "content": "Delegate."}, echo, output], "tools": tools})
    assert again.chat_call().messages[1]["tool_calls"][0]["name"] == "multi_agent_v1__spawn_agent"
    found = compare_history(held, first.tools, again.chat_call().messages, first.tools, last_answered=True)
    assert found.kind == "extends" and [message["role"] for message in found.new] == ["tool"]


def test_a_namespaced_function_can_be_forced_and_names_must_stay_unique() -> None:
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    crm = {"type": "namespace", "name": "crm", "description": "CRM tools.", "tools": [lookup]}
    for choice in (
        {"type": "function", "name": "lookup", "namespace": "crm"},
        {"type": "function", "name": "crm__lookup"},
        {"type": "function", "name": "lookup"},  # unambiguous: the one function of that name
    ):
        forced = parse_responses_request({"input": "x", "tools": [SHELL, crm], "tool_choice": choice})
        assert forced.chat_call().tool_name == "crm__lookup"
    clash = {"type": "function", "name": "crm__lookup", "parameters": {"type": "object"}}
    with pytest.raises(GatewayError) as twice:
        parse_responses_request({"input": "x", "tools": [clash, crm]})
    assert twice.value.code == "tools" and "crm__lookup" in twice.value.message
    freeform = {"type": "namespace", "name": "ed", "description": "", "tools": [{"type": "custom", "name": "patch"}]}
    assert parse_responses_request({"input": "x", "tools": [freeform]}).dropped_tools == [
        {"type": "custom", "name": "patch", "namespace": "ed"}
    ]


def test_the_response_object_and_its_events_are_the_sdks_types() -> None:
    request = parse_responses_request(
        {
            "input": "Hi",
            "tools": [SHELL],
            "include": ["reasoning.encrypted_content"],
            "metadata": {"run": "1"},
            "temperature": 0.5,
        }
    )
    call = {"id": "call_9", "name": "exec_command", "arguments": {"cmd": "ls"}}
    body = response_object(
        answer("Let me look.", [call], reasoning="Look first."), request, response_id="resp_x", model="m"
    )
    response = Response.model_validate(body)
    assert response.output_text == "Let me look."
    reasoning, message, function_call = response.output
    assert message.type == "message" and message.status == "completed"
    assert reasoning.type == "reasoning" and reasoning.encrypted_content is not None
    encoded = reasoning.encrypted_content.removeprefix(ENCRYPTED_PREFIX)
    assert base64.b64decode(encoded).decode() == "Look first."
    assert function_call.type == "function_call" and function_call.call_id == "call_9"
    assert json.loads(function_call.arguments) == {"cmd": "ls"}
    assert response.usage is not None and response.usage.total_tokens == 18
    assert response.metadata == {"run": "1"} and response.temperature == 0.5
    events = stream_events(body)
    parsed = [EVENTS.validate_python(event) for event in events]
    assert [event.sequence_number for event in parsed] == list(range(len(events)))
    assert parsed[-1].type == "response.completed"
    ids = {event.item_id for event in parsed if hasattr(event, "item_id")}
    assert ids == {item["id"] for item in body["output"]}
    wire = sse_bytes(events).decode()
    first, *_ = wire.split("\n\n")
    assert first.startswith("event: response.created\ndata: {")
    assert json.loads(first.split("data: ", 1)[1])["response"]["status"] == "in_progress"


def test_a_cut_answer_is_incomplete_and_streams_response_incomplete() -> None:
    body = response_object(
        answer("Half", finish="length"), parse_responses_request({"input": "x"}), response_id="r", model="m"
    )
    response = Response.model_validate(body)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert stream_events(body)[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": 3}, "input"),
        ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        (
            {
                "input": [
                    {"role": "assistant", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]}
                ]
            },
            "image",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "data:image",
        ),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]"),
        ({"input": "x", "tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "include": "reasoning.encrypted_content"}, "include"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(body: dict[str, Any], named: str) -> None:
    with pytest.raises(GatewayError) as error:
        parse_responses_request(body)
    assert error.value.status == 400 and named in error.value.message


def test_chat_checks_still_apply_and_name_the_field() -> None:
    request = parse_responses_request(
        {"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [SHELL]}
    )
    with pytest.raises(GatewayError) as error:
        request.chat_call()
    assert error.value.code == "tool_choice" and "nope" in error.value.message
    with pytest.raises(GatewayError) as empty:
        parse_responses_request({"input": []}).chat_call()
    assert empty.value.code == "input"


def test_text_format_and_forced_tools_become_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    call = parse_responses_request({"input": "x", "text": fmt}).chat_call()
    assert call.sampling["structured_outputs"]["json"] == schema
    forced = parse_responses_request(
        {"input": "x", "tools": [SHELL], "tool_choice": {"type": "function", "name": "exec_command"}}
    )
    assert forced.chat_call().tool_name == "exec_command" and forced.chat_call().tool_choice == "required"


def test_stored_responses_continue_without_the_old_instructions_and_are_bounded() -> None:
    store = StoredResponses(limit=2)
    first = parse_responses_request({"instructions": "Be brief.", "input": "Hi"})
    store.put("resp_1", first.conversation([], answer("Hello.")))
    follow = parse_responses_request({"instructions": "Be terse.", "input": "Bye", "previous_response_id": "resp_1"})
    call = follow.chat_call(store.conversation(follow.previous_response_id))
    assert [m["content"] for m in call.messages] == ["Be terse.", "Hi", "Hello.", "Bye"]
    store.put("resp_2", [])
    store.put("resp_3", [])
    with pytest.raises(GatewayError) as forgotten:
        store.conversation("resp_1")
    assert forgotten.value.status == 404 and forgotten.value.code == "previous_response_not_found"
    assert store.conversation(None) == []


def test_codex_headers_become_hints_leniently() -> None:
    metadata = {
        "session_id": "sess",
        "thread_id": "thread-2",
        "parent_thread_id": "thread-1",
        "agent_name": "reviewer",
        "window_id": "w-meta",
        "request_kind": "compact",
        "history_initialization": None,
    }
    headers = CIMultiDict({"X-Codex-Turn-Metadata": json.dumps(metadata), "X-Codex-Window-Id": "sess:2"})
    assert header_hints(headers) == {
        "session_key": "sess",
        "lineage_key": "thread-2",
        "parent_lineage_key": "thread-1",
        "agent": "reviewer",
        "request_kind": "compact",
        "window": "sess:2",
    }
    # odd values are left out, never an error; x-session-id is the operator's key and wins
    odd = CIMultiDict({"x-codex-turn-metadata": '{"session_id": 7, "thread_id": "", "agent_name": [1]}'})
    assert header_hints(odd) == {"session_key": "7"}
    assert header_hints(CIMultiDict({"x-codex-turn-metadata": "not json", "x-session-id": "mine"})) == {
        "session_key": "mine"
    }
    both = CIMultiDict(
        {"x-codex-turn-metadata": '{"session_id": "codex", "context_window_id": 3}', "x-session-id": "op"}
    )
    assert header_hints(both) == {"session_key": "op", "window": "3"}
    assert header_hints(CIMultiDict({"x-codex-turn-metadata": "[1, 2]"})) == {}
