"""Parsing engine answers at the edge: shapes, types and lengths are checked before the core sees them."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from fsm_rollout.engine.schema import (
    coerce_flat_int_token_ids,
    decode_routed_experts,
    error_message,
    parse_finish_reason,
    parse_generate_response,
    parse_render_response,
    sampling_mask_to_top_p,
)
from fsm_rollout.errors import GenerationError, MalformedRenderError, MalformedTokensError, RenderError


def test_token_ids_are_flattened_from_nested_lists_tuples_and_arrays() -> None:
    assert coerce_flat_int_token_ids([[1, 2], (3,), np.array([4, 5])]) == [1, 2, 3, 4, 5]


def test_none_token_ids_coerce_to_empty() -> None:
    assert coerce_flat_int_token_ids(None) == []


def test_scalar_token_id_coerces_to_a_list() -> None:
    assert coerce_flat_int_token_ids(7) == [7]


def test_string_token_ids_are_a_type_error() -> None:
    with pytest.raises(MalformedRenderError) as caught:
        coerce_flat_int_token_ids("1 2")
    assert isinstance(caught.value, TypeError)


def test_flat_render_answer_is_kept_without_request_id_and_with_model_filled() -> None:
    rendered = parse_render_response({"request_id": "r", "token_ids": [1, 2], "features": None}, "m")
    assert rendered.token_ids == [1, 2]
    assert rendered.generate_body == {"token_ids": [1, 2], "features": None, "model": "m"}


def test_render_answer_keeps_its_own_model_name() -> None:
    assert parse_render_response({"token_ids": [1], "model": "served"}, "m").generate_body["model"] == "served"


def test_legacy_render_answer_dumps_multi_modal_data_into_features() -> None:
    rendered = parse_render_response([[], [{"prompt_token_ids": [5], "multi_modal_data": {"image": [1]}}]], "m")
    assert rendered.generate_body["features"] == json.dumps({"image": [1]})


def test_legacy_render_answer_accepts_token_ids_alias_and_keeps_cache_salt() -> None:
    rendered = parse_render_response([[], [{"token_ids": [5, 6], "cache_salt": "s"}]], "m")
    assert rendered.token_ids == [5, 6]
    assert rendered.generate_body["cache_salt"] == "s"


@pytest.mark.parametrize("data", [[[], []], {"prompt": "x"}, "text", None, [[], [{}]]])
def test_bad_render_shapes_are_render_errors(data: object) -> None:
    with pytest.raises(RenderError):
        parse_render_response(data, "m")


def test_empty_render_token_ids_are_an_error() -> None:
    with pytest.raises(RenderError, match="empty token_ids"):
        parse_render_response({"token_ids": []}, "m")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "abort"),
        ("cancelled", "abort"),
        ({"type": "length"}, "length"),
    ],
)
def test_finish_reasons_map_to_three_outcomes(value: object, expected: str) -> None:
    assert parse_finish_reason(value) == expected


@pytest.mark.parametrize("value", ["error", None, "eos", {"type": None}])
def test_unknown_finish_reasons_are_errors(value: object) -> None:
    with pytest.raises(GenerationError, match="Unsupported vLLM finish_reason"):
        parse_finish_reason(value)


def answer(**choice: object) -> dict[str, object]:
    return {"choices": [{"finish_reason": "stop", **choice}]}


def test_both_logprob_entry_shapes_are_accepted() -> None:
    content = [{"token_id": 5, "logprob": -0.5}, {"token": "token_id:6", "logprob": -1}]
    turn = parse_generate_response(answer(token_ids=[5, 6], logprobs={"content": content}), "r")
    assert turn.logprobs == [-0.5, -1.0]
    assert isinstance(turn.logprobs[1], float)


def test_logprob_entry_for_another_token_is_an_error() -> None:
    with pytest.raises(GenerationError, match="is for token 9"):
        parse_generate_response(
            answer(token_ids=[5], logprobs={"content": [{"token": "token_id:9", "logprob": 0}]}), "r"
        )


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"token_id": 9, "logprob": -0.5}, "is for token 9"),  # the common shape, wrong token
        ({"token_id": 5, "logprob": True}, "must be numeric"),
        ({"token_id": 5, "logprob": "-0.5"}, "must be numeric"),
        ({"token_id": 5}, "must be numeric"),
        ([5, -0.5], "must be numeric"),
    ],
)
def test_every_logprob_entry_is_checked(entry: object, problem: str) -> None:
    content = [{"token_id": 4, "logprob": -0.1}, entry]
    with pytest.raises((GenerationError, MalformedTokensError), match=problem):
        parse_generate_response(answer(token_ids=[4, 5], logprobs={"content": content}), "r")


@pytest.mark.parametrize("token_ids", [[1, -2], [1, 2.0], [1, True], "12", None])
def test_token_ids_must_be_a_list_of_non_negative_ints(token_ids: object) -> None:
    with pytest.raises(MalformedTokensError, match="non-negative integer"):
        parse_generate_response(answer(token_ids=token_ids, logprobs={"content": []}), "r")


def test_an_empty_turn_is_valid() -> None:
    turn = parse_generate_response(answer(token_ids=[], logprobs={"content": []}), "r")
    assert (turn.token_ids, turn.logprobs) == ([], [])


def test_boolean_token_ids_are_rejected() -> None:
    with pytest.raises(MalformedTokensError):
        parse_generate_response(answer(token_ids=[True], logprobs={"content": [{"logprob": 0}]}), "r")


def test_aborted_turn_keeps_the_partial_tokens_and_logprobs_the_server_sent() -> None:
    turn = parse_generate_response(
        {
            "choices": [
                {
                    "finish_reason": "abort",
                    "token_ids": [1, 2],
                    "logprobs": {"content": [{"token_id": 1, "logprob": -0.5}, {"token_id": 2, "logprob": -1.0}]},
                    "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                }
            ]
        },
        "r",
    )
    assert (turn.finish, turn.token_ids, turn.logprobs) == ("abort", [1, 2], [-0.5, -1.0])
    assert turn.meta.weight_version_spans == (("3", 0, 2),)


def test_aborted_turn_keeps_no_tokens_when_its_logprobs_do_not_parse() -> None:
    turn = parse_generate_response(
        {"choices": [{"finish_reason": "abort", "token_ids": [1, 2], "logprobs": None}]}, "r"
    )
    assert (turn.finish, turn.token_ids, turn.logprobs) == ("abort", [], [])


def test_turn_meta_collects_usage_weight_version_and_speculative_stats() -> None:
    output = answer(token_ids=[1], logprobs={"content": [{"logprob": 0}]})
    output.update(
        weight_version=7,
        usage={"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}},
        metrics={"speculative_decoding": {"num_accepted_tokens": 3, "num_draft_tokens": 5, "num_drafts": 2}},
    )
    meta = parse_generate_response(output, "r").meta
    assert (meta.weight_version, meta.prompt_tokens, meta.completion_tokens, meta.cached_tokens) == ("7", 10, 1, 4)
    assert (meta.spec_accept_token_num, meta.spec_draft_token_num, meta.spec_verify_ct) == (3, 5, 2)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return base64.b64encode(buffer.getvalue()).decode()


def test_routed_experts_decode_from_base64_npy() -> None:
    array = np.arange(12, dtype=np.uint16).reshape(3, 2, 2)
    assert np.array_equal(decode_routed_experts(npy_b64(array)), array)


def test_routed_experts_never_unpickle() -> None:
    with pytest.raises(GenerationError):
        decode_routed_experts(npy_b64(np.array([{"a": 1}], dtype=object)))


def test_sampling_mask_becomes_csr_top_p_spans() -> None:
    assert sampling_mask_to_top_p([[65, 66], [], [7]]) == ([65, 66, 7], [0, 2, 2, 3])


def test_sampling_mask_length_must_match_generated_tokens() -> None:
    with pytest.raises(GenerationError, match="sampling_mask"):
        parse_generate_response(answer(token_ids=[1], logprobs={"content": [{"logprob": 0}]}, sampling_mask=[]), "r")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": {"message": "bad model", "code": 404}}, "bad model"),
        ({"object": "error", "message": "too long"}, "too long"),
        ({"detail": "Not Found"}, "Not Found"),
    ],
)
def test_error_bodies_yield_the_servers_message(body: object, message: str) -> None:
    assert error_message(body) == message


def test_weight_version_falls_back_to_the_last_weight_versions_span() -> None:
    output = answer(
        token_ids=[1],
        logprobs={"content": [{"logprob": 0}]},
        weight_versions=[{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 5}],
    )
    assert parse_generate_response(output, "r").meta.weight_version == "v2"


def test_top_level_weight_version_wins_over_spans() -> None:
    output = answer(token_ids=[1], logprobs={"content": [{"logprob": 0}]}, weight_versions=[{"version": "v2"}])
    output["weight_version"] = "7"
    assert parse_generate_response(output, "r").meta.weight_version == "7"
