"""The embedded engine's weight-update endpoints (pause, resume, weight versions, new weights), over real HTTP.

One engine (the tiny random Qwen2) serves the module; every test leaves it resumed, at version "default" and with
its original weights. A request is caught mid-generation by a long ``max_tokens`` with ``ignore_eos`` and by
watching the engine's token counts, never by sleeping; a frozen request is shown frozen by running worker tasks
(renders) and seeing its token count stay put.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch
from engine_http import generate, post
from engine_http import logprob_values as logprobs
from safetensors.torch import load_file, save_file

from fsm_rollout import VLLMClient
from fsm_rollout.engine.local import LocalEngine, WeightLoadError

pytestmark = pytest.mark.asyncio(loop_scope="module")

RENDER = "/v1/chat/completions/render"
ABORT = "/inference/v1/abort_requests"
MAX_MODEL_LEN = 512
MESSAGES = [{"role": "user", "content": "Count to ten."}]
REFERENCE_TOKENS = 96  # long enough to pause inside, short enough to run to the end a few times
LONG = 450  # a generation that is still running when the test acts on it
POLLS = 2000  # bounded polling: 0.01 s waits, far beyond what any condition here needs
PERTURBED = "model.layers.0.mlp.down_proj.weight"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine(max_model_len=MAX_MODEL_LEN, torch_threads=1) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prompt(engine: LocalEngine, http: aiohttp.ClientSession) -> list[int]:
    status, body = await post(http, engine, RENDER, {"messages": MESSAGES})
    assert status == 200
    token_ids: list[int] = body["token_ids"]
    return token_ids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]) -> dict[str, Any]:
    """The uninterrupted greedy answer every interrupted one is compared with."""
    return await greedy(http, engine, prompt, "reference", REFERENCE_TOKENS)


@pytest.fixture(scope="module")
def original_weights(engine: LocalEngine) -> dict[str, torch.Tensor]:
    return load_file(str(engine.model_dir / "model.safetensors"))


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def clean_engine(engine: LocalEngine) -> AsyncIterator[None]:
    yield
    await engine.resume()
    await engine.update_weight_version("default")
    assert engine.live_request_ids() == []


async def get(http: aiohttp.ClientSession, engine: LocalEngine, path: str) -> Any:
    async with http.get(engine.url + path) as response:
        assert response.status == 200
        return await response.json()


async def greedy(
    http: aiohttp.ClientSession, engine: LocalEngine, token_ids: list[int], request_id: str, max_tokens: int
) -> dict[str, Any]:
    return await generate(http, engine, token_ids, request_id, temperature=0.0, max_tokens=max_tokens)


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(POLLS):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never reached the state the test waits for")


async def started(engine: LocalEngine, request_id: str) -> None:
    """Wait until ``request_id`` runs on the engine and has sampled at least one token."""
    await until(lambda: engine.live_token_counts().get(request_id, 0) >= 1)


async def worker_round_trips(http: aiohttp.ClientSession, engine: LocalEngine, count: int = 3) -> None:
    """Renders run on the worker between decode steps: after these, a decode step would have had its chances."""
    for _ in range(count):
        status, _ = await post(http, engine, RENDER, {"messages": MESSAGES})
        assert status == 200


def perturbed(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New values for two parameters: one layer's MLP output zeroed, and the final norm negated, which turns the
    logits around, so that greedy decoding (which repeats one token on this random model) picks other tokens."""
    return {PERTURBED: torch.zeros_like(original[PERTURBED]), "model.norm.weight": -original["model.norm.weight"]}


def spans(*parts: tuple[str, int, int]) -> list[dict[str, Any]]:
    return [{"version": version, "start": start, "end": end} for version, start, end in parts]


def assert_spans_cover(choice: dict[str, Any]) -> None:
    """The spans are in order, merged, and cover every output token exactly once."""
    position = 0
    previous = None
    for span in choice["weight_versions"]:
        assert span["start"] == position < span["end"]
        assert span["version"] != previous
        position, previous = span["end"], span["version"]
    assert position == len(choice["token_ids"])


# -------------------------------------------------------------------- pause state and versions


async def test_pause_and_resume_answer_vllms_bodies_and_are_idempotent(
    engine: LocalEngine, http: aiohttp.ClientSession
) -> None:
    assert await get(http, engine, "/is_paused") == {"is_paused": False}
    assert await post(http, engine, "/resume") == (200, {"status": "resumed"})  # not paused: fine
    assert await post(http, engine, "/pause") == (200, {"status": "paused"})  # vLLM's default mode, abort
    assert await post(http, engine, "/pause", mode="keep") == (200, {"status": "paused"})  # twice: fine
    assert await get(http, engine, "/is_paused") == {"is_paused": True}
    assert engine.is_paused
    assert await post(http, engine, "/resume") == (200, {"status": "resumed"})
    assert await get(http, engine, "/is_paused") == {"is_paused": False}
    assert not engine.is_paused


async def test_the_weight_version_starts_at_default_and_labels_the_tokens_sampled_after_it_is_set(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    assert await get(http, engine, "/weight_info") == {"weight_version": "default"}
    before = await greedy(http, engine, prompt, "before-version", 3)
    assert before["weight_versions"] == spans(("default", 0, 3))
    status, body = await post(http, engine, "/update_weight_version", {"new_version": "step-7"})
    assert (status, body) == (200, {"success": True, "new_version": "step-7"})
    assert await get(http, engine, "/weight_info") == {"weight_version": "step-7"}
    assert engine.weight_version == "step-7"
    after = await greedy(http, engine, prompt, "after-version", 3)
    assert after["weight_versions"] == spans(("step-7", 0, 3))
    assert after["token_ids"] == before["token_ids"]  # only the label changed


async def test_the_library_client_pauses_resumes_and_sets_the_version(engine: LocalEngine) -> None:
    async with VLLMClient(engine.url) as client:
        await client.pause("keep")
        assert engine.is_paused
        await client.update_weight_version("client-v1")
        assert engine.weight_version == "client-v1"
        await client.resume()
        assert not engine.is_paused


# -------------------------------------------------------------------- keep


async def test_keep_freezes_a_running_request_and_resume_carries_on_with_the_new_version_split_at_the_pause(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int], reference: dict[str, Any]
) -> None:
    running = asyncio.create_task(greedy(http, engine, prompt, "keep-1", REFERENCE_TOKENS))
    await started(engine, "keep-1")
    assert await post(http, engine, "/pause", mode="keep") == (200, {"status": "paused"})
    frozen_at = engine.live_token_counts()["keep-1"]
    assert 1 <= frozen_at < REFERENCE_TOKENS

    # A request arriving now is accepted and waits; render still works; no decode step runs.
    queued = asyncio.create_task(greedy(http, engine, prompt, "keep-2", 4))
    await until(lambda: "keep-2" in engine.live_request_ids())
    await worker_round_trips(http, engine)
    assert engine.live_token_counts() == {"keep-1": frozen_at, "keep-2": 0}
    assert not running.done() and not queued.done()

    assert await post(http, engine, "/update_weight_version", {"new_version": "v2"}) == (
        200,
        {"success": True, "new_version": "v2"},
    )
    assert await post(http, engine, "/resume") == (200, {"status": "resumed"})
    choice = await running
    # Carried on where it was: the same tokens and logprobs as without the pause, nothing recomputed.
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == reference["token_ids"]
    assert logprobs(choice) == logprobs(reference)
    assert choice["weight_versions"] == spans(("default", 0, frozen_at), ("v2", frozen_at, REFERENCE_TOKENS))
    assert_spans_cover(choice)
    later = await queued
    assert later["token_ids"] == reference["token_ids"][:4]
    assert later["weight_versions"] == spans(("v2", 0, 4))


async def test_abort_requests_answers_a_frozen_request_while_paused(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int]
) -> None:
    running = asyncio.create_task(greedy(http, engine, prompt, "frozen-abort", LONG))
    await started(engine, "frozen-abort")
    await engine.pause("keep")
    frozen_at = engine.live_token_counts()["frozen-abort"]
    assert await post(http, engine, ABORT, {"request_ids": ["frozen-abort"]}) == (200, None)
    choice = await asyncio.wait_for(running, 30)  # answered while the engine stays paused
    assert engine.is_paused
    assert choice["finish_reason"] == "abort"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == frozen_at
    assert choice["weight_versions"] == spans(("default", 0, frozen_at))


# -------------------------------------------------------------------- abort


async def test_abort_mode_ends_running_and_queued_requests_with_their_partial_tokens(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int], reference: dict[str, Any]
) -> None:
    running = asyncio.create_task(
        generate(http, engine, prompt, "abort-1", temperature=0.0, max_tokens=LONG, logprobs=2)
    )
    await started(engine, "abort-1")
    assert await post(http, engine, "/pause", mode="abort") == (200, {"status": "paused"})
    choice = await running
    produced = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort"
    assert 1 <= produced < LONG
    compared = min(produced, REFERENCE_TOKENS)
    assert choice["token_ids"][:compared] == reference["token_ids"][:compared]
    assert len(choice["logprobs"]["content"]) == produced
    assert all(len(entry["top_logprobs"]) >= 2 for entry in choice["logprobs"]["content"])
    assert choice["weight_versions"] == spans(("default", 0, produced))
    assert engine.live_request_ids() == []

    # Paused: a new request waits (accepted, no token) until resume; aborted there, it has no tokens and no spans.
    held = asyncio.create_task(greedy(http, engine, prompt, "abort-held", 4))
    await until(lambda: "abort-held" in engine.live_request_ids())
    await worker_round_trips(http, engine, 1)
    assert engine.live_token_counts() == {"abort-held": 0}
    await post(http, engine, ABORT, {"request_ids": ["abort-held"]})
    empty = await held
    assert (empty["finish_reason"], empty["token_ids"], empty["weight_versions"]) == ("abort", [], [])

    waiting = asyncio.create_task(greedy(http, engine, prompt, "abort-after", 4))
    await until(lambda: "abort-after" in engine.live_request_ids())
    await engine.resume()
    after = await waiting
    assert (after["finish_reason"], after["token_ids"]) == ("length", reference["token_ids"][:4])


async def test_greedy_continuation_after_an_abort_pause_gives_the_uninterrupted_tokens(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int], reference: dict[str, Any]
) -> None:
    running = asyncio.create_task(greedy(http, engine, prompt, "cont-1", REFERENCE_TOKENS))
    await started(engine, "cont-1")
    await engine.pause("abort")
    partial = await running
    k = len(partial["token_ids"])
    assert partial["finish_reason"] == "abort"
    assert 1 <= k < REFERENCE_TOKENS
    await engine.resume()

    # The partial tokens join the prompt (a prefill now, incremental decode before): the rest must match.
    rest = await greedy(http, engine, prompt + partial["token_ids"], "cont-2", REFERENCE_TOKENS - k)
    assert partial["token_ids"] + rest["token_ids"] == reference["token_ids"]
    joined = logprobs(partial) + logprobs(rest)
    difference = max(abs(a - b) for a, b in zip(joined, logprobs(reference), strict=True))
    assert difference <= 1e-5, difference


# -------------------------------------------------------------------- wait


async def test_wait_mode_lets_the_requests_in_flight_finish_and_holds_new_ones_until_resume(
    engine: LocalEngine, http: aiohttp.ClientSession, prompt: list[int], reference: dict[str, Any]
) -> None:
    running = asyncio.create_task(greedy(http, engine, prompt, "wait-1", REFERENCE_TOKENS))
    await started(engine, "wait-1")
    assert await post(http, engine, "/pause", mode="wait") == (200, {"status": "paused"})
    # The pause returned only after the request finished, and it finished normally.
    assert "wait-1" not in engine.live_request_ids()
    finished = await running
    assert finished["finish_reason"] == "length"
    assert finished["token_ids"] == reference["token_ids"]
    assert engine.is_paused

    arriving = asyncio.create_task(greedy(http, engine, prompt, "wait-2", 4))
    await until(lambda: "wait-2" in engine.live_request_ids())
    await worker_round_trips(http, engine)
    assert engine.live_token_counts() == {"wait-2": 0}
    assert not arriving.done()
    await post(http, engine, "/resume")
    later = await arriving
    assert (later["finish_reason"], later["token_ids"]) == ("length", reference["token_ids"][:4])


async def test_wait_mode_with_nothing_in_flight_returns_at_once(engine: LocalEngine) -> None:
    await asyncio.wait_for(engine.pause("wait"), 30)
    assert engine.is_paused


# -------------------------------------------------------------------- new weights


async def test_load_weights_in_process_changes_the_greedy_output_and_sets_the_version(
    engine: LocalEngine,
    http: aiohttp.ClientSession,
    prompt: list[int],
    reference: dict[str, Any],
    original_weights: dict[str, torch.Tensor],
) -> None:
    try:
        await engine.load_weights(perturbed(original_weights), version="perturbed")
        assert engine.weight_version == "perturbed"
        after = await greedy(http, engine, prompt, "perturbed", 8)
        assert after["token_ids"] != reference["token_ids"][:8]
        assert logprobs(after) != logprobs(reference)[:8]
        assert after["weight_versions"] == spans(("perturbed", 0, 8))
    finally:
        await engine.load_weights(original_weights)
    assert engine.weight_version == "perturbed"  # no version given: the version stays
    restored = await greedy(http, engine, prompt, "restored", 8)
    assert restored["token_ids"] == reference["token_ids"][:8]
    assert logprobs(restored) == logprobs(reference)[:8]


async def test_update_weights_over_http_loads_a_safetensors_file_and_sets_the_version(
    engine: LocalEngine,
    http: aiohttp.ClientSession,
    prompt: list[int],
    reference: dict[str, Any],
    original_weights: dict[str, torch.Tensor],
    tmp_path: pathlib.Path,
) -> None:
    file = tmp_path / "step-1.safetensors"
    save_file(perturbed(original_weights), str(file))
    try:
        status, body = await post(
            http, engine, "/update_weights", {"update_info": {"path": str(file), "weight_version": "step-1"}}
        )
        assert (status, body) == (200, {"message": "Weights updated"})
        assert await get(http, engine, "/weight_info") == {"weight_version": "step-1"}
        after = await greedy(http, engine, prompt, "step-1", 8)
        assert after["token_ids"] != reference["token_ids"][:8]
        assert logprobs(after) != logprobs(reference)[:8]
        assert after["weight_versions"] == spans(("step-1", 0, 8))
    finally:
        status, body = await post(
            http, engine, "/update_weights", {"update_info": {"path": str(engine.model_dir / "model.safetensors")}}
        )
    assert status == 200, body
    assert await get(http, engine, "/weight_info") == {"weight_version": "step-1"}  # null/missing: unchanged
    restored = await greedy(http, engine, prompt, "restored-http", 8)
    assert restored["token_ids"] == reference["token_ids"][:8]
    assert logprobs(restored) == logprobs(reference)[:8]


async def test_weights_loaded_during_a_keep_pause_apply_to_the_tokens_after_it(
    engine: LocalEngine,
    http: aiohttp.ClientSession,
    prompt: list[int],
    reference: dict[str, Any],
    original_weights: dict[str, torch.Tensor],
) -> None:
    running = asyncio.create_task(greedy(http, engine, prompt, "mid-load", REFERENCE_TOKENS))
    await started(engine, "mid-load")
    await engine.pause("keep")
    frozen_at = engine.live_token_counts()["mid-load"]
    try:
        await engine.load_weights(perturbed(original_weights), version="v-new")
        await engine.resume()
        choice = await running
    finally:
        await engine.load_weights(original_weights)
    # The tokens before the pause are the old weights'; the first one sampled after the load is the new weights'.
    assert choice["token_ids"][:frozen_at] == reference["token_ids"][:frozen_at]
    assert logprobs(choice)[:frozen_at] == logprobs(reference)[:frozen_at]
    assert choice["token_ids"][frozen_at] != reference["token_ids"][frozen_at]
    assert choice["weight_versions"] == spans(("default", 0, frozen_at), ("v-new", frozen_at, REFERENCE_TOKENS))


# -------------------------------------------------------------------- errors


async def test_a_bad_pause_mode_is_400_with_vllms_error_body(engine: LocalEngine, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, engine, "/pause", mode="freeze")
    assert status == 400
    assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"
    assert body["error"]["param"] == "mode"
    assert "'abort', 'wait', 'keep'" in body["error"]["message"] and "'freeze'" in body["error"]["message"]
    assert not engine.is_paused
    with pytest.raises(ValueError, match="freeze"):
        await engine.pause("freeze")  # type: ignore[arg-type]


@pytest.mark.parametrize("body", [{}, {"new_version": None}, {"new_version": 3}, {"version": "v"}])
async def test_a_bad_weight_version_body_is_400(engine: LocalEngine, http: aiohttp.ClientSession, body: Any) -> None:
    status, answer = await post(http, engine, "/update_weight_version", body)
    assert status == 400
    assert answer["error"]["param"] == "new_version"
    assert "new_version" in answer["error"]["message"]
    assert engine.weight_version == "default"


async def test_update_weights_refuses_a_missing_file_unknown_names_and_wrong_shapes_with_clear_400s(
    engine: LocalEngine,
    http: aiohttp.ClientSession,
    prompt: list[int],
    reference: dict[str, Any],
    original_weights: dict[str, torch.Tensor],
    tmp_path: pathlib.Path,
) -> None:
    async def refused(body: Any) -> str:
        status, answer = await post(http, engine, "/update_weights", body)
        assert status == 400, answer
        message: str = answer["error"]["message"]
        return message

    assert "update_info" in await refused({})
    assert "path" in await refused({"update_info": {"weight_version": "v"}})
    assert "weight_version" in await refused({"update_info": {"path": "x.safetensors", "weight_version": 1}})
    missing = tmp_path / "missing.safetensors"
    assert str(missing) in await refused({"update_info": {"path": str(missing)}})
    not_safetensors = tmp_path / "notes.safetensors"
    not_safetensors.write_text("not a tensor file")
    assert "cannot read" in await refused({"update_info": {"path": str(not_safetensors)}})

    unknown = tmp_path / "unknown.safetensors"
    save_file({"model.layers.9.mlp.nope.weight": torch.zeros(2), **perturbed(original_weights)}, str(unknown))
    message = await refused({"update_info": {"path": str(unknown), "weight_version": "never"}})
    assert "unknown parameter names: model.layers.9.mlp.nope.weight" in message
    wrong_shape = tmp_path / "wrong-shape.safetensors"
    save_file({"model.norm.weight": torch.zeros(3)}, str(wrong_shape))
    message = await refused({"update_info": {"path": str(wrong_shape)}})
    assert "shape mismatches: model.norm.weight [3] (the model's is [64])" in message

    # Nothing was loaded, not even the valid tensor beside the unknown name, and the version is unchanged.
    assert engine.weight_version == "default"
    unchanged = await greedy(http, engine, prompt, "unchanged", 8)
    assert logprobs(unchanged) == logprobs(reference)[:8]


async def test_load_weights_in_process_names_unknown_parameters_and_shape_mismatches(
    engine: LocalEngine, original_weights: dict[str, torch.Tensor]
) -> None:
    with pytest.raises(WeightLoadError, match=r"unknown parameter names: bogus\.weight") as raised:
        await engine.load_weights({"bogus.weight": torch.zeros(1), "model.norm.weight": torch.zeros(5)}, "never")
    assert "shape mismatches: model.norm.weight [5] (the model's is [64])" in str(raised.value)
    assert engine.weight_version == "default"
