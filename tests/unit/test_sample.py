"""Specification of ``fsm_rollout.sample``: the vime-compatible ``Sample``, its appends, its serialisation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from fsm_rollout.errors import InvariantViolation, RoutingReplayError, SampleAppendError
from fsm_rollout.sample import PrefixCacheInfo, Sample, SpecInfo, Status
from fsm_rollout.types import Finish, TurnMeta

PROMPT = [11, 12, 13]
EXPERT_DIMS = (2, 3)  # (num_layers, topk)


def rendered_sample(**overrides: Any) -> Sample:
    """A sample as it stands after render: prompt tokens, empty response arrays."""
    values: dict[str, Any] = {
        "index": 7,
        "session_id": "s-7",
        "tokens": list(PROMPT),
        "loss_mask": [],
        "rollout_log_probs": [],
    }
    values.update(overrides)
    return Sample(**values)


def meta(finish: Finish = "stop", **fields: Any) -> TurnMeta:
    return TurnMeta(finish_reason=finish, **fields)


def routing(rows: int, dtype: Any = np.int64) -> np.ndarray:
    num_layers, topk = EXPERT_DIMS
    return np.arange(rows * num_layers * topk, dtype=dtype)


def assert_values_equal(left: Any, right: Any, where: str) -> None:
    assert type(left) is type(right), f"{where}: {type(left).__name__} != {type(right).__name__}"
    if isinstance(left, np.ndarray):
        assert left.dtype == right.dtype, f"{where}: dtype {left.dtype} != {right.dtype}"
        assert left.shape == right.shape, f"{where}: shape {left.shape} != {right.shape}"
        assert np.array_equal(left, right), f"{where}: array values differ"
    elif isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype, f"{where}: dtype {left.dtype} != {right.dtype}"
        assert left.shape == right.shape, f"{where}: shape {left.shape} != {right.shape}"
        assert torch.equal(left, right), f"{where}: tensor values differ"
    elif isinstance(left, dict):
        assert left.keys() == right.keys(), f"{where}: keys {left.keys()} != {right.keys()}"
        for key in left:
            assert_values_equal(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, list):
        assert len(left) == len(right), f"{where}: length {len(left)} != {len(right)}"
        for position, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_values_equal(a, b, f"{where}[{position}]")
    else:
        assert left == right, f"{where}: {left!r} != {right!r}"


def assert_samples_equal(left: Sample, right: Sample) -> None:
    """Field-by-field equality, arrays and tensors included, plus any extra attributes."""
    assert vars(left).keys() == vars(right).keys()
    for name in vars(left):
        assert_values_equal(getattr(left, name), getattr(right, name), name)


def json_round_trip(sample: Sample) -> Sample:
    return Sample.from_dict(json.loads(json.dumps(sample.to_dict())))


# --- Status and statistics ---------------------------------------------------------------------------------


def test_status_values_are_vimes() -> None:
    assert [status.value for status in Status] == ["pending", "completed", "truncated", "aborted", "failed"]


def test_status_is_built_from_its_value_and_serialises_as_that_string() -> None:
    assert Status("completed") is Status.COMPLETED
    assert json.dumps({"status": Status.TRUNCATED}) == '{"status": "truncated"}'


def test_sample_status_is_the_module_status_as_in_vime() -> None:
    assert Sample.Status is Status
    assert Sample.Status.ABORTED is Status.ABORTED


def test_prefix_cache_hit_rate_is_zero_without_prompt_tokens() -> None:
    assert PrefixCacheInfo().hit_rate == 0.0


def test_prefix_cache_info_adds_requests_and_reports_hit_rate() -> None:
    info = PrefixCacheInfo()
    info.add(30, 100)
    info.add(70, 100)
    assert (info.cached_tokens, info.total_prompt_tokens, info.hit_rate) == (100, 200, 0.5)


def test_spec_info_rates_are_zero_without_counts() -> None:
    info = SpecInfo()
    assert (info.accept_rate, info.accept_length) == (0.0, 0.0)


def test_spec_info_adds_counts_and_reports_accept_rate_and_length() -> None:
    info = SpecInfo()
    info.add(accept_tokens=3, draft_tokens=4, verify_count=2, completion_tokens=5)
    info.add(accept_tokens=3, draft_tokens=8, verify_count=2, completion_tokens=5)
    assert dataclasses.asdict(info) == {
        "spec_accept_token_num": 6,
        "spec_draft_token_num": 12,
        "spec_verify_ct": 4,
        "completion_token_num": 10,
    }
    assert info.accept_rate == 0.5
    assert info.accept_length == 2.5


# --- Fields and defaults -----------------------------------------------------------------------------------


def test_fields_and_defaults_match_vime_sample() -> None:
    sample = Sample()
    expected: dict[str, Any] = {
        "group_index": None,
        "index": None,
        "rollout_id": None,
        "prompt": "",
        "tokens": [],
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {},
        "response": "",
        "response_length": 0,
        "label": None,
        "reward": None,
        "loss_mask": None,
        "weight_versions": [],
        "rollout_log_probs": None,
        "rollout_topk_token_ids": None,
        "rollout_topk_log_probs": None,
        "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        "rollout_top_p_log_probs": None,
        "rollout_routed_experts": None,
        "remove_sample": False,
        "teacher_log_probs": None,
        "status": Status.PENDING,
        "metadata": {},
        "generate_function_path": None,
        "custom_rm_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": SpecInfo(),
        "prefix_cache_info": PrefixCacheInfo(),
    }
    # vime's fields in vime's order, then this library's one addition: a rollout's earlier training sequences
    expected["branches"] = []
    assert [f.name for f in dataclasses.fields(Sample)] == list(expected)
    assert {f.name: getattr(sample, f.name) for f in dataclasses.fields(Sample)} == expected


def test_mutable_defaults_are_not_shared_between_samples() -> None:
    first, second = Sample(), Sample()
    first.tokens.append(1)
    first.metadata["k"] = "v"
    first.weight_versions.append("1")
    first.spec_info.add(1, 1, 1, 1)
    first.prefix_cache_info.add(1, 1)
    assert (second.tokens, second.metadata, second.weight_versions) == ([], {}, [])
    assert (second.spec_info, second.prefix_cache_info) == (SpecInfo(), PrefixCacheInfo())


# --- Appending tokens --------------------------------------------------------------------------------------


def test_trainable_tokens_get_loss_mask_one_and_their_logprobs() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21, 22], [-0.5, -1.5])
    assert sample.loss_mask == [1, 1]
    assert sample.rollout_log_probs == [-0.5, -1.5]


def test_non_trainable_tokens_get_loss_mask_zero_and_logprob_zero() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([31, 32], trainable=False)
    assert sample.loss_mask == [0, 0]
    assert sample.rollout_log_probs == [0.0, 0.0]


def test_appended_tokens_extend_the_context_and_count_as_response() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21, 22], [-0.5, -1.5])
    sample.append_response_tokens([31], trainable=False)
    assert sample.tokens == [*PROMPT, 21, 22, 31]
    assert sample.response_length == 3
    assert sample.loss_mask == [1, 1, 0]
    assert sample.rollout_log_probs == [-0.5, -1.5, 0.0]


def test_append_leaves_response_text_alone() -> None:
    sample = rendered_sample(response="kept")
    sample.append_response_tokens([21], [-0.1])
    assert sample.response == "kept"


def test_token_and_logprob_count_mismatch_raises() -> None:
    with pytest.raises(SampleAppendError, match="got 2 tokens and 1 log_probs"):
        rendered_sample().append_response_tokens([21, 22], [-0.5])


def test_trainable_tokens_without_logprobs_raise() -> None:
    with pytest.raises(SampleAppendError, match="trainable tokens need log_probs"):
        rendered_sample().append_response_tokens([21, 22])


def test_non_trainable_tokens_with_logprobs_raise() -> None:
    with pytest.raises(SampleAppendError, match="non-trainable tokens take no log_probs"):
        rendered_sample().append_response_tokens([31], [-0.1], trainable=False)


def test_error_messages_name_the_sample() -> None:
    with pytest.raises(SampleAppendError, match="index=7 session_id=s-7"):
        rendered_sample().append_response_tokens([21, 22])


def test_missing_loss_mask_is_backfilled_with_ones_for_earlier_response_tokens() -> None:
    sample = rendered_sample(
        tokens=[*PROMPT, 21, 22], response_length=2, loss_mask=None, rollout_log_probs=[-0.1, -0.2]
    )
    sample.append_response_tokens([31], trainable=False)
    assert sample.loss_mask == [1, 1, 0]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0]


def test_missing_logprobs_are_backfilled_with_zeros_before_non_trainable_tokens() -> None:
    sample = rendered_sample(tokens=[*PROMPT, 21, 22], response_length=2, loss_mask=[1, 1], rollout_log_probs=None)
    sample.append_response_tokens([31], trainable=False)
    assert sample.rollout_log_probs == [0.0, 0.0, 0.0]


def test_missing_arrays_on_a_fresh_sample_start_empty() -> None:
    sample = Sample(tokens=list(PROMPT))
    sample.append_response_tokens([21], [-0.1])
    assert (sample.loss_mask, sample.rollout_log_probs) == ([1], [-0.1])


def test_trainable_tokens_after_response_tokens_without_logprobs_raise() -> None:
    sample = rendered_sample(tokens=[*PROMPT, 21], response_length=1, loss_mask=[1], rollout_log_probs=None)
    with pytest.raises(SampleAppendError, match="no rollout_log_probs"):
        sample.append_response_tokens([22], [-0.2])


def test_torch_tensors_are_accepted_for_tokens_and_logprobs() -> None:
    sample = rendered_sample()
    sample.append_response_tokens(torch.tensor([21, 22]), torch.tensor([-0.5, -0.25]))
    assert sample.tokens[-2:] == [21, 22]
    assert sample.rollout_log_probs == [-0.5, -0.25]
    assert all(type(token) is int for token in sample.tokens)
    assert all(type(log_prob) is float for log_prob in sample.rollout_log_probs)


@pytest.mark.parametrize(
    ("tokens", "log_probs"),
    [
        (np.array([21, 22], dtype=np.int32), np.array([-0.5, -0.25], dtype=np.float32)),
        ((21, 22), (-0.5, -0.25)),
        ([np.int64(21), np.int64(22)], [np.float32(-0.5), np.float32(-0.25)]),
    ],
    ids=["numpy-arrays", "tuples", "lists-of-numpy-scalars"],
)
def test_arrays_tuples_and_numpy_scalars_become_python_ints_and_floats(tokens: Any, log_probs: Any) -> None:
    sample = rendered_sample()
    sample.append_response_tokens(tokens, log_probs)
    assert sample.tokens[-2:] == [21, 22]
    assert sample.rollout_log_probs == [-0.5, -0.25]
    assert all(type(token) is int for token in sample.tokens)
    assert all(type(log_prob) is float for log_prob in sample.rollout_log_probs)


@pytest.mark.parametrize(
    "tokens",
    [[21.0], [True], "ab", [[21, 22]], np.array([[21, 22]]), 21, torch.tensor(21)],
    ids=["floats", "bools", "string", "nested-list", "2d-array", "scalar", "0d-tensor"],
)
def test_tokens_that_are_not_a_flat_sequence_of_integers_raise(tokens: Any) -> None:
    with pytest.raises(SampleAppendError, match="expected tokens"):
        rendered_sample().append_response_tokens(tokens, [-0.1])


def test_non_numeric_logprobs_raise() -> None:
    text_log_probs: Any = ["-0.1"]
    with pytest.raises(SampleAppendError, match="expected log_probs to hold numbers"):
        rendered_sample().append_response_tokens([21], text_log_probs)


def test_empty_append_changes_no_lengths() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([], [])
    assert (sample.tokens, sample.response_length, sample.loss_mask) == (PROMPT, 0, [])


def test_failed_append_leaves_the_sample_unchanged() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21], top_p_token_offsets=[0, 1]))
    before = sample.to_dict()
    bad = meta(
        "length",
        weight_version="9",
        prompt_tokens=4,
        spec_accept_token_num=1,
        top_p_token_ids=[22],
        top_p_token_offsets=[0, 1],
        routed_experts=routing(rows=99),
    )
    with pytest.raises(RoutingReplayError):
        sample.append_response_tokens([22], [-0.2], meta=bad, expert_dims=EXPERT_DIMS, track_spec_stats=True)
    assert sample.to_dict() == before


def test_append_onto_misaligned_arrays_raises_invariant_violation() -> None:
    sample = rendered_sample(tokens=[*PROMPT, 21], response_length=1, loss_mask=[1, 1], rollout_log_probs=[0.0])
    with pytest.raises(InvariantViolation, match="loss_mask"):
        sample.append_response_tokens([31], trainable=False)


# --- Terminal information from the turn's meta --------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "status"),
    [("stop", Status.COMPLETED), ("length", Status.TRUNCATED), ("abort", Status.ABORTED)],
)
def test_finish_reason_sets_the_status(finish: Finish, status: Status) -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(finish))
    assert sample.status is status


def test_update_terminal_info_false_leaves_status_and_statistics_alone() -> None:
    sample = rendered_sample()
    turn = meta("stop", weight_version="7", prompt_tokens=3, cached_tokens=1, spec_accept_token_num=1)
    sample.append_response_tokens([21], [-0.1], meta=turn, track_spec_stats=True, update_terminal_info=False)
    assert sample.status is Status.PENDING
    assert sample.weight_versions == []
    assert (sample.prefix_cache_info, sample.spec_info) == (PrefixCacheInfo(), SpecInfo())


def test_append_without_meta_leaves_the_status_alone() -> None:
    sample = rendered_sample(status=Status.TRUNCATED)
    sample.append_response_tokens([31], trainable=False)
    assert sample.status is Status.TRUNCATED


def test_weight_version_is_recorded_per_turn() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(weight_version="7"))
    sample.append_response_tokens([22], [-0.2], meta=meta(weight_version="8"))
    assert sample.weight_versions == ["7", "8"]


def test_weight_version_is_not_recorded_for_a_turn_without_tokens() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([], [], meta=meta("abort", weight_version="7"))
    assert sample.weight_versions == []


def test_prefix_cache_statistics_add_up_over_turns() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(prompt_tokens=3, cached_tokens=0))
    sample.append_response_tokens([22], [-0.2], meta=meta(prompt_tokens=5, cached_tokens=4))
    assert sample.prefix_cache_info == PrefixCacheInfo(cached_tokens=4, total_prompt_tokens=8)


def test_missing_cached_tokens_count_as_zero() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(prompt_tokens=3))
    assert sample.prefix_cache_info == PrefixCacheInfo(cached_tokens=0, total_prompt_tokens=3)


def test_prefix_cache_is_not_counted_without_prompt_tokens() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(cached_tokens=2))
    assert sample.prefix_cache_info == PrefixCacheInfo()


def test_spec_statistics_are_ignored_unless_tracked() -> None:
    sample = rendered_sample()
    turn = meta(spec_accept_token_num=2, spec_draft_token_num=4, spec_verify_ct=1, completion_tokens=3)
    sample.append_response_tokens([21], [-0.1], meta=turn)
    assert sample.spec_info == SpecInfo()


def test_tracked_spec_statistics_add_up_over_turns() -> None:
    sample = rendered_sample()
    turn = meta(spec_accept_token_num=2, spec_draft_token_num=4, spec_verify_ct=1, completion_tokens=3)
    sample.append_response_tokens([21], [-0.1], meta=turn, track_spec_stats=True)
    sample.append_response_tokens([22], [-0.2], meta=turn, track_spec_stats=True)
    assert sample.spec_info == SpecInfo(
        spec_accept_token_num=4, spec_draft_token_num=8, spec_verify_ct=2, completion_token_num=6
    )


def test_tracked_spec_statistics_count_appended_tokens_when_completion_tokens_are_missing() -> None:
    sample = rendered_sample()
    turn = meta(spec_accept_token_num=1, spec_draft_token_num=2, spec_verify_ct=1)
    sample.append_response_tokens([21, 22], [-0.1, -0.2], meta=turn, track_spec_stats=True)
    assert sample.spec_info.completion_token_num == 2


def test_tracked_spec_statistics_skip_turns_without_spec_fields() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(completion_tokens=1), track_spec_stats=True)
    assert sample.spec_info == SpecInfo()


# --- Top-p replay spans ------------------------------------------------------------------------------------


def test_a_turns_top_p_spans_and_weight_version_are_kept() -> None:
    # vime's test_geo3k_turn_preserves_sampling_metadata: sampling_mask [[65, 66]] for token 65.
    sample = Sample(tokens=[1])
    turn = meta("stop", weight_version="7", top_p_token_ids=[65, 66], top_p_token_offsets=[0, 2])
    sample.append_response_tokens([65], [-0.1], meta=turn)
    assert sample.rollout_top_p_token_ids == [65, 66]
    assert sample.rollout_top_p_token_offsets == [0, 2]
    assert sample.weight_versions == ["7"]


def test_top_p_spans_merge_across_appends_with_shifted_offsets() -> None:
    sample = rendered_sample()
    first = meta(top_p_token_ids=[21, 5, 22], top_p_token_offsets=[0, 2, 3])
    second = meta(top_p_token_ids=[23, 24, 6], top_p_token_offsets=[0, 1, 3])
    sample.append_response_tokens([21, 22], [-0.1, -0.2], meta=first)
    sample.append_response_tokens([23, 24], [-0.3, -0.4], meta=second)
    assert sample.rollout_top_p_token_ids == [21, 5, 22, 23, 24, 6]
    assert sample.rollout_top_p_token_offsets == [0, 2, 3, 4, 6]


def test_non_trainable_tokens_get_empty_top_p_spans_mask_zero_and_logprob_zero() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21, 5], top_p_token_offsets=[0, 2]))
    sample.append_response_tokens([31, 32], trainable=False)
    assert sample.rollout_top_p_token_ids == [21, 5]
    assert sample.rollout_top_p_token_offsets == [0, 2, 2, 2]
    assert sample.loss_mask == [1, 0, 0]
    assert sample.rollout_log_probs == [-0.1, 0.0, 0.0]


def test_spans_after_empty_spans_shift_by_the_id_count() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21, 5], top_p_token_offsets=[0, 2]))
    sample.append_response_tokens([31], trainable=False)
    sample.append_response_tokens([22], [-0.2], meta=meta(top_p_token_ids=[22], top_p_token_offsets=[0, 1]))
    assert sample.rollout_top_p_token_ids == [21, 5, 22]
    assert sample.rollout_top_p_token_offsets == [0, 2, 2, 3]


def test_non_trainable_tokens_add_no_spans_when_the_sample_has_none() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([31], trainable=False)
    assert (sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets) == (None, None)


def test_first_spans_give_earlier_response_tokens_empty_spans() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([31, 32], trainable=False)
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21, 5], top_p_token_offsets=[0, 2]))
    assert sample.rollout_top_p_token_ids == [21, 5]
    assert sample.rollout_top_p_token_offsets == [0, 0, 0, 2]


def test_trainable_tokens_without_spans_after_spans_raise() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21], top_p_token_offsets=[0, 1]))
    with pytest.raises(SampleAppendError, match="need top_p_token_ids and top_p_token_offsets"):
        sample.append_response_tokens([22], [-0.2], meta=meta())


@pytest.mark.parametrize(
    ("ids", "offsets", "missing"),
    [([21], None, "top_p_token_offsets"), (None, [0, 1], "top_p_token_ids")],
)
def test_top_p_ids_and_offsets_come_together(ids: Any, offsets: Any, missing: str) -> None:
    turn = meta(top_p_token_ids=ids, top_p_token_offsets=offsets)
    with pytest.raises(SampleAppendError, match=f"got {missing}=None"):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn)


@pytest.mark.parametrize(
    ("ids", "offsets", "problem"),
    [
        ([21, 5], [1, 2], "start at 0"),
        ([21, 5], [0, 1], "last top-p offset"),
        ([21, 5], [0, 1, 2], "expected 2 top-p offsets for 1 tokens"),
    ],
    ids=["not-starting-at-zero", "not-ending-at-id-count", "wrong-length"],
)
def test_malformed_top_p_offsets_raise(ids: list[int], offsets: list[int], problem: str) -> None:
    turn = meta(top_p_token_ids=ids, top_p_token_offsets=offsets)
    with pytest.raises(SampleAppendError, match=problem):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn)


def test_decreasing_top_p_offsets_raise() -> None:
    turn = meta(top_p_token_ids=[21, 22], top_p_token_offsets=[0, 2, 1, 2])
    with pytest.raises(SampleAppendError, match="non-decreasing"):
        rendered_sample().append_response_tokens([21, 22, 23], [-0.1, -0.2, -0.3], meta=turn)


# --- Routed experts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.uint8])
def test_routed_experts_become_int32_rows_layers_topk_with_a_row_per_transition(dtype: Any) -> None:
    sample = rendered_sample()
    rows = len(PROMPT) + 2 - 1
    sample.append_response_tokens(
        [21, 22], [-0.1, -0.2], meta=meta(routed_experts=routing(rows, dtype)), expert_dims=EXPERT_DIMS
    )
    experts = sample.rollout_routed_experts
    assert experts is not None
    assert experts.dtype == np.int32
    assert experts.shape == (len(sample.tokens) - 1, *EXPERT_DIMS)
    assert experts.ravel().tolist() == routing(rows).tolist()


def test_routed_experts_are_replaced_on_each_append() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(routed_experts=routing(3)), expert_dims=EXPERT_DIMS)
    sample.append_response_tokens([31], trainable=False)
    sample.append_response_tokens([22], [-0.2], meta=meta(routed_experts=routing(5)), expert_dims=EXPERT_DIMS)
    experts = sample.rollout_routed_experts
    assert experts is not None
    assert experts.shape == (5, *EXPERT_DIMS)
    assert experts.ravel().tolist() == routing(5).tolist()


def test_routed_experts_with_the_wrong_element_count_raise() -> None:
    turn = meta(routed_experts=routing(rows=2))
    with pytest.raises(RoutingReplayError, match=r"element count 12 .* = 3 \* 2 \* 3 = 18"):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn, expert_dims=EXPERT_DIMS)


def test_routed_experts_are_ignored_without_expert_dims() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(routed_experts=routing(rows=99)))
    assert sample.rollout_routed_experts is None


def test_a_turn_without_routed_experts_keeps_the_previous_routing() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(routed_experts=routing(3)), expert_dims=EXPERT_DIMS)
    sample.append_response_tokens([], [], meta=meta("abort"), expert_dims=EXPERT_DIMS)
    assert sample.rollout_routed_experts is not None
    assert sample.rollout_routed_experts.shape == (3, *EXPERT_DIMS)


@pytest.mark.parametrize(
    "routed_experts",
    [routing(3).astype(np.float32), routing(3).tolist()],
    ids=["float-array", "list"],
)
def test_routed_experts_that_are_not_an_integer_array_raise(routed_experts: Any) -> None:
    turn = meta(routed_experts=routed_experts)
    with pytest.raises(RoutingReplayError, match="expected routed_experts as an integer array"):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn, expert_dims=EXPERT_DIMS)


@pytest.mark.parametrize("expert_dims", [(0, 3), (2, -1)])
def test_expert_dims_must_be_positive(expert_dims: tuple[int, int]) -> None:
    turn = meta(routed_experts=np.zeros(0, dtype=np.int64))
    with pytest.raises(RoutingReplayError, match="positive"):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn, expert_dims=expert_dims)


def test_routed_experts_outside_int32_raise() -> None:
    turn = meta(routed_experts=routing(3) + 2**31)
    with pytest.raises(RoutingReplayError, match="int32"):
        rendered_sample().append_response_tokens([21], [-0.1], meta=turn, expert_dims=EXPERT_DIMS)


# --- check_invariants --------------------------------------------------------------------------------------


def test_check_invariants_accepts_a_consistent_sample() -> None:
    sample = rendered_sample()
    sample.append_response_tokens([21], [-0.1], meta=meta(top_p_token_ids=[21], top_p_token_offsets=[0, 1]))
    sample.append_response_tokens([31], trainable=False)
    sample.check_invariants(prompt_length=len(PROMPT))


def test_check_invariants_accepts_missing_arrays_before_any_response() -> None:
    Sample(tokens=list(PROMPT)).check_invariants(prompt_length=len(PROMPT))


def test_check_invariants_rejects_missing_arrays_once_there_is_a_response() -> None:
    sample = rendered_sample(tokens=[*PROMPT, 21], response_length=1, loss_mask=[1], rollout_log_probs=None)
    with pytest.raises(InvariantViolation, match="rollout_log_probs=None"):
        sample.check_invariants()


def test_check_invariants_rejects_arrays_of_different_lengths() -> None:
    sample = rendered_sample(response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.1])
    with pytest.raises(InvariantViolation, match="got 2, 2, 1"):
        sample.check_invariants()


def test_check_invariants_rejects_loss_mask_values_other_than_zero_and_one() -> None:
    sample = rendered_sample(response_length=2, loss_mask=[1, 2], rollout_log_probs=[-0.1, -0.2])
    with pytest.raises(InvariantViolation, match="only 0 and 1; got 2"):
        sample.check_invariants()


def test_check_invariants_rejects_a_response_length_that_does_not_match_the_tokens() -> None:
    sample = rendered_sample(response_length=1, loss_mask=[1], rollout_log_probs=[-0.1])
    with pytest.raises(InvariantViolation, match="len\\(tokens\\) - prompt_length"):
        sample.check_invariants(prompt_length=len(PROMPT))


def test_check_invariants_rejects_top_p_offsets_that_do_not_cover_the_response() -> None:
    sample = rendered_sample(
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.1],
        rollout_top_p_token_ids=[21],
        rollout_top_p_token_offsets=[0, 1, 1],
    )
    with pytest.raises(InvariantViolation, match="expected 2 top-p offsets"):
        sample.check_invariants()


def test_check_invariants_names_the_sample() -> None:
    sample = rendered_sample(response_length=1, loss_mask=[], rollout_log_probs=[])
    with pytest.raises(InvariantViolation, match="index=7 session_id=s-7"):
        sample.check_invariants()


# --- Serialisation -----------------------------------------------------------------------------------------


def populated_sample() -> Sample:
    sample = Sample(
        group_index=1,
        index=2,
        rollout_id=3,
        prompt=[{"role": "user", "content": "hi"}],
        tokens=list(PROMPT),
        multimodal_inputs={"images": ["http://example.invalid/a.png"]},
        multimodal_train_inputs={
            "pixel_values": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "image_grid_thw": torch.tensor([[1, 2, 2]], dtype=torch.int64),
            "half": torch.tensor([0.5, 1.5], dtype=torch.bfloat16),
        },
        multimodal_train_input_id="mm-1",
        apply_chat_template_kwargs={"enable_thinking": False},
        response="answer",
        label="42",
        reward=1.0,
        loss_mask=[],
        rollout_log_probs=[],
        remove_sample=True,
        metadata={"tools": None, "scores": np.array([[1.5, 2.5]], dtype=np.float64)},
        generate_function_path="pkg.generate",
        custom_rm_path="pkg.rm",
        train_metadata={"step": 4},
        session_id="s-2",
        non_generation_time=0.25,
    )
    turn = meta(
        "length",
        weight_version="7",
        prompt_tokens=3,
        cached_tokens=1,
        spec_accept_token_num=1,
        spec_draft_token_num=2,
        spec_verify_ct=1,
        completion_tokens=2,
        routed_experts=routing(4),
        top_p_token_ids=[21, 5, 22],
        top_p_token_offsets=[0, 2, 3],
    )
    sample.append_response_tokens([21, 22], [-0.1, -0.2], meta=turn, expert_dims=EXPERT_DIMS, track_spec_stats=True)
    sample.append_response_tokens([31], trainable=False)
    return sample


def test_to_dict_dumps_as_json_with_both_json_and_orjson() -> None:
    data = populated_sample().to_dict()
    assert json.loads(json.dumps(data)) == data
    assert orjson.loads(orjson.dumps(data)) == data


def test_to_dict_writes_the_status_value_and_statistics_as_dicts() -> None:
    data = populated_sample().to_dict()
    assert data["status"] == "truncated"
    assert data["spec_info"] == {
        "spec_accept_token_num": 1,
        "spec_draft_token_num": 2,
        "spec_verify_ct": 1,
        "completion_token_num": 2,
    }
    assert data["prefix_cache_info"] == {"cached_tokens": 1, "total_prompt_tokens": 3}


def test_to_dict_writes_numpy_arrays_with_dtype_shape_and_flat_data() -> None:
    data = populated_sample().to_dict()
    assert data["rollout_routed_experts"] == {
        "__ndarray__": True,
        "dtype": "int32",
        "shape": [4, 2, 3],
        "data": list(range(24)),
    }


def test_to_dict_writes_tensors_with_dtype_shape_and_flat_data() -> None:
    data = populated_sample().to_dict()
    assert data["multimodal_train_inputs"]["pixel_values"] == {
        "__tensor__": True,
        "dtype": "float32",
        "shape": [2, 3],
        "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    }


def test_json_round_trip_restores_every_field() -> None:
    sample = populated_sample()
    restored = json_round_trip(sample)
    assert_samples_equal(restored, sample)
    assert restored.status is Status.TRUNCATED
    assert isinstance(restored.spec_info, SpecInfo)
    assert isinstance(restored.prefix_cache_info, PrefixCacheInfo)


def test_json_round_trip_of_a_default_sample_restores_it() -> None:
    assert_samples_equal(json_round_trip(Sample()), Sample())


def test_round_trip_keeps_attributes_set_beyond_the_fields() -> None:
    sample = populated_sample()
    sample.custom_score = 0.75  # type: ignore[attr-defined]
    sample.custom_array = np.array([1, 2], dtype=np.int16)  # type: ignore[attr-defined]
    restored = json_round_trip(sample)
    assert_samples_equal(restored, sample)


def test_from_dict_keeps_unknown_keys_as_attributes() -> None:
    restored = Sample.from_dict({"index": 4, "status": "completed", "old_vime_field": {"a": 1}})
    assert restored.index == 4
    assert restored.status is Status.COMPLETED
    assert restored.old_vime_field == {"a": 1}  # type: ignore[attr-defined]


def test_restored_sample_accepts_further_appends() -> None:
    restored = json_round_trip(populated_sample())
    restored.append_response_tokens([23], [-0.3], meta=meta(top_p_token_ids=[23], top_p_token_offsets=[0, 1]))
    restored.check_invariants(prompt_length=len(PROMPT))
    assert restored.rollout_top_p_token_offsets == [0, 2, 3, 3, 4]


def test_module_imports_and_serialises_without_torch() -> None:
    script = (
        "import json, sys\n"
        "import numpy as np\n"
        "from fsm_rollout.sample import Sample\n"
        "s = Sample(tokens=[1], rollout_routed_experts=np.zeros((1, 2, 3), dtype=np.int32))\n"
        "Sample.from_dict(json.loads(json.dumps(s.to_dict())))\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
