"""The embedded engine (``fsm-rollout serve``) against vLLM's token-in/token-out contract, over real HTTP.

One engine (the tiny random Qwen2, real vocabulary) serves the whole module; its model loads once. Random weights
make the text gibberish, so the stop tests first generate with a seed and then choose a stop string or token from
that output.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import pathlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import pytest
import pytest_asyncio
import torch
from engine_http import GENERATE, generate, logprob_values, post
from PIL import Image, ImageDraw
from process_groups import start_group_async, stop_group_async

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.server import DEFAULT_MAX_REQUEST_BYTES
from fsm_rollout.engine.local.tiny import TINY_MODEL_NAME, tiny_model_dir
from fsm_rollout.multimodal import decode_train_features
from fsm_rollout.multimodal.codec import decode_item
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.types import GeneratedTurn

pytestmark = pytest.mark.asyncio(loop_scope="module")

RENDER = "/v1/chat/completions/render"
ABORT = "/inference/v1/abort_requests"
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 8 * 1024 * 1024
MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]
VLLM_FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vllm_responses"
MM_ITEM_FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "mm_items"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    # Two generations decode in turn, so a third one waits in the queue (for the queued-abort test). The random
    # model: these tests lean on its near-uniform distribution (greedy decoding repeats one token, no early EOS).
    async with LocalEngine(
        tiny_model_dir(),
        served_model_name=TINY_MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        torch_threads=1,
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(loop_scope="module")
async def prompt(engine: LocalEngine, http: aiohttp.ClientSession) -> list[int]:
    status, body = await post(http, engine, RENDER, {"messages": MESSAGES})
    assert status == 200
    token_ids: list[int] = body["token_ids"]
    return token_ids


async def generate_raw(
    http: aiohttp.ClientSession, engine: LocalEngine, token_ids: list[int], request_id: str, **sampling: Any
) -> tuple[int, Any]:
    params = {"temperature": 1.0, "logprobs": 1, "ignore_eos": True, **sampling}
    body = {"token_ids": token_ids, "sampling_params": params, "request_id": request_id}
    return await post(http, engine, GENERATE, body)


async def wait_until(predicate: Any, within: float = 5.0) -> float:
    """Poll ``predicate`` until it holds; returns how long that took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > within:
            raise AssertionError(f"condition not reached within {within} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def as_ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


def shape(value: Any) -> Any:
    """A JSON value's structure: keys and nesting, JSON types, and a list by its first item."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None or isinstance(value, bool | str):
        return None if value is None else type(value).__name__
    return "integer" if isinstance(value, int) else "number"


def recorded(case: str) -> Any:
    """The answer real vLLM 0.32 gave in ``case`` (recorded by tests/vllm/test_vllm_response_shapes.py)."""
    return json.loads((VLLM_FIXTURES / f"{case}.json").read_text(encoding="utf-8"))


def recorded_request(case: str) -> dict[str, Any]:
    request: dict[str, Any] = json.loads((VLLM_FIXTURES / "manifest.json").read_text(encoding="utf-8"))["cases"][case][
        "request"
    ]
    return request


# -------------------------------------------------------------------- shapes


async def test_health_answers_200(engine: LocalEngine, http: aiohttp.ClientSession) -> None:
    async with http.get(engine.url + "/health") as response:
        assert response.status == 200


async def test_models_lists_the_served_model_and_its_context_length(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    async with http.get(engine.url + "/v1/models") as response:
        body = await response.json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == engine.served_model_name == TINY_MODEL_NAME
    assert card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(card["created"], int)


async def test_models_names_the_tokenizer_and_the_image_merge_size_for_the_client(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    from fsm_rollout.engine.probe import probe_engine

    async with http.get(engine.url + "/v1/models") as response:
        (card,) = (await response.json())["data"]
    assert card["tokenizer"] == str(engine.model_dir.resolve())
    assert card["image_merge_size"] == engine.image_merge_size == 2
    (served,) = await probe_engine(engine.url) or []
    assert (served.name, served.tokenizer, served.image_merge_size, served.max_model_len) == (
        engine.served_model_name,
        card["tokenizer"],
        2,
        MAX_MODEL_LEN,
    )


@pytest.mark.parametrize("case", ["render_text", "render_with_sampling"])
async def test_render_answers_the_shape_vllm_answers(
    engine: LocalEngine, http: aiohttp.ClientSession, case: str
) -> None:
    request = {**recorded_request(case), "model": engine.served_model_name}
    status, body = await post(http, engine, RENDER, request)
    assert status == 200
    vllm = recorded(case)
    # vLLM's sampling_params also carries internal fields (output_kind, skip_clone, ...): compared by value below.
    assert shape({**body, "sampling_params": {}}) == shape({**vllm, "sampling_params": {}})
    assert body["request_id"].startswith("chatcmpl-")
    for key in ("temperature", "top_p", "min_p", "seed", "stop", "stop_token_ids", "logprobs"):
        assert body["sampling_params"].get(key) == vllm["sampling_params"].get(key), key


async def test_render_fills_in_max_tokens_with_the_rest_of_the_context(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    status, body = await post(http, engine, RENDER, {"messages": MESSAGES})
    assert status == 200
    assert body["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(body["token_ids"])


@pytest.mark.parametrize(
    ("case", "sampling"),
    [
        ("generate_length", {"logprobs": 1, "max_tokens": 8, "temperature": 0.0}),
        ("generate_without_logprobs", {"max_tokens": 4}),
        # Greedy decoding of the tiny model repeats "\n" (id 198): both stops hit the first token.
        ("generate_stop_token", {"logprobs": 1, "max_tokens": 12, "temperature": 0.0, "stop_token_ids": [198]}),
        ("generate_stop_string", {"logprobs": 1, "max_tokens": 12, "temperature": 0.0, "stop": ["\n"]}),
    ],
)
async def test_generate_answers_the_shape_vllm_answers(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int], case: str, sampling: dict[str, Any]
) -> None:
    request = {"token_ids": prompt, "model": engine.served_model_name, "sampling_params": sampling}
    status, body = await post(http, engine, GENERATE, request)
    assert status == 200
    assert shape(body) == shape(recorded(case))
    assert body["choices"][0]["finish_reason"] == recorded(case)["choices"][0]["finish_reason"]


async def test_aborted_generate_answers_the_shape_vllm_answers(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    running = asyncio.create_task(generate_raw(http, engine, prompt, "shape-abort", max_tokens=450))
    await wait_until(lambda: "shape-abort" in engine.live_request_ids())
    await asyncio.sleep(0.1)
    await post(http, engine, ABORT, {"request_ids": ["generate-tokens-shape-abort"]})  # the id vLLM answers under
    status, body = await asyncio.wait_for(running, 2.0)
    assert status == 200
    assert shape(body) == shape(recorded("generate_abort"))
    assert body["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(
    ("case", "path", "request_body"),
    [
        ("error_render_unknown_model", RENDER, {"model": "no-such-model", "messages": MESSAGES}),
        ("error_generate_empty_token_ids", GENERATE, {"token_ids": [], "sampling_params": {"max_tokens": 4}}),
    ],
)
async def test_errors_answer_the_shape_vllm_answers(
    engine: LocalEngine, http: aiohttp.ClientSession, case: str, path: str, request_body: dict[str, Any]
) -> None:
    status, body = await post(http, engine, path, request_body)
    assert status == recorded(case)["error"]["code"]
    assert shape(body) == shape(recorded(case))


@pytest.mark.parametrize(
    "messages",
    [
        MESSAGES,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Héllo, wörld! 日本語 😀"}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again\n\n  with spaces"},
        ],
    ],
)
async def test_render_ids_equal_the_chat_template_ids(
    engine: LocalEngine, http: aiohttp.ClientSession, tokenizer: Any, messages: list[dict[str, Any]]
) -> None:
    status, body = await post(http, engine, RENDER, {"messages": messages})
    assert status == 200
    assert body["token_ids"] == as_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def test_render_copies_the_chat_sampling_fields(engine: LocalEngine, http: aiohttp.ClientSession) -> None:
    request = {"messages": MESSAGES, "max_tokens": 7, "seed": 3, "stop": ["x"], "logprobs": True, "top_logprobs": 2}
    status, body = await post(http, engine, RENDER, request)
    assert status == 200
    sampling = body["sampling_params"]
    assert (sampling["max_tokens"], sampling["seed"], sampling["stop"], sampling["logprobs"]) == (7, 3, ["x"], 2)


async def test_generate_answer_names_the_request_and_lists_the_sampled_token_first(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    request = {"token_ids": prompt, "sampling_params": {"max_tokens": 5, "logprobs": 2, "seed": 1}, "request_id": "r1"}
    status, body = await post(http, engine, GENERATE, request)
    assert status == 200
    assert body["request_id"] == "generate-tokens-r1"
    assert body["model"] == engine.served_model_name
    (choice,) = body["choices"]
    tokens = choice["token_ids"]
    assert len(tokens) == 5
    for token, entry in zip(tokens, choice["logprobs"]["content"], strict=True):
        assert entry["token_id"] == token and entry["rank"] >= 1
        assert entry["top_logprobs"][0] == {"token_id": token, "logprob": entry["logprob"], "rank": entry["rank"]}
        # vLLM lists max(logprobs, 1) candidates: the sampled token, then the likeliest other
        assert len(entry["top_logprobs"]) == 2
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(prompt),
        5,
        len(prompt) + 5,
    )


async def test_the_library_client_parses_the_answers(engine: LocalEngine, prompt: list[int]) -> None:
    async with VLLMClient(engine.url) as client:
        rendered = await client.render({"model": engine.served_model_name, "messages": MESSAGES})
        body = {**rendered.generate_body, "sampling_params": {"max_tokens": 4, "logprobs": 1, "ignore_eos": True}}
        turn = await client.generate({**body, "request_id": "lib-1"}, request_id="lib-1")
    assert rendered.token_ids == prompt
    assert turn.finish == "length"
    assert len(turn.token_ids) == len(turn.logprobs) == 4


# -------------------------------------------------------------------- sampling


async def test_same_seed_gives_identical_tokens_and_logprobs(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    first = await generate(http, engine, prompt, max_tokens=16, seed=7, top_p=0.9)
    second = await generate(http, engine, prompt, max_tokens=16, seed=7, top_p=0.9)
    other = await generate(http, engine, prompt, max_tokens=16, seed=8, top_p=0.9)
    assert first["token_ids"] == second["token_ids"]
    assert logprob_values(first) == logprob_values(second)
    assert other["token_ids"] != first["token_ids"]


async def test_greedy_is_deterministic_and_takes_the_top_token(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    first = await generate(http, engine, prompt, max_tokens=8, temperature=0.0)
    second = await generate(http, engine, prompt, max_tokens=8, temperature=0.0, seed=99)
    assert first["token_ids"] == second["token_ids"]
    assert logprob_values(first) == logprob_values(second)
    assert all(entry["rank"] == 1 for entry in first["logprobs"]["content"])


async def test_logprobs_are_finite_non_positive_and_aligned(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    choice = await generate(http, engine, prompt, max_tokens=32, seed=3, top_k=50, temperature=0.8)
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 32
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    assert all(math.isfinite(value) and value <= 0.0 for value in logprob_values(choice))
    assert all(entry["rank"] <= 50 for entry in content)  # top_k=50 leaves nothing else to sample


async def test_logprobs_are_of_the_processed_distribution(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    greedy = await generate(http, engine, prompt, max_tokens=6, temperature=0.0)
    only_one = await generate(http, engine, prompt, max_tokens=6, temperature=1.0, top_k=1, seed=5)
    assert only_one["token_ids"] == greedy["token_ids"]
    assert logprob_values(only_one) == [0.0] * 6  # one candidate left: probability 1
    assert all(value < -1.0 for value in logprob_values(greedy))  # the raw distribution is near uniform


@pytest.mark.parametrize(("scale", "top_p"), [(0.2, 0.9), (1.0, 0.5), (5.0, 0.95), (0.05, 0.999)])
async def test_top_p_keeps_the_likeliest_tokens_a_full_sort_would_keep(scale: float, top_p: float) -> None:
    import torch

    from fsm_rollout.engine.local.model import top_p_filter

    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(0)) * scale
    probs = torch.softmax(logits, dim=0).double()
    ordered = torch.sort(probs, descending=True).values
    expected = max(int(((torch.cumsum(ordered, dim=0) - ordered) < top_p).sum()), 1)
    kept = torch.isfinite(top_p_filter(logits.clone(), top_p))
    assert abs(int(kept.sum()) - expected) <= 1  # float rounding may decide the one token at the boundary
    assert float(probs[kept].min()) > float(probs[~kept].max())


# -------------------------------------------------------------------- stopping


async def test_max_tokens_reached_finishes_with_length(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    choice = await generate(http, engine, prompt, max_tokens=3, seed=1)
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 3


async def test_missing_max_tokens_generates_up_to_the_context_limit(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    long_prompt = [9707] * (MAX_MODEL_LEN - 20)
    status, body = await post(
        http, engine, GENERATE, {"token_ids": long_prompt, "sampling_params": {"ignore_eos": True, "seed": 2}}
    )
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["token_ids"]) == 20
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN


def first_occurrence_cut(tokenizer: Any, token_ids: list[int]) -> tuple[str, int]:
    """A stop string whose first occurrence in the decoded output ends exactly with token ``k``, and ``k + 1``."""
    full = tokenizer.decode(token_ids)
    for k in range(4, len(token_ids)):
        before, upto = tokenizer.decode(token_ids[:k]), tokenizer.decode(token_ids[: k + 1])
        if not upto.startswith(before) or len(upto) - len(before) < 2 or "\ufffd" in upto:
            continue
        stop = upto[-2:]
        if full.find(stop) + len(stop) == len(upto):
            return stop, k + 1
    raise AssertionError("no usable stop string in the output")


@pytest.mark.parametrize("include_stop_str_in_output", [True, False])
async def test_stop_string_ends_generation_and_keeps_its_tokens(
    engine: LocalEngine,
    http: aiohttp.ClientSession,
    prompt: list[int],
    tokenizer: Any,
    include_stop_str_in_output: bool,
) -> None:
    free = await generate(http, engine, prompt, max_tokens=24, seed=11)
    stop, kept = first_occurrence_cut(tokenizer, free["token_ids"])
    cut = await generate(
        http,
        engine,
        prompt,
        max_tokens=24,
        seed=11,
        stop=[stop],
        include_stop_str_in_output=include_stop_str_in_output,
    )
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == free["token_ids"][:kept]
    assert tokenizer.decode(cut["token_ids"]).endswith(stop)


async def test_stop_token_id_ends_generation_and_is_kept(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    free = await generate(http, engine, prompt, max_tokens=24, seed=12)
    index = next(i for i, token in enumerate(free["token_ids"]) if i >= 3 and token not in free["token_ids"][:i])
    stop_token = free["token_ids"][index]
    cut = await generate(http, engine, prompt, max_tokens=24, seed=12, stop_token_ids=[stop_token])
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == free["token_ids"][: index + 1]
    assert logprob_values(cut) == logprob_values(free)[: index + 1]


async def test_min_tokens_keeps_stop_tokens_out_until_reached(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    free = await generate(http, engine, prompt, max_tokens=8, seed=13)
    stop_token = free["token_ids"][0]
    held = await generate(http, engine, prompt, max_tokens=8, seed=13, stop_token_ids=[stop_token], min_tokens=5)
    assert len(held["token_ids"]) >= 5
    assert stop_token not in held["token_ids"][:4]


# -------------------------------------------------------------------- aborts and concurrency


async def test_abort_requests_ends_a_running_generation_with_abort(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    running = asyncio.create_task(generate(http, engine, prompt, request_id="long-1", max_tokens=450, seed=1))
    await wait_until(lambda: "long-1" in engine.live_request_ids())
    await asyncio.sleep(0.2)
    status, body = await post(http, engine, ABORT, {"request_ids": ["long-1"]})
    assert status == 200 and body is None  # vLLM answers an empty 200
    choice = await asyncio.wait_for(running, 2.0)
    assert choice["finish_reason"] == "abort"
    assert len(choice["token_ids"]) < 450
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert engine.live_request_ids() == []


async def test_abort_requests_ends_a_queued_generation_before_it_starts(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    ids = ["busy-1", "busy-2", "queued-3"]  # the engine decodes two at a time: the third waits
    tasks = []
    for rid in ids:  # one by one, so they arrive in this order
        tasks.append(asyncio.create_task(generate(http, engine, prompt, request_id=rid, max_tokens=450)))
        await wait_until(lambda rid=rid: rid in engine.live_request_ids())
    await post(http, engine, ABORT, {"request_ids": ["queued-3"]})
    queued = await asyncio.wait_for(tasks[2], 2.0)
    assert queued["finish_reason"] == "abort"
    assert queued["token_ids"] == []
    assert not tasks[0].done() and not tasks[1].done()
    await post(http, engine, ABORT, {"request_ids": ["generate-tokens-busy-1", "busy-2"]})  # either id form
    assert [(await task)["finish_reason"] for task in tasks[:2]] == ["abort", "abort"]


async def test_client_disconnect_stops_the_generation(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    doomed = asyncio.create_task(generate(http, engine, prompt, request_id="gone-1", max_tokens=450))
    await wait_until(lambda: engine.live_token_counts().get("gone-1", 0) >= 1, within=60.0)
    await engine.pause("keep")  # frozen: only the disconnect can end it, never its 450 tokens running out
    try:
        frozen_at = engine.live_token_counts()["gone-1"]
        doomed.cancel()  # closes the connection; the server cancels the handler
        await wait_until(lambda: engine.live_request_ids() == [], within=60.0)
    finally:
        await engine.resume()
    assert frozen_at < 450
    choice = await generate(http, engine, prompt, max_tokens=4)  # the engine is free for the next request
    assert choice["finish_reason"] == "length"


async def test_concurrent_requests_all_get_their_own_answers(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    seeds = [21, 22, 23, 24, 25]
    alone = [await generate(http, engine, prompt, max_tokens=10, seed=seed) for seed in seeds]
    together = await asyncio.gather(
        *(generate(http, engine, prompt, request_id=f"c{seed}", max_tokens=10, seed=seed) for seed in seeds)
    )
    assert [choice["token_ids"] for choice in together] == [choice["token_ids"] for choice in alone]
    assert [logprob_values(choice) for choice in together] == [logprob_values(choice) for choice in alone]


# -------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("not json", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"sampling_params": {}}, "token_ids"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, -2], "sampling_params": {}}, "non-negative"),
        ({"token_ids": [10**7], "sampling_params": {}}, "out of vocabulary"),
        ({"token_ids": [1]}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": MAX_MODEL_LEN}}, "maximum context length"),
        ({"token_ids": [1] * MAX_MODEL_LEN, "sampling_params": {}}, "maximum context length"),
        ({"token_ids": [1], "sampling_params": {"n": 2}}, "n must be 1"),
        ({"token_ids": [1], "sampling_params": {"stop": 5}}, "stop"),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {"x": 2.0}}}, "cannot be converted"),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {str(10**7): 2.0}}}, "out-of-vocab"),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {}}}, "must use one kind"),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {"json": "{", "regex": "a"}}}, "only one kind"),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {"json": "{"}}}, "not valid JSON"),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {"choice": "a"}}}, "list of strings"),
        ({"token_ids": [1], "sampling_params": {}, "stream": "yes"}, "stream"),
        ({"token_ids": [1], "sampling_params": {}, "stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ],
)
async def test_bad_generate_requests_get_400_with_a_message(
    engine: LocalEngine, http: aiohttp.ClientSession, body: Any, words: str
) -> None:
    data = body.encode() if isinstance(body, str) else None
    kwargs: dict[str, Any] = {"data": data} if data is not None else {"json": body}
    async with http.post(engine.url + GENERATE, **kwargs) as response:
        status, answer = response.status, await response.json()
    assert status == 400
    error = answer["error"]
    assert words in error["message"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)


@pytest.mark.parametrize(
    "body",
    [{"messages": []}, {"messages": [{"content": "no role"}]}, {"messages": MESSAGES, "tools": "nope"}],
)
async def test_bad_render_requests_get_400(engine: LocalEngine, http: aiohttp.ClientSession, body: Any) -> None:
    status, answer = await post(http, engine, RENDER, body)
    assert status == 400
    assert answer["error"]["message"]


@pytest.mark.parametrize("path", [RENDER, GENERATE])
async def test_another_model_name_gets_404(engine: LocalEngine, http: aiohttp.ClientSession, path: str) -> None:
    status, answer = await post(
        http, engine, path, {"model": "gpt-5", "messages": MESSAGES, "token_ids": [1], "sampling_params": {}}
    )
    assert status == 404
    assert answer["error"] == {
        "message": f"The model `gpt-5` does not exist. Valid aliases: {engine.served_model_name}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_an_oversized_body_gets_413(engine: LocalEngine, http: aiohttp.ClientSession) -> None:
    async with http.post(engine.url + GENERATE, data=b"x" * (MAX_REQUEST_BYTES + 1024 * 1024)) as response:
        assert response.status == 413
        assert "too large" in (await response.json())["error"]["message"]


# -------------------------------------------------------------------- end to end


async def test_two_turn_rollout_against_the_engine_keeps_the_sample_invariants(
    engine: LocalEngine, tokenizer: Any
) -> None:
    config = RolloutConfig(
        engine_url=engine.url,
        model=engine.served_model_name,
        max_turns=2,
        check_invariants=True,
        retry=RetryPolicy(max_attempts=2, base_delay_s=0.01),
    )
    envs = ScriptedEnvFactory()
    # The random model puts an "e" in most tokens: each turn ends on that stop string after a few tokens.
    sampling = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "stop": ["e"], "seed": 4}
    async with VLLMClient(engine.url) as client:
        rollout = Rollout(
            Sample(prompt="What is 6 * 7?", index=0),
            config=config,
            sampling_params=sampling,
            client=client,
            tokenizer=tokenizer,
            env_factory=envs,
        )
        await rollout.run()
    sample = rollout.sample
    prompt_len = len(as_ids(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)))
    assert envs.last.calls.count("step") == 2  # both turns ended on the stop string, not on the budget
    assert rollout.reason == "max_turns"
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response_length == len(sample.tokens) - prompt_len
    generated = [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if mask]
    assert generated and all(math.isfinite(lp) and lp <= 0.0 for lp in generated)


async def test_serve_command_prints_the_url_and_stops_on_sigterm() -> None:
    process = await start_group_async(
        [sys.executable, "-m", "fsm_rollout.cli", "serve", "--port", "0", "--max-model-len", "256"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 300.0)).decode().strip()
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
            assert (await response.json())["data"][0]["max_model_len"] == 256
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 120.0) == 0
    finally:
        await stop_group_async(process)  # the server dies with the test, whatever failed


# -------------------------------------------------------------------- API key

API_KEY = "test-key-0f1e2d"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed_engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine(max_model_len=MAX_MODEL_LEN, torch_threads=1, api_key=API_KEY) as server:
        yield server


WEIGHT_PATHS = ["/pause", "/resume", "/is_paused", "/update_weight_version", "/weight_info", "/update_weights"]
GET_PATHS = {"/v1/models", "/is_paused", "/weight_info"}


@pytest.mark.parametrize("path", [RENDER, GENERATE, ABORT, "/v1/models", "/no/such/path", *WEIGHT_PATHS])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", API_KEY, f"Bearer {API_KEY}x"])
async def test_a_keyed_engine_answers_401_to_a_request_without_the_key(
    keyed_engine: LocalEngine, http: aiohttp.ClientSession, path: str, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    method = http.get if path in GET_PATHS else http.post
    async with method(keyed_engine.url + path, json={"messages": MESSAGES}, headers=headers) as response:
        assert response.status == 401
        assert await response.json() == {"error": "Unauthorized"}  # vLLM's body for a missing or wrong key


async def test_a_keyed_engine_keeps_health_open_and_answers_the_key(
    keyed_engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    assert keyed_engine.requires_api_key
    async with http.get(keyed_engine.url + "/health") as response:
        assert response.status == 200
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with http.get(keyed_engine.url + "/v1/models", headers=headers) as response:
        assert response.status == 200
    async with http.post(keyed_engine.url + RENDER, json={"messages": MESSAGES}, headers=headers) as response:
        assert response.status == 200
    async with http.get(keyed_engine.url + "/is_paused", headers=headers) as response:
        assert (response.status, await response.json()) == (200, {"is_paused": False})
    assert not keyed_engine.is_paused  # the 401 answers above paused nothing


async def test_the_client_with_the_key_succeeds_and_without_it_gets_one_401(keyed_engine: LocalEngine) -> None:
    from fsm_rollout.engine.probe import probe_engine
    from fsm_rollout.errors import EngineHTTPError

    body = {"model": keyed_engine.served_model_name, "messages": MESSAGES}
    async with VLLMClient(keyed_engine.url, api_key=API_KEY) as client:
        assert (await client.render(body)).token_ids
    retry = RetryPolicy(max_attempts=4, base_delay_s=0.0)
    for key in (None, "wrong"):
        async with VLLMClient(keyed_engine.url, api_key=key, retry=retry) as client:
            with pytest.raises(EngineHTTPError, match=r"answered HTTP 401 \(attempt 1\): Unauthorized$") as caught:
                await client.render(body)
        assert caught.value.status == 401
        assert API_KEY not in str(caught.value)
        with pytest.raises(EngineHTTPError, match=r"/v1/models answered HTTP 401: Unauthorized$"):
            await probe_engine(keyed_engine.url, api_key=key)  # health answers; the model list needs the key
    assert [model.name for model in await probe_engine(keyed_engine.url, api_key=API_KEY) or []] == [
        keyed_engine.served_model_name
    ]


# -------------------------------------------------------------------- images

PAD = "<|image_pad|>"
IMAGE_FEATURE_KEYS = {"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"}  # vLLM 0.32's MultiModalFeatures


def draw_figure(width: int, height: int, color: tuple[int, ...], mode: str = "RGB") -> Image.Image:
    """A geometry figure: a filled triangle on a white background (transparent for RGBA)."""
    background = (255, 255, 255) if mode == "RGB" else (255, 255, 255, 0)
    image = Image.new(mode, (width, height), color=background)
    ImageDraw.Draw(image).polygon([(1, height - 1), (width - 1, height - 1), (width // 3, 1)], fill=color)
    return image


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def processed(images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' Qwen2-VL image processor (numpy/PIL backend, default settings) gives for the images."""
    from transformers import Qwen2VLImageProcessorPil

    output = Qwen2VLImageProcessorPil()(images=images, return_tensors="pt")
    return output["pixel_values"], output["image_grid_thw"]


def on_white(image: Image.Image) -> Image.Image:
    flat = Image.new("RGB", image.size, (255, 255, 255))
    flat.paste(image, mask=image.getchannel("A"))
    return flat


def wire_fields(item: str) -> dict[str, Any]:
    """Each field's ``[kind, options]`` exactly as the item carries it on the wire."""
    payload = msgpack.unpackb(base64.b64decode(item), raw=False)
    return {key: value["field"] for key, value in payload.items()}


FIGURE = draw_figure(256, 256, (200, 30, 30))  # resized to 252 x 252: grid (1, 18, 18), 81 pad tokens
SECOND = draw_figure(64, 120, (30, 30, 200, 200), mode="RGBA")  # resized to 56 x 112: grid (1, 8, 4), 8 pad tokens
FIGURE_MESSAGES = [{"role": "user", "content": [image_part(data_url(FIGURE)), {"type": "text", "text": "Area?"}]}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def figure_render(engine: LocalEngine) -> dict[str, Any]:
    """The render answer for FIGURE_MESSAGES (rendered once for the module)."""
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, engine, RENDER, {"messages": FIGURE_MESSAGES})
    assert status == 200, body
    answer: dict[str, Any] = body
    return answer


async def test_render_expands_an_image_into_its_grid_of_pad_tokens(
    engine: LocalEngine, figure_render: dict[str, Any], tokenizer: Any
) -> None:
    token_ids, features = figure_render["token_ids"], figure_render["features"]
    pixel_values, grid = processed([FIGURE])
    assert grid.tolist() == [[1, 18, 18]]
    pad = tokenizer.convert_tokens_to_ids(PAD)
    assert token_ids.count(pad) == int(grid.prod(-1).sum()) // 2**2 == 81

    assert set(features) == IMAGE_FEATURE_KEYS
    ((placeholder),) = features["mm_placeholders"]["image"]
    offset, length = placeholder["offset"], placeholder["length"]
    assert length == 81 and token_ids[offset : offset + length] == [pad] * length
    assert tokenizer.convert_ids_to_tokens([token_ids[offset - 1], token_ids[offset + length]]) == [
        "<|vision_start|>",
        "<|vision_end|>",
    ]
    template_ids = as_ids(tokenizer.apply_chat_template(FIGURE_MESSAGES, add_generation_prompt=True))
    assert token_ids[:offset] + token_ids[offset + length - 1 :] == template_ids  # the one pad became 81
    assert len(features["mm_hashes"]["image"]) == 1 and isinstance(features["mm_hashes"]["image"][0], str)
    assert figure_render["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(token_ids)

    inputs = decode_train_features(features)
    assert inputs is not None and sorted(inputs) == ["image_grid_thw", "pixel_values"]
    assert torch.equal(inputs["image_grid_thw"], grid)
    assert inputs["pixel_values"].dtype == torch.float32 and inputs["pixel_values"].shape == (324, 3 * 2 * 14 * 14)
    assert torch.equal(inputs["pixel_values"], pixel_values)


async def test_image_items_have_the_field_layout_real_vllm_sends(figure_render: dict[str, Any]) -> None:
    recorded_item = json.loads((MM_ITEM_FIXTURES / "qwen2_vl_image0.json").read_text(encoding="utf-8"))["fields"]
    features = figure_render["features"]
    (item,) = features["kwargs_data"]["image"]
    fields = wire_fields(item)
    assert list(fields) == list(recorded_item)  # pixel_values, then image_grid_thw
    assert fields["image_grid_thw"] == recorded_item["image_grid_thw"]["field"] == ["batched", {"keep_on_cpu": True}]
    kind, options = fields["pixel_values"]
    assert kind == recorded_item["pixel_values"]["field"][0] == "flat"
    assert list(options) == list(recorded_item["pixel_values"]["field"][1])  # keep_on_cpu, slices, dim
    assert options == {"keep_on_cpu": False, "slices": [[[0, 324, None]]], "dim": 0}
    # mm_metadata: each item's keep_on_cpu fields alone, as vLLM 0.32's render sends them.
    (metadata,) = features["mm_metadata"]["image"]
    assert wire_fields(metadata) == {"image_grid_thw": ["batched", {"keep_on_cpu": True}]}
    assert decode_item(metadata).get_data()["image_grid_thw"].tolist() == [1, 18, 18]


async def test_two_images_are_expanded_in_order(
    engine: LocalEngine, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    content = [image_part(data_url(FIGURE)), {"type": "text", "text": "and"}, image_part(data_url(SECOND))]
    status, body = await post(http, engine, RENDER, {"messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    pixel_values, grid = processed([FIGURE, on_white(SECOND)])  # vLLM composites transparency onto white
    assert grid.tolist() == [[1, 18, 18], [1, 8, 4]]
    first, second = body["features"]["mm_placeholders"]["image"]
    assert (first["length"], second["length"]) == (81, 8)
    assert first["offset"] + first["length"] < second["offset"]
    pad = tokenizer.convert_tokens_to_ids(PAD)
    assert body["token_ids"].count(pad) == 89
    assert body["token_ids"][second["offset"] : second["offset"] + 8] == [pad] * 8
    inputs = decode_train_features(body["features"])
    assert inputs is not None
    assert torch.equal(inputs["image_grid_thw"], grid)
    assert torch.equal(inputs["pixel_values"], pixel_values)
    # Like vLLM, both items carry the slices of the whole batch they were processed in.
    for item in body["features"]["kwargs_data"]["image"]:
        assert wire_fields(item)["pixel_values"][1]["slices"] == [[[0, 324, None]], [[324, 356, None]]]


async def test_generate_accepts_the_image_features_and_reads_only_the_tokens(
    engine: LocalEngine, http: aiohttp.ClientSession, figure_render: dict[str, Any]
) -> None:
    sampling = {"max_tokens": 6, "seed": 5, "logprobs": 1, "ignore_eos": True}
    with_features = {**figure_render, "sampling_params": sampling, "request_id": "img-1"}
    status, body = await post(http, engine, GENERATE, with_features)
    assert status == 200, body
    tokens_only = {"token_ids": figure_render["token_ids"], "sampling_params": sampling, "request_id": "img-2"}
    status, plain = await post(http, engine, GENERATE, tokens_only)
    assert status == 200
    # The text model sees the pad tokens as ordinary tokens: the features change nothing it generates.
    assert body["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert logprob_values(body["choices"][0]) == logprob_values(plain["choices"][0])
    assert body["usage"]["prompt_tokens"] == len(figure_render["token_ids"])


class RecordingClient(VLLMClient):
    """A client that keeps every generate body it sends."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
        self.generate_bodies: list[dict[str, Any]] = []

    async def generate(
        self, body: Mapping[str, Any], *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> GeneratedTurn:
        self.generate_bodies.append(dict(body))
        return await super().generate(body, request_id=request_id, headers=headers)


async def test_an_image_rollout_over_two_turns_sends_the_features_every_turn_and_passes_the_token_check(
    engine: LocalEngine, tokenizer: Any
) -> None:
    config = RolloutConfig(
        engine_url=engine.url,
        model=engine.served_model_name,
        max_turns=2,
        check_invariants=True,
        retry=RetryPolicy(max_attempts=2, base_delay_s=0.01),
        image_merge_size=engine.image_merge_size,
    )
    envs = ScriptedEnvFactory()
    sampling = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "stop": ["e"], "seed": 4}
    sample = Sample(prompt="<image>Find the area of the triangle.", index=0, multimodal_inputs={"images": [FIGURE]})
    client = RecordingClient(engine.url)
    async with client:
        rollout = Rollout(
            sample, config=config, sampling_params=sampling, client=client, tokenizer=tokenizer, env_factory=envs
        )
        await rollout.run()
    assert sample.status == Status.TRUNCATED and rollout.reason == "max_turns"
    assert envs.last.calls.count("step") == 2
    assert rollout.rendered is not None
    rendered_features = rollout.rendered.generate_body["features"]
    assert set(rendered_features) == IMAGE_FEATURE_KEYS
    assert len(client.generate_bodies) == 2
    for body in client.generate_bodies:
        assert body["features"] == rendered_features  # on every turn, exactly as rendered
        assert body["token_ids"][: rollout.prompt_length] == rollout.rendered.token_ids

    pixel_values, grid = processed([FIGURE])
    inputs = sample.multimodal_train_inputs
    assert inputs is not None
    assert torch.equal(inputs["image_grid_thw"], grid) and torch.equal(inputs["pixel_values"], pixel_values)
    pad = tokenizer.convert_tokens_to_ids(PAD)
    assert sample.tokens.count(pad) == int(grid.prod(-1).sum()) // engine.image_merge_size**2  # the check's rule
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)


def mutated(render: dict[str, Any], case: str) -> dict[str, Any]:
    """A generate body from the render answer, broken in one way."""
    body: dict[str, Any] = json.loads(json.dumps({**render, "sampling_params": {"max_tokens": 2}}))
    features = body["features"]
    image = features["mm_placeholders"]["image"][0]
    if case == "range_past_token_ids":
        body["token_ids"] = body["token_ids"][: image["offset"] + 10]
    elif case == "range_off_the_pads":
        image["offset"] -= 1
    elif case == "length_not_the_grid":
        image["length"] -= 1
    elif case == "negative_offset":
        image["offset"] = -1
    elif case == "overlapping_ranges":
        features["mm_placeholders"]["image"].append(dict(image))
        for name in ("mm_hashes", "kwargs_data", "mm_metadata"):
            features[name]["image"].append(features[name]["image"][0])
    elif case == "lists_not_parallel":
        features["kwargs_data"]["image"].append(features["kwargs_data"]["image"][0])
    elif case == "null_item":
        features["kwargs_data"]["image"][0] = None
    elif case == "not_base64":
        features["kwargs_data"]["image"][0] = "not base64!"
    elif case == "other_modality":
        for name in ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"):
            features[name] = {"video": features[name]["image"]}
    elif case == "no_placeholders":
        del features["mm_placeholders"]
    elif case == "a_string":
        body["features"] = json.dumps(features)
    return body


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("range_past_token_ids", "exceeds the"),
        ("range_off_the_pads", "not the image placeholder <|image_pad|>"),
        ("length_not_the_grid", "gives 81 image tokens"),
        ("negative_offset", "offset"),
        ("overlapping_ranges", "non-overlapping"),
        ("lists_not_parallel", "same length"),
        ("null_item", "keeps no multimodal cache"),
        ("not_base64", "not valid base64"),
        ("other_modality", "serves images only"),
        ("no_placeholders", "required"),
        ("a_string", "valid dictionary"),
    ],
)
async def test_generate_refuses_features_that_do_not_fit_the_tokens(
    engine: LocalEngine, http: aiohttp.ClientSession, figure_render: dict[str, Any], case: str, words: str
) -> None:
    status, answer = await post(http, engine, GENERATE, mutated(figure_render, case))
    assert status == 400, answer
    error = answer["error"]
    assert words in error["message"]
    assert (error["type"], error["param"]) == ("BadRequestError", "features")
    assert engine.live_request_ids() == []


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (
            image_part("https://example.com/figure.png"),
            "fetching remote images is not supported by the embedded engine (messages[0].content[0])",
        ),
        (image_part("http://127.0.0.1:1/figure.png"), "fetching remote images is not supported by the embedded engine"),
        (image_part("file:///tmp/figure.png"), "file:// URLs"),
        (image_part("/tmp/figure.png"), "The URL must be either a HTTP, data or file URL"),
        (
            image_part("data:image/png;base64,bm90IGFuIGltYWdl"),
            "Failed to load image (messages[0].content[0]): the data is not an image",
        ),
        (image_part("data:image/png,rawbytes"), "Only base64 data URLs"),
        ({"type": "image", "image": "figure.png"}, "media part of type 'image'"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "serves images only"),
        ({"type": "image_url", "image_url": {"detail": "auto"}}, "image_url must be"),
    ],
)
async def test_render_refuses_images_it_cannot_read_with_a_message(
    engine: LocalEngine, http: aiohttp.ClientSession, part: dict[str, Any], words: str
) -> None:
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    status, answer = await post(http, engine, RENDER, {"messages": messages})
    assert status == 400, answer
    assert words in answer["error"]["message"]
    assert answer["error"]["code"] == 400


async def test_a_placeholder_typed_as_text_does_not_count_as_an_image(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    content = [image_part(data_url(FIGURE)), {"type": "text", "text": f"<|vision_start|>{PAD}<|vision_end|>"}]
    status, answer = await post(http, engine, RENDER, {"messages": [{"role": "user", "content": content}]})
    assert status == 400
    assert "rendered 2 <|image_pad|> placeholder(s) for 1 image part(s)" in answer["error"]["message"]


async def test_mm_payload_none_renders_no_tensors_and_generate_then_asks_for_them(
    engine: LocalEngine, http: aiohttp.ClientSession, figure_render: dict[str, Any]
) -> None:
    status, body = await post(http, engine, RENDER, {"messages": FIGURE_MESSAGES, "mm_payload": "none"})
    assert status == 200
    features = body["features"]
    assert features["kwargs_data"] is None and features["mm_metadata"] is None
    assert features["mm_placeholders"] == figure_render["features"]["mm_placeholders"]
    assert body["token_ids"] == figure_render["token_ids"]
    status, answer = await post(http, engine, GENERATE, {**body, "sampling_params": {"max_tokens": 2}})
    assert status == 400
    assert "keeps no multimodal cache" in answer["error"]["message"]


async def test_an_image_prompt_longer_than_the_context_gets_400(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    big = draw_figure(1024, 1024, (10, 120, 10))  # 1296 pad tokens > MAX_MODEL_LEN
    status, answer = await post(
        http, engine, RENDER, {"messages": [{"role": "user", "content": [image_part(data_url(big))]}]}
    )
    assert status == 400
    assert "maximum context length is 512 tokens" in answer["error"]["message"]


async def test_the_engine_exposes_the_merge_size_and_placeholder_for_the_client_check(
    engine: LocalEngine, tokenizer: Any
) -> None:
    from transformers import Qwen2VLImageProcessorPil

    assert engine.image_merge_size == LocalEngine().image_merge_size == Qwen2VLImageProcessorPil().merge_size == 2
    assert engine.image_placeholder_token == RolloutConfig.image_placeholder_token == PAD
    assert tokenizer.convert_tokens_to_ids(PAD) == 151_655


async def test_the_default_request_limit_fits_a_generate_body_with_the_largest_image() -> None:
    patches = 28 * 28 * 1280 // 14**2  # the processor's max_pixels, in 14 x 14 patches
    base64_bytes = patches * 3 * 2 * 14 * 14 * 4 * 4 // 3  # float32 rows of 1176 values, base64
    assert base64_bytes > 30_000_000
    assert 4 * base64_bytes < DEFAULT_MAX_REQUEST_BYTES


async def test_a_tokenizer_without_the_image_placeholder_refuses_images() -> None:
    from types import SimpleNamespace

    from fsm_rollout.engine.local.images import ImageSupport
    from fsm_rollout.engine.local.protocol import ImageFeatures
    from fsm_rollout.engine.schema import RequestError

    text_only = SimpleNamespace(convert_tokens_to_ids=lambda token: 0, unk_token_id=0)  # every token is unknown
    support = ImageSupport(text_only)
    assert support.pad_token_id is None
    with pytest.raises(RequestError, match="has no <\\|image_pad\\|> token") as caught:
        support.render([1, 2], [data_url(FIGURE)], with_tensors=True)
    assert caught.value.status == 400
    with pytest.raises(RequestError, match="has no <\\|image_pad\\|> token"):
        support.check_features(ImageFeatures(placeholders=((0, 1),), items=(None,), metadata=(None,)), [1])


async def test_render_answers_while_the_worker_is_busy_between_decode_steps(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    """Rendering runs on the engine's front-end thread: a worker held inside a task (as inside a long decode step)
    does not hold a render up."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold_the_worker() -> None:
        held.set()
        release.wait(300)

    holding = asyncio.ensure_future(engine._require_scheduler().run_task(hold_the_worker))
    try:
        await asyncio.wait_for(asyncio.to_thread(held.wait, 300), 300)
        status, body = await asyncio.wait_for(post(http, engine, RENDER, {"messages": MESSAGES}), 120)
        assert status == 200 and body["token_ids"]
        assert not holding.done()  # the worker was held throughout
    finally:
        release.set()
        await holding


async def test_metrics_publish_the_running_batch_the_queue_and_the_kv_use_as_vllm_names_them(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    from fsm_rollout.engine.load import EngineLoad, parse_metrics

    ids = ["load-1", "load-2", "load-3"]  # two decode, the third waits
    tasks = []
    for rid in ids:
        tasks.append(asyncio.create_task(generate(http, engine, prompt, request_id=rid, max_tokens=450)))
        await wait_until(lambda rid=rid: rid in engine.live_request_ids())
    await wait_until(lambda: all(engine.live_token_counts().get(rid, 0) >= 1 for rid in ids[:2]), within=60.0)
    await engine.pause("keep")  # frozen: the counts hold still while they are read
    try:
        counts = engine.live_token_counts()
        async with http.get(engine.url + "/metrics") as response:
            assert response.status == 200
            page = await response.text()
    finally:
        await post(http, engine, ABORT, {"request_ids": ids})
        await engine.resume()
    await asyncio.gather(*tasks)
    assert f'vllm:num_requests_running{{engine="0",model_name="{TINY_MODEL_NAME}"}} 2.0' in page.splitlines()
    held = sum(len(prompt) + counts[rid] for rid in ids[:2])
    assert parse_metrics(page) == EngineLoad(
        running=2, waiting=1, kv_cache_usage=held / (2 * MAX_MODEL_LEN), preemptions=0
    )
    assert engine.load() == EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, preemptions=0)
