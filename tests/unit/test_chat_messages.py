"""Chat messages for engines (OpenAI's wire form, validated as vLLM validates it) and for templates (arguments
decoded as vLLM decodes them), and the render caches keyed on exactly what the template renders."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from fsm_rollout.engine.schema import RequestError, check_chat_message
from fsm_rollout.engine.serving import parse_render_request
from fsm_rollout.tokens import template_probe
from fsm_rollout.tokens.chat import DUMMY_PREFIXES, ObservationEncoder, template_token_ids
from fsm_rollout.tokens.chat_messages import template_messages, wire_messages, wire_tool_call
from fsm_rollout.tokens.template_probe import HistoryPolicyChooser

CASES = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "vllm_chat_messages.json").read_text())["cases"]
OBJECT_ARGUMENTS: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}],
}
# The same schema in langchain's key order and in litellm's / openai-agents'.
PARAMETERS = {"properties": {"expression": {"type": "string"}}, "required": ["expression"], "type": "object"}
LANGCHAIN_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "calc", "description": "Calc.", "parameters": PARAMETERS}}
]
LITELLM_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Calc.",
            "parameters": {"type": "object", "properties": PARAMETERS["properties"], "required": ["expression"]},
        },
    }
]


@pytest.mark.parametrize("case", CASES, ids=[str(index) for index in range(len(CASES))])
def test_render_accepts_exactly_the_messages_vllm_accepts(case: dict[str, Any]) -> None:
    if case["vllm_accepts"]:
        check_chat_message(case["message"], 1)
    else:
        with pytest.raises(RequestError) as raised:
            check_chat_message(case["message"], 1)
        assert raised.value.status == 400


def test_object_arguments_are_a_400_naming_the_field_as_vllm_does() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, OBJECT_ARGUMENTS]}
    with pytest.raises(RequestError) as raised:
        parse_render_request(body, "m")
    assert raised.value.status == 400
    message = raised.value.message
    assert "ChatCompletionMessageFunctionToolCallParam.function.arguments" in message
    assert "Input should be a valid string" in message and "messages.1." in message


def test_render_hands_the_template_decoded_arguments_and_the_wire_form_round_trips() -> None:
    wire = wire_messages([OBJECT_ARGUMENTS])
    assert wire[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert OBJECT_ARGUMENTS["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # copies, the input kept
    parsed = parse_render_request({"messages": [{"role": "user", "content": "hi"}, *wire]}, "m")
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    # key order survives the round trip, so the template writes the same JSON
    call = wire_tool_call("c", "f", {"b": 1, "a": [1.5, None, "é"]})
    decoded = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert list(decoded[0]["tool_calls"][0]["function"]["arguments"]) == ["b", "a"]
    assert decoded[0]["tool_calls"][0]["function"]["arguments"] == {"b": 1, "a": [1.5, None, "é"]}


@pytest.mark.parametrize(("arguments", "decoded"), [("", {}), (None, {}), ("{oops", {}), ("[1]", {}), ("{}", {})])
def test_arguments_vllm_cannot_decode_become_an_empty_object(arguments: Any, decoded: Any) -> None:
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [wire_tool_call("c", "f", "{}")]}
    message["tool_calls"][0]["function"]["arguments"] = arguments
    assert template_messages([message])[0]["tool_calls"][0]["function"]["arguments"] == decoded


def test_an_empty_tool_call_list_is_dropped_as_vllm_drops_it() -> None:
    assert template_messages([{"role": "assistant", "content": "x", "tool_calls": []}]) == [
        {"role": "assistant", "content": "x"}
    ]


def test_the_dummy_prefixes_are_messages_an_engine_accepts() -> None:
    for messages in DUMMY_PREFIXES.values():
        for index, message in enumerate(messages):
            check_chat_message(message, index)


def test_the_tool_dummy_prefix_renders_as_vllm_renders_it(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    dummy, prefix, _ = encoder.image_render_prefix([{"role": "tool", "content": "42"}], tools=LITELLM_TOOLS)
    # what the engine renders: the wire form, decoded by the render as vLLM decodes it
    served = parse_render_request({"messages": dummy, "tools": LITELLM_TOOLS, "add_generation_prompt": False}, "m")
    rendered = template_token_ids(
        tokenizer.apply_chat_template(served.messages, tools=LITELLM_TOOLS, tokenize=True), what="engine render"
    )
    assert rendered == prefix
    assert '"arguments": {}' in tokenizer.decode(prefix)  # an object, not the quoted string "{}"


# ------------------------------------------------------------------------------------------------ caches


def boundary_by_hand(tokenizer: Any, tools: Any, observation: list[dict[str, Any]]) -> list[int]:
    prefix = template_messages(DUMMY_PREFIXES["tool"])
    before = template_token_ids(tokenizer.apply_chat_template(prefix, tools=tools, tokenize=True), what="before")
    after = template_token_ids(
        tokenizer.apply_chat_template([*prefix, *observation], tools=tools, tokenize=True, add_generation_prompt=True),
        what="after",
    )
    eos = before.index(tokenizer.eos_token_id, len(before) - 3)
    assert after[: len(before)] == before
    return before[eos:] + after[len(before) :]


def test_tool_schemas_differing_only_in_key_order_get_their_own_boundaries(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer)
    observation = [{"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"}]
    for tools in (LANGCHAIN_TOOLS, LITELLM_TOOLS, LANGCHAIN_TOOLS):  # the same observation each time
        encoder.probe(tools=tools)
        boundary = encoder.encode(observation, ends_with_eos=False, tools=tools)
        assert boundary == boundary_by_hand(tokenizer, tools, observation)
        _, prefix, _ = encoder.image_render_prefix(observation, tools=tools)
        assert tokenizer.decode(prefix).count(json.dumps(tools[0]["function"]["parameters"])) == 1


def test_the_policy_chooser_probes_each_key_order(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[Any] = []
    real = template_probe.probe_template

    def counting(tokenizer: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
        probed.append(tools)
        return real(tokenizer, tools, *args, **kwargs)

    monkeypatch.setattr(template_probe, "probe_template", counting)
    chooser = HistoryPolicyChooser("auto")
    for tools in (LANGCHAIN_TOOLS, LITELLM_TOOLS, LANGCHAIN_TOOLS, LITELLM_TOOLS):
        chooser.resolve(tokenizer, tools)
    assert probed == [LANGCHAIN_TOOLS, LITELLM_TOOLS]
