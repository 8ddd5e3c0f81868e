"""The vLLM wire schema shared by the client, the embedded engine and the fake server.

Where the engine and the fake server used to check a field each their own way, the tests below pin the one rule
they now share (see the comment on each).
"""

from __future__ import annotations

import enum
from typing import Any, get_args

import orjson
import pytest

from fsm_rollout.engine.schema import (
    FINISH_REASONS,
    GENERATE_REQUEST_ID_PREFIX,
    PAUSE_MODES,
    PauseMode,
    RequestError,
    boolean_field,
    check_model,
    check_prompt_room,
    coerce_flat_int_token_ids,
    decode_json_object,
    error_body,
    error_message,
    generate_request_id,
    is_int,
    is_int_list,
    is_number,
    is_token_id_list,
    model_list,
    parse_generate_response,
    parse_model_list,
    request_sampling_params,
    request_token_ids,
    resolve_max_tokens,
    sent_request_id,
    server_request_id,
    server_request_ids,
    stop_token_ids,
    weight_version_spans,
)
from fsm_rollout.engine.serving import parse_render_request, pause_query, weight_version_of
from fsm_rollout.errors import MalformedRenderError, MalformedTokensError
from fsm_rollout.types import Finish


class _Color(enum.IntEnum):
    RED = 1


def _refused(call: Any, *args: Any, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as caught:
        call(*args, **kwargs)
    return caught.value


# -------------------------------------------------------------------- integers


@pytest.mark.parametrize("value", [0, 7, -3, 10**30])
def test_a_json_integer_is_an_int(value: int) -> None:
    assert is_int(value)
    assert is_number(value)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, _Color.RED])
def test_bools_floats_and_int_subclasses_are_not_ints(value: Any) -> None:
    # The client's render and usage checks used isinstance (an IntEnum passed), the servers and the client's token
    # list check used the exact type: the exact type is kept, since it is what JSON decodes an integer to.
    assert not is_int(value)


def test_a_number_is_an_int_or_a_float_but_not_a_bool() -> None:
    assert is_number(1.5) and is_number(-2)
    assert not is_number(True) and not is_number("1.5") and not is_number(None)


def test_the_list_checks_agree_with_the_scalar_one() -> None:
    for value in (0, 7, True, 1.0, _Color.RED, "1", None, [1]):
        assert is_int_list([value]) == is_int(value)
    assert is_int_list([]) and is_token_id_list([])
    assert is_int_list([-1]) and not is_token_id_list([-1])
    assert not is_int_list((1, 2)) and not is_int_list(None)


def test_render_token_ids_refuse_int_subclasses() -> None:
    with pytest.raises(MalformedRenderError):
        coerce_flat_int_token_ids([1, _Color.RED])
    with pytest.raises(MalformedRenderError):
        coerce_flat_int_token_ids([1, True])


# -------------------------------------------------------------------- finish reasons and request ids


def test_finish_reasons_are_the_finish_type() -> None:
    assert frozenset(get_args(Finish)) == FINISH_REASONS == {"stop", "length", "abort"}


def test_server_request_ids_round_trip() -> None:
    assert server_request_id("r-1") == GENERATE_REQUEST_ID_PREFIX + "r-1" == "generate-tokens-r-1"
    assert server_request_ids("r-1") == ("r-1", "generate-tokens-r-1")
    assert {sent_request_id(name) for name in server_request_ids("r-1")} == {"r-1"}


def test_an_answer_under_the_servers_id_parses_for_the_clients_id() -> None:
    answer = {
        "request_id": server_request_id("r-1"),
        "choices": [{"finish_reason": "abort", "weight_versions": weight_version_spans("v3", 0)}],
    }
    turn = parse_generate_response(answer, "r-1")
    assert (turn.request_id, turn.finish, turn.meta.weight_version) == ("r-1", "abort", None)


def _answer(content: Any, finish: str = "stop") -> dict[str, Any]:
    token_ids = [entry.get("token_id", 0) for entry in content]
    return {"choices": [{"finish_reason": finish, "token_ids": token_ids, "logprobs": {"content": content}}]}


def test_top_candidates_parse_only_when_asked_in_either_entry_shape() -> None:
    content = [
        {"token_id": 7, "logprob": -0.5, "rank": 1, "top_logprobs": [{"token_id": 7, "logprob": -0.5, "rank": 1}]},
        {"token_id": 9, "logprob": -1.0, "rank": 2, "top_logprobs": [{"token": "token_id:9", "logprob": -1}]},
    ]
    assert parse_generate_response(_answer(content), "r").top_logprobs is None
    turn = parse_generate_response(_answer(content), "r", top_logprobs=True)
    assert turn.top_logprobs == [[(7, -0.5)], [(9, -1.0)]]
    # an aborted answer keeps its tokens' candidates too
    assert parse_generate_response(_answer(content, "abort"), "r", top_logprobs=True).top_logprobs == [
        [(7, -0.5)],
        [(9, -1.0)],
    ]


@pytest.mark.parametrize(
    ("top", "words"),
    [
        (None, "top_logprobs must be a list"),
        ([{"logprob": -1.0}], "needs a token id"),
        ([{"token_id": -3, "logprob": -1.0}], "needs a token id"),
        ([{"token_id": 3, "logprob": "low"}], "numeric logprob"),
        ([{"token": "three", "logprob": -1.0}], "needs a token id"),
    ],
)
def test_malformed_top_candidates_are_refused_when_asked(top: Any, words: str) -> None:
    content = [{"token_id": 3, "logprob": -1.0, "rank": 1, "top_logprobs": top}]
    assert parse_generate_response(_answer(content), "r").token_ids == [3]  # not asked: not read
    with pytest.raises(MalformedTokensError, match=words):
        parse_generate_response(_answer(content), "r", top_logprobs=True)


def test_weight_version_spans_cover_the_output() -> None:
    assert weight_version_spans("default", 3) == [{"version": "default", "start": 0, "end": 3}]
    assert weight_version_spans("default", 0) == []


def test_pause_mode_defaults_to_abort_and_refuses_other_modes_naming_the_valid_ones() -> None:
    assert PAUSE_MODES == get_args(PauseMode) == ("abort", "wait", "keep")
    # One parser for every server now (the serving frame's): the engine and the fake parsed the mode each its own way
    assert pause_query({}) == "abort"  # vLLM's default
    assert [pause_query({"mode": mode}) for mode in PAUSE_MODES] == list(PAUSE_MODES)
    error = _refused(pause_query, {"mode": "Keep"})
    assert (error.status, error.param) == (400, "mode")
    assert error.message == "mode: Input should be one of 'abort', 'wait', 'keep', got 'Keep'"


def test_new_weight_version_is_a_string_and_anything_else_is_400() -> None:
    assert weight_version_of({"new_version": "step-3"}) == "step-3"
    for body in ({}, {"new_version": None}, {"new_version": 3}, {"new_version": ["v"]}):
        error = _refused(weight_version_of, body)
        assert (error.status, error.param) == (400, "new_version")


# -------------------------------------------------------------------- request validation


def test_a_json_object_body_decodes_and_anything_else_is_400() -> None:
    assert decode_json_object(orjson.dumps({"a": 1})) == {"a": 1}
    # The fake server said only "not valid JSON"; the engine's message, with the decoder's reason, is kept.
    for raw in (b"{not json", b""):
        error = _refused(decode_json_object, raw)
        assert error.status == 400 and error.message.startswith("The request body is not valid JSON: ")
    assert _refused(decode_json_object, b"[1]").message == "The request body must be a JSON object"


def test_another_model_is_404_with_vllms_message() -> None:
    check_model({}, "m")
    check_model({"model": None}, "m")
    check_model({"model": "m"}, "m")
    # vLLM 0.32 lists the valid aliases (tests/fixtures/vllm_responses/error_render_unknown_model.json); the fake
    # server used to leave them out.
    error = _refused(check_model, {"model": "other"}, "m")
    assert (error.status, error.param) == (404, "model")
    assert error.message == "The model `other` does not exist. Valid aliases: m."
    assert error_body(404, error.message, error.param) == {
        "error": {"message": error.message, "type": "NotFoundError", "param": "model", "code": 404}
    }


def test_token_ids_errors_name_the_first_bad_id() -> None:
    assert request_token_ids({"token_ids": [0, 5]}, vocab_size=6) == [0, 5]
    assert _refused(request_token_ids, {"token_ids": []}).message == "token_ids: List should have at least 1 item"
    # The fake server did not say which item was wrong; the engine's message, which does, is kept.
    error = _refused(request_token_ids, {"token_ids": [1, "2", -3]})
    assert error.message == "token_ids: every item must be a non-negative integer, got '2'"
    assert error.param == "token_ids"
    assert "got True" in _refused(request_token_ids, {"token_ids": [True]}).message
    # Out of vocabulary and not an integer are checked id by id, so the first one in the list is named.
    first_out_of_vocabulary = _refused(request_token_ids, {"token_ids": [9, "x"]}, vocab_size=6)
    assert first_out_of_vocabulary.message == "Token id 9 is out of vocabulary (vocab size 6)"
    assert "got 'x'" in _refused(request_token_ids, {"token_ids": ["x", 9]}, vocab_size=6).message
    assert request_token_ids({"token_ids": [10**9]}) == [10**9]  # no vocabulary given: no limit


def test_an_empty_request_id_is_refused() -> None:
    # The engine refused "" and the fake server accepted it; refused now: the client never sends one, so an empty
    # id is a client bug, and abort could not tell such requests apart.
    assert generate_request_id({}, "fresh") == "fresh"
    assert generate_request_id({"request_id": None}, "fresh") == "fresh"
    assert generate_request_id({"request_id": "r-1"}, "fresh") == "r-1"
    for bad in ("", 5):
        error = _refused(generate_request_id, {"request_id": bad}, "fresh")
        assert (error.message, error.param) == ("request_id: Input should be a non-empty string", "request_id")


def test_sampling_params_must_be_an_object() -> None:
    assert request_sampling_params({"sampling_params": {}}) == {}
    for body in ({}, {"sampling_params": []}):
        error = _refused(request_sampling_params, body)
        assert (error.message, error.param) == ("sampling_params: Field required (a JSON object)", "sampling_params")


def test_a_prompt_filling_the_context_names_token_ids() -> None:
    check_prompt_room(3, 4)
    # The fake server's message had no param; the engine's, naming token_ids, is kept.
    error = _refused(check_prompt_room, 4, 4)
    assert error.param == "token_ids"
    assert error.message.startswith("This model's maximum context length is 4 tokens. However, your request has 4")


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    assert resolve_max_tokens({}, prompt_len=3, max_model_len=10) == 7
    assert resolve_max_tokens({"max_tokens": None}, prompt_len=3, max_model_len=10) == 7
    assert resolve_max_tokens({"max_tokens": 7}, prompt_len=3, max_model_len=10) == 7
    assert "too large: 8" in _refused(resolve_max_tokens, {"max_tokens": 8}, prompt_len=3, max_model_len=10).message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "max_tokens must be at least 1, got 0."),
        (-1, "max_tokens must be at least 1, got -1."),
        # The fake server said "must be at least 1" for these too; a type error is named as one now, as the
        # engine did (same status and param).
        (True, "max_tokens: Input should be a valid integer, got True"),
        (2.0, "max_tokens: Input should be a valid integer, got 2.0"),
        ("4", "max_tokens: Input should be a valid integer, got '4'"),
    ],
)
def test_a_bad_max_tokens_is_400(value: Any, message: str) -> None:
    error = _refused(resolve_max_tokens, {"max_tokens": value}, prompt_len=3, max_model_len=10)
    assert (error.status, error.message, error.param) == (400, message, "max_tokens")


def test_a_null_boolean_means_the_default() -> None:
    # The fake server refused "ignore_eos": null while taking null as "unset" for max_tokens, stop and
    # stop_token_ids; the engine takes null as unset for every field, and so do both servers now.
    assert boolean_field({"ignore_eos": None}, "ignore_eos", False) is False
    assert boolean_field({}, "skip_special_tokens", True) is True
    assert boolean_field({"ignore_eos": True}, "ignore_eos", False) is True
    error = _refused(boolean_field, {"ignore_eos": 1}, "ignore_eos", False)
    assert (error.message, error.param) == ("ignore_eos: Input should be a valid boolean, got 1", "ignore_eos")


def test_stop_token_ids_are_a_list_of_integers() -> None:
    assert stop_token_ids(None) == frozenset()
    assert stop_token_ids([3, 3, 4]) == {3, 4}
    for bad in ([True], [1.0], "3", [[3]]):
        assert _refused(stop_token_ids, bad).param == "stop_token_ids"


def test_render_messages_errors_name_the_message() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert parse_render_request({"messages": messages}, "m").messages == messages
    assert _refused(parse_render_request, {"messages": []}, "m").param == "messages"
    # pydantic's words, as vLLM answers: the message's place, then what is wrong there
    error = _refused(parse_render_request, {"messages": [*messages, {"content": "no role"}]}, "m")
    assert (error.status, error.param) == (400, "messages")
    assert "messages.1." in error.message and ".role\n" in error.message and "Field required" in error.message


def test_a_model_list_parses_with_the_embedded_engines_extra_fields_and_without() -> None:
    from fsm_rollout.types import ServedModel

    ours = model_list("m", root="/models/m", max_model_len=512, tokenizer="/models/m", image_merge_size=2)
    vllm = model_list("m", root="/models/m", max_model_len=512)
    assert "tokenizer" not in vllm["data"][0] and "image_merge_size" not in vllm["data"][0]
    assert parse_model_list(ours) == [
        ServedModel(name="m", root="/models/m", max_model_len=512, tokenizer="/models/m", image_merge_size=2)
    ]
    assert parse_model_list(vllm) == [ServedModel(name="m", root="/models/m", max_model_len=512)]
    # Optional fields of the wrong type are dropped: they only fill in defaults the caller can give itself.
    assert parse_model_list({"data": [{"id": "m", "image_merge_size": True, "tokenizer": 3}]}) == [
        ServedModel(name="m")
    ]


@pytest.mark.parametrize("answer", [[], {"data": {}}, {"data": [{"id": ""}]}, {"data": [{"root": "x"}]}])
def test_a_model_list_of_the_wrong_shape_is_a_model_list_error(answer: Any) -> None:
    from fsm_rollout.errors import ModelListError

    with pytest.raises(ModelListError, match="GET /v1/models"):
        parse_model_list(answer)


def test_the_error_message_of_vllms_api_key_answer_is_its_string() -> None:
    assert error_message({"error": "Unauthorized"}) == "Unauthorized"
    assert error_message(error_body(400, "bad")) == "bad"
