"""The same wire tests against every vLLM-speaking server of the project: the embedded engine, the fake test server
and the bench's canned server, over real HTTP on loopback (see ``wire_servers.py`` for the harnesses).

The expected answers are vLLM's (0.32, ``vllm serve --enable-scale-out`` with ``VLLM_SERVER_DEV_MODE=1``): the key
sets come from the answers recorded from a real server in ``tests/fixtures/vllm_responses``, the stop-string rule is
vLLM's detokenizer loop written out here step by step (independently of :mod:`fsm_rollout.engine.stop_strings`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import pytest
from wire_servers import HELD_TOKENS, Harness

from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    IS_PAUSED_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    RENDER_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_INFO_PATH,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

RECORDED = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vllm_responses"
MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]


def recorded(name: str) -> Any:
    return json.loads((RECORDED / f"{name}.json").read_text())


def assert_error(status: int, body: Any, expected_status: int, param: str | None = None) -> None:
    """vLLM's error answer: ``{"error": {"message", "type", "param", "code"}}`` with the status as ``code``."""
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == expected_status and isinstance(body["error"]["message"], str)
    assert body["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError"}[expected_status]
    if param is not None:
        assert body["error"]["param"] == param, body


async def generate(wire: Harness, **sampling: Any) -> dict[str, Any]:
    wire.will_generate()
    body = await wire.generate_body(**sampling)
    status, answer = await wire.post(GENERATE_PATH, body)
    assert status == 200, answer
    return dict(answer)


# -------------------------------------------------------------------- health, models


async def test_health_is_an_empty_200(wire: Harness) -> None:
    assert await wire.get(HEALTH_PATH) == (200, None)


async def test_models_lists_the_served_model(wire: Harness) -> None:
    status, body = await wire.get(MODELS_PATH)
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == wire.model and card["object"] == "model" and card["owned_by"] == "vllm"
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(card)


# -------------------------------------------------------------------- render


async def test_render_answers_vllms_17_fields_and_echoes_the_sampling_fields(wire: Harness) -> None:
    request = {
        "model": wire.model,
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["</answer>"],
        "logprobs": True,
        "seed": 3,
    }
    status, body = await wire.post(RENDER_PATH, request)
    assert status == 200, body
    assert list(body) == list(recorded("render_with_sampling"))  # the 17 fields, in vLLM's order
    assert body["request_id"].startswith("chatcmpl-") and body["model"] == wire.model
    assert body["token_ids"] and all(type(token) is int for token in body["token_ids"])
    assert (body["output_mode"], body["stream"], body["priority"], body["features"]) == ("tokens", False, 0, None)
    params = body["sampling_params"]
    assert "max_tokens" not in params  # vLLM leaves out a max_tokens equal to its default, 16
    assert (params["temperature"], params["top_p"], params["stop"], params["seed"]) == (0.7, 0.9, ["</answer>"], 3)
    assert params["logprobs"] == 0  # chat's logprobs=true without top_logprobs


async def test_render_fills_max_tokens_with_the_rest_of_the_context(wire: Harness) -> None:
    status, body = await wire.post(RENDER_PATH, {"model": wire.model, "messages": MESSAGES})
    assert status == 200, body
    assert list(body) == list(recorded("render_text"))
    recorded_defaults = {
        key: value
        for key, value in recorded("render_text")["sampling_params"].items()
        if key
        in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
            "stop",
            "stop_token_ids",
        )
    }
    assert recorded_defaults.items() <= body["sampling_params"].items()
    assert body["sampling_params"]["max_tokens"] == wire.max_model_len - len(body["token_ids"])
    status, body = await wire.post(RENDER_PATH, {"model": wire.model, "messages": MESSAGES, "max_tokens": 17})
    assert body["sampling_params"]["max_tokens"] == 17


# -------------------------------------------------------------------- generate


async def test_generate_answers_every_field_of_vllms_answer_under_vllms_id(wire: Harness) -> None:
    wire.will_generate()
    body = await wire.generate_body(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    status, answer = await wire.post(GENERATE_PATH, {**body, "request_id": "shape-1"})
    assert status == 200, answer
    reference = recorded("generate_length")
    assert list(answer) == list(reference)
    assert list(answer["choices"][0]) == list(reference["choices"][0])
    assert set(answer["usage"]) == set(reference["usage"])
    assert answer["request_id"] == "generate-tokens-shape-1" and answer["model"] == wire.model
    choice = answer["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert len(choice["token_ids"]) == 4 == answer["usage"]["completion_tokens"]
    assert answer["usage"]["prompt_tokens"] == len(body["token_ids"])
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    assert choice["weight_versions"] == [{"version": choice["weight_versions"][0]["version"], "start": 0, "end": 4}]


@pytest.mark.parametrize("k", [0, 1, 3, 20])
async def test_logprobs_k_lists_max_k_1_candidates_the_sampled_token_first(wire: Harness, k: int) -> None:
    # vLLM lists each token's logprobs dict (the sampled token first, then the top k by rank), cut to max(k, 1)
    answer = await generate(wire, max_tokens=4, temperature=0.0, logprobs=k, ignore_eos=True)
    reference = recorded("generate_length")["choices"][0]["logprobs"]["content"][0]
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    for entry in content:
        assert list(entry) == list(reference)
        top = entry["top_logprobs"]
        assert len(top) == max(k, 1)
        assert all(list(candidate) == list(reference["top_logprobs"][0]) for candidate in top)
        assert top[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        assert len({candidate["token_id"] for candidate in top}) == len(top)
        # greedy: the sampled token is the likeliest, so the list is also in rank order
        assert entry["rank"] == 1
        assert all(a["logprob"] >= b["logprob"] and a["rank"] <= b["rank"] for a, b in itertools.pairwise(top))


def vllm_stop(wire: Harness, token_ids: Sequence[int], stop: Sequence[str], min_tokens: int) -> tuple[int, str | None]:
    """Where vLLM stops generating ``token_ids``, as its detokenizer does it: after each token, the text that token
    added (and, for a stop string begun before, up to ``len(stop) - 1`` characters earlier) is searched, except that
    the first ``min_tokens`` tokens' text is never searched. ``(count, stop string)``, or ``(len, None)``."""
    text = ""
    searched_to = 0
    for count in range(1, len(token_ids) + 1):
        text = wire.decode(token_ids[:count])
        if count <= min_tokens:
            searched_to = len(text)
            continue
        for item in stop:
            if text.find(item, max(0, searched_to - len(item) + 1)) != -1:
                return count, item
        searched_to = len(text)
    return len(token_ids), None


def recurring_token(wire: Harness, token_ids: Sequence[int]) -> tuple[int, str]:
    """A position whose token's text recurs later in the output (or the first token), and that text."""
    for index, token in enumerate(token_ids):
        piece = wire.decode([token])
        if piece.strip() and token in token_ids[index + 1 :]:
            return index, piece
    return 0, wire.decode(token_ids[:1])


async def test_a_stop_string_is_not_honoured_within_min_tokens(wire: Harness) -> None:
    free = await generate(wire, max_tokens=16, temperature=0.0, ignore_eos=True)
    output = free["choices"][0]["token_ids"]
    index, stop = recurring_token(wire, output)
    assert stop, output

    early = await generate(wire, max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    count, reason = vllm_stop(wire, output, [stop], 0)
    assert reason == stop and count <= index + 1
    assert early["choices"][0]["token_ids"] == output[:count]
    assert (early["choices"][0]["finish_reason"], early["choices"][0]["stop_reason"]) == ("stop", stop)

    min_tokens = index + 1  # the stop string's first occurrence ends inside the first min_tokens tokens
    floored = await generate(wire, max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
    count, reason = vllm_stop(wire, output, [stop], min_tokens)
    choice = floored["choices"][0]
    assert len(choice["token_ids"]) > min_tokens
    assert choice["token_ids"] == output[:count]
    assert (choice["finish_reason"], choice["stop_reason"]) == (("stop", stop) if reason else ("length", None))


# -------------------------------------------------------------------- abort


async def test_abort_answers_an_empty_200_and_the_request_ends_with_its_tokens_so_far(wire: Harness) -> None:
    body = await wire.generate_body(max_tokens=32, temperature=0.0, logprobs=1, ignore_eos=True)
    task = await wire.held_generate(body, "held-1")
    try:
        assert await wire.post(ABORT_PATH, {"request_ids": ["generate-tokens-held-1"]}) == (200, None)
        status, answer = await asyncio.wait_for(task, 30.0)
    finally:
        await wire.release()
    assert status == 200, answer
    assert answer["request_id"] == "generate-tokens-held-1"
    choice = answer["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("abort", None)
    assert len(choice["token_ids"]) >= HELD_TOKENS
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


async def test_abort_of_unknown_ids_is_an_empty_200(wire: Harness) -> None:
    assert await wire.post(ABORT_PATH, {"request_ids": ["never-sent", "generate-tokens-never-sent"]}) == (200, None)


# -------------------------------------------------------------------- pause, resume, weight versions


async def test_pause_modes_parse_as_vllms_query(wire: Harness) -> None:
    for query in (
        {"mode": "bogus"},
        {"mode": "ABORT"},
        {"wait_for_inflight_requests": "maybe"},
        {"mode": "keep", "clear_cache": "sometimes"},
    ):
        status, body = await wire.post(PAUSE_PATH, **query)
        assert_error(status, body, 400)
        assert await wire.get(IS_PAUSED_PATH) == (200, {"is_paused": False})
    for query in (
        {},
        {"mode": "abort"},
        {"mode": "wait"},
        {"mode": "keep", "clear_cache": "false"},
        {"wait_for_inflight_requests": "true"},
    ):
        assert await wire.post(PAUSE_PATH, **query) == (200, {"status": "paused"})
        assert await wire.get(IS_PAUSED_PATH) == (200, {"is_paused": True})
        assert await wire.post(RESUME_PATH) == (200, {"status": "resumed"})
        assert await wire.get(IS_PAUSED_PATH) == (200, {"is_paused": False})
    assert await wire.post(RESUME_PATH) == (200, {"status": "resumed"})  # resuming when not paused is fine


async def test_a_generate_request_sent_during_a_keep_pause_waits_for_resume(wire: Harness) -> None:
    assert await wire.post(PAUSE_PATH, mode="keep") == (200, {"status": "paused"})
    wire.will_generate()
    body = await wire.generate_body(max_tokens=4, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(wire.post(GENERATE_PATH, {**body, "request_id": "parked-1"}))
    try:
        parked = False
        for _ in range(3000):
            if parked := await wire.parked("parked-1"):
                break
            await asyncio.sleep(0.01)
        assert parked and not task.done()
    finally:
        assert await wire.post(RESUME_PATH) == (200, {"status": "resumed"})
    status, answer = await asyncio.wait_for(task, 30.0)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


async def test_weight_version_is_set_reported_and_labels_the_tokens(wire: Harness) -> None:
    status, info = await wire.get(WEIGHT_INFO_PATH)
    assert status == 200 and set(info) == {"weight_version"} and isinstance(info["weight_version"], str)
    version = f"v-{wire.name}-7"
    assert await wire.post(UPDATE_WEIGHT_VERSION_PATH, {"new_version": version}) == (
        200,
        {"success": True, "new_version": version},
    )
    assert await wire.get(WEIGHT_INFO_PATH) == (200, {"weight_version": version})
    answer = await generate(wire, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert answer["choices"][0]["weight_versions"] == [{"version": version, "start": 0, "end": 3}]
    for bad in ({}, {"new_version": 7}, {"new_version": None}):
        status, body = await wire.post(UPDATE_WEIGHT_VERSION_PATH, bad)
        assert_error(status, body, 400, "new_version")
    assert await wire.get(WEIGHT_INFO_PATH) == (200, {"weight_version": version})


async def test_update_weights_needs_update_info(wire: Harness) -> None:
    status, body = await wire.post(UPDATE_WEIGHTS_PATH, {})
    assert_error(status, body, 400, "update_info")


# -------------------------------------------------------------------- errors


@pytest.mark.parametrize("path", [RENDER_PATH, GENERATE_PATH, ABORT_PATH, UPDATE_WEIGHT_VERSION_PATH])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_a_body_that_is_not_a_json_object_is_a_400(wire: Harness, path: str, raw: bytes) -> None:
    status, body = await wire.post(path, raw=raw)
    assert_error(status, body, 400)


@pytest.mark.parametrize("path", [RENDER_PATH, GENERATE_PATH])
async def test_another_model_name_is_a_404(wire: Harness, path: str) -> None:
    body = {"model": "no-such-model", "messages": MESSAGES, "token_ids": [1, 2], "sampling_params": {}}
    status, answer = await wire.post(path, body)
    assert_error(status, answer, 404, "model")
    assert answer["error"]["message"].startswith("The model `no-such-model` does not exist.")
    assert recorded("error_render_unknown_model")["error"]["message"].startswith(
        "The model `no-such-model` does not exist."
    )


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"token_ids": None}, "token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": [1, True]}, "token_ids"),
        ({"sampling_params": None}, "sampling_params"),
        ({"request_id": ""}, "request_id"),
        ({"sampling_params": {"max_tokens": 0}}, "max_tokens"),
        ({"sampling_params": {"max_tokens": 1_000_000}}, "max_tokens"),
        ({"sampling_params": {"max_tokens": 4, "min_tokens": 5}}, "min_tokens"),
        ({"sampling_params": {"temperature": -1}}, "temperature"),
        ({"sampling_params": {"top_p": 0}}, "top_p"),
        ({"sampling_params": {"logprobs": 21}}, "logprobs"),
        ({"sampling_params": {"stop": [1]}}, "stop"),
        ({"sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids"),
        ({"sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ],
)
async def test_a_bad_generate_field_is_a_400_naming_it(wire: Harness, change: dict[str, Any], param: str) -> None:
    body = {"model": wire.model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}, **change}
    status, answer = await wire.post(GENERATE_PATH, {key: value for key, value in body.items() if value is not None})
    assert_error(status, answer, 400, param)


async def test_a_prompt_that_fills_the_context_is_a_400(wire: Harness) -> None:
    body = {"model": wire.model, "token_ids": [1] * wire.max_model_len, "sampling_params": {}}
    status, answer = await wire.post(GENERATE_PATH, body)
    assert_error(status, answer, 400, "token_ids")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": MESSAGES, "tools": {}}, "tools"),
        ({"messages": MESSAGES, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, "messages"),
    ],
)
async def test_a_bad_render_field_is_a_400_naming_it(wire: Harness, body: dict[str, Any], param: str) -> None:
    status, answer = await wire.post(RENDER_PATH, {"model": wire.model, **body})
    assert_error(status, answer, 400, param)


async def test_abort_needs_a_list_of_ids(wire: Harness) -> None:
    for body in ({}, {"request_ids": "r-1"}, {"request_ids": [1]}):
        status, answer = await wire.post(ABORT_PATH, body)
        assert_error(status, answer, 400, "request_ids")


async def test_unknown_paths_and_methods_get_fastapis_detail(wire: Harness) -> None:
    assert await wire.post("/no/such/path") == (404, {"detail": "Not Found"})
    assert await wire.get(GENERATE_PATH) == (405, {"detail": "Method Not Allowed"})
    assert await wire.post(MODELS_PATH) == (405, {"detail": "Method Not Allowed"})
