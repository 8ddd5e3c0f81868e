"""The vime stand-in against behaviours vime's own tests pin down: ``Sample`` appends, sampling params, render
and generate bodies, image encoding and ``post`` retries.

The differential test trusts the stand-in as an oracle; these checks keep it honest.
"""

from __future__ import annotations

import base64
import importlib
import io
from types import ModuleType, SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from PIL import Image

from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn


@pytest.fixture
def types_module(vime_standin: ModuleType) -> ModuleType:
    return importlib.import_module("vime.utils.types")


@pytest.fixture
def http_utils(vime_standin: ModuleType) -> ModuleType:
    return importlib.import_module("vime.utils.http_utils")


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------- Sample


def test_top_p_spans_merge_across_appends_with_shifted_offsets(types_module: ModuleType) -> None:
    sample = types_module.Sample(tokens=[1])
    sample.append_response_tokens(
        tokens=[5, 6],
        log_probs=[-0.1, -0.2],
        meta_info={"top_p_token_ids": [5, 7, 6], "top_p_token_offsets": [0, 2, 3]},
    )
    sample.append_response_tokens(
        tokens=[8], log_probs=[-0.3], meta_info={"top_p_token_ids": [8, 9], "top_p_token_offsets": [0, 2]}
    )
    assert sample.rollout_top_p_token_ids == [5, 7, 6, 8, 9]
    assert sample.rollout_top_p_token_offsets == [0, 2, 3, 5]


def test_non_trainable_tokens_get_empty_spans_mask_zero_and_zero_logprobs(types_module: ModuleType) -> None:
    sample = types_module.Sample(tokens=[1])
    sample.append_response_tokens(
        tokens=[5], log_probs=[-0.1], meta_info={"top_p_token_ids": [5, 6], "top_p_token_offsets": [0, 2]}
    )
    sample.append_response_tokens(tokens=[9, 9], trainable=False)
    assert sample.rollout_top_p_token_offsets == [0, 2, 2, 2]
    assert sample.loss_mask == [1, 0, 0]
    assert sample.rollout_log_probs == [-0.1, 0.0, 0.0]
    assert sample.tokens == [1, 5, 9, 9]
    assert sample.response_length == 3


def test_trainable_tokens_need_logprobs_and_non_trainable_tokens_refuse_them(types_module: ModuleType) -> None:
    sample = types_module.Sample(tokens=[1])
    with pytest.raises(ValueError):
        sample.append_response_tokens(tokens=[5])
    with pytest.raises(ValueError):
        sample.append_response_tokens(tokens=[5], log_probs=[-0.1], trainable=False)
    with pytest.raises(ValueError):
        sample.append_response_tokens(tokens=[5, 6], log_probs=[-0.1])


def test_terminal_info_sets_status_weight_version_and_prefix_cache(types_module: ModuleType) -> None:
    sample = types_module.Sample(tokens=[1])
    meta = {"finish_reason": {"type": "length"}, "weight_version": "7", "prompt_tokens": 3, "cached_tokens": 2}
    sample.append_response_tokens(tokens=[5], log_probs=[-0.1], meta_info=meta)
    assert sample.status is types_module.Sample.Status.TRUNCATED
    assert sample.weight_versions == ["7"]
    sample.append_response_tokens(tokens=[], log_probs=[], meta_info={**meta, "finish_reason": {"type": "stop"}})
    assert sample.status is types_module.Sample.Status.COMPLETED
    assert sample.weight_versions == ["7"], "no weight version for a turn without tokens"
    assert (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens) == (4, 6)
    sample.append_response_tokens(tokens=[6], log_probs=[-0.1], meta_info={"finish_reason": {"type": "error"}})
    assert sample.status is types_module.Sample.Status.COMPLETED, "unknown reasons leave the status alone"


def test_update_terminal_info_false_leaves_status_pending(types_module: ModuleType) -> None:
    sample = types_module.Sample(tokens=[1])
    sample.append_response_tokens(
        tokens=[5], log_probs=[-0.1], meta_info={"finish_reason": {"type": "stop"}}, update_terminal_info=False
    )
    assert sample.status is types_module.Sample.Status.PENDING


def test_routed_experts_decode_to_rows_layers_topk_and_check_their_count(types_module: ModuleType) -> None:
    args = SimpleNamespace(num_layers=2, moe_router_topk=3)
    sample = types_module.Sample(tokens=[1, 2])
    experts = np.arange(3 * 2 * 3, dtype=np.int32)
    meta = {
        "routed_experts": base64.b64encode(experts.tobytes()).decode(),
        "pd_prefill_routed_experts": "ignored",
        "pd_decode_routed_experts": "ignored",
    }
    sample.append_response_tokens(args, tokens=[5, 6], log_probs=[-0.1, -0.2], meta_info=meta)
    assert sample.rollout_routed_experts.shape == (3, 2, 3)
    with pytest.raises(ValueError):
        sample.append_response_tokens(args, tokens=[7], log_probs=[-0.1], meta_info=meta)
    with pytest.raises(ValueError):
        types_module.Sample(tokens=[1]).append_response_tokens(tokens=[5], log_probs=[-0.1], meta_info=meta)


# ------------------------------------------------------------------------------------------- vllm_rollout helpers


def test_coerce_flat_int_token_ids(vime_standin: ModuleType) -> None:
    coerce = vime_standin._coerce_flat_int_token_ids
    assert coerce([[1, 2], (3, [4])]) == [1, 2, 3, 4]
    assert coerce(np.array([[5, 6]])) == [5, 6]
    assert coerce(None) == []
    assert coerce(7) == [7]
    with pytest.raises(TypeError):
        coerce("1 2")


def test_build_inference_sampling_params_maps_every_field(vime_standin: ModuleType) -> None:
    params = vime_standin._build_inference_sampling_params(
        {
            "max_new_tokens": 8,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop": ["</answer>"],
            "no_stop_trim": True,
            "stop_token_ids": [3],
            "seed": 11,
            "min_new_tokens": 1,
            "repetition_penalty": 1.1,
            "skip_special_tokens": 0,
            "spaces_between_special_tokens": False,
        }
    )
    assert params == {
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "logprobs": 1,
        "top_k": -1,
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "stop_token_ids": [3],
        "seed": 11,
        "min_tokens": 1,
        "repetition_penalty": 1.1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    minimal = vime_standin._build_inference_sampling_params(
        {"max_new_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    )
    assert minimal == {"max_tokens": None, "temperature": 1.0, "top_p": 1.0, "logprobs": 1}
    with pytest.raises(KeyError):
        vime_standin._build_inference_sampling_params({"max_new_tokens": 1, "temperature": 1.0})


def test_render_response_to_generate_body_shapes(vime_standin: ModuleType) -> None:
    to_body = vime_standin._mm_render_response_to_generate_body
    flat = {"token_ids": [1, 2], "features": None, "request_id": "r"}
    body = to_body(flat, "m")
    assert body == {**flat, "model": "m"} and body is not flat
    assert to_body({"token_ids": [1], "model": "served"}, "m")["model"] == "served"
    legacy = [[], [{"prompt_token_ids": [4, 5], "multi_modal_data": {"image": [1]}, "cache_salt": "s"}]]
    assert to_body(legacy, "m") == {
        "model": "m",
        "token_ids": [4, 5],
        "features": '{"image": [1]}',
        "cache_salt": "s",
    }
    assert to_body([[], [{"token_ids": [6]}]], "m")["token_ids"] == [6]
    with pytest.raises(ValueError):
        to_body([[], []], "m")
    with pytest.raises(ValueError):
        to_body({"prompt": "text"}, "m")


def test_generate_meta_info_turns_sampling_mask_into_top_p_spans(vime_standin: ModuleType) -> None:
    experts = np.arange(6, dtype=np.uint8).reshape(3, 1, 2)
    output = {
        "choices": [
            {
                "finish_reason": "stop",
                "token_ids": [65],
                "sampling_mask": [[65, 66]],
                "routed_experts": npy_base64(experts),
            }
        ],
        "weight_version": 7,
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    meta = vime_standin._inference_generate_meta_info(output)
    assert meta["finish_reason"] == {"type": "stop"}
    assert meta["weight_version"] == "7"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 1, 2)
    assert meta["top_p_token_ids"] == [65, 66] and meta["top_p_token_offsets"] == [0, 2]
    assert np.array_equal(meta["routed_experts"], experts)
    reasons = {"length": "length", "abort": "abort", "cancelled": "abort", None: "stop", "odd": "stop"}
    for reason, expected in reasons.items():
        finish = vime_standin._inference_generate_meta_info({"choices": [{"finish_reason": reason}]})["finish_reason"]
        assert finish == {"type": expected}


def test_generate_state_is_a_singleton_holding_the_injected_tokenizer(vime_standin: ModuleType, tokenizer: Any) -> None:
    first = vime_standin.GenerateState(SimpleNamespace(hf_checkpoint="a"))
    assert vime_standin.GenerateState(SimpleNamespace(hf_checkpoint="b")) is first
    assert first.tokenizer is tokenizer and first.processor is None


def test_encode_image_for_rollout_engine_gives_a_png_data_url(vime_standin: ModuleType) -> None:
    encode = importlib.import_module("vime.utils.processing_utils").encode_image_for_rollout_engine
    url = encode(Image.new("L", (2, 2)))
    assert url.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as decoded:
        assert decoded.mode == "RGB"


# ------------------------------------------------------------------------------------------- post


async def test_post_retries_a_failure_then_returns_json(http_utils: ModuleType, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.script([ScriptedTurn(text="Hi")])
    fake_vllm.fail_next(GENERATE_PATH, status=400)
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 4}}
    answer = await http_utils.post(fake_vllm.url + GENERATE_PATH, body)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2


async def test_post_raises_after_the_last_attempt(http_utils: ModuleType, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.fail_next(GENERATE_PATH, status=500, times=http_utils.MAX_ATTEMPTS)
    with pytest.raises(aiohttp.ClientResponseError):
        await http_utils.post(fake_vllm.url + GENERATE_PATH, {"token_ids": [1]})
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == http_utils.MAX_ATTEMPTS


async def test_post_returns_a_non_json_body_as_text(http_utils: ModuleType, fake_vllm: FakeVLLMServer) -> None:
    fake_vllm.fail_next(GENERATE_PATH, malformed_json=True)
    answer = await http_utils.post(fake_vllm.url + GENERATE_PATH, {"token_ids": [1]})
    assert isinstance(answer, str) and answer.startswith('{"request_id"')
