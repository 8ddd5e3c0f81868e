"""The fake vLLM server's weight-update side over real HTTP on loopback: partial answers of aborted requests,
continuations of interrupted turns, pause/resume in its three modes, and weight-version spans."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from fsm_rollout import VLLMClient
from fsm_rollout.testing.fake_vllm import (
    ABORT_PATH,
    GENERATE_PATH,
    IS_PAUSED_PATH,
    OMIT,
    PAUSE_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_INFO_PATH,
    FakeVLLMServer,
    ScriptedTurn,
)

MODEL = "fake-model"
PROMPT = [101, 102, 103]
STOP_TEXT = "The answer is 42.</answer> and then some more words here."
LONG_TEXT = "Let me think step by step about six times seven."


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def _post(
    http: aiohttp.ClientSession, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as response:
        return response.status, await response.json(content_type=None)


async def _generate(
    http: aiohttp.ClientSession,
    server: FakeVLLMServer,
    prompt: list[int],
    sampling_params: dict[str, Any] | None = None,
    *,
    request_id: str | None = None,
    session: str | None = None,
) -> dict[str, Any]:
    sampling = sampling_params or {"max_tokens": 64}
    body: dict[str, Any] = {"model": MODEL, "token_ids": prompt, "sampling_params": sampling}
    if request_id is not None:
        body["request_id"] = request_id
    headers = {"x-session-id": session} if session is not None else None
    status, answer = await _post(http, server.url + GENERATE_PATH, body, headers)
    assert status == 200, answer
    return answer


def _choice(answer: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = answer["choices"][0]
    return choice


def _tokens(answer: dict[str, Any]) -> list[int]:
    return list(_choice(answer)["token_ids"])


def _logprobs(answer: dict[str, Any]) -> list[float]:
    return [entry["logprob"] for entry in _choice(answer)["logprobs"]["content"]]


def _spans(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_choice(answer)["weight_versions"])


def _span(version: str, start: int, end: int) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


async def _held(
    http: aiohttp.ClientSession,
    server: FakeVLLMServer,
    prompt: list[int],
    sampling_params: dict[str, Any] | None = None,
    *,
    request_id: str,
    session: str | None = None,
) -> asyncio.Task[dict[str, Any]]:
    """A generate request sent in the background, returned once the server holds it."""
    task = asyncio.create_task(_generate(http, server, prompt, sampling_params, request_id=request_id, session=session))
    await asyncio.wait_for(server.wait_until(lambda: request_id in server.held_request_ids), timeout=5)
    return task


async def _uninterrupted(
    http: aiohttp.ClientSession, server: FakeVLLMServer, turn: ScriptedTurn, sampling_params: dict[str, Any]
) -> dict[str, Any]:
    """The answer the turn gets without holds or interruptions, from a session of its own."""
    server.script([turn], session="reference")
    return await _generate(http, server, PROMPT, sampling_params, session="reference")


def _unheld(turn: ScriptedTurn) -> ScriptedTurn:
    return ScriptedTurn(text=turn.text, token_ids=turn.token_ids, logprobs=turn.logprobs, finish=turn.finish)


# ------------------------------------------------------------------ partial answers of aborted requests


async def test_abort_requests_answers_a_held_turn_with_its_first_tokens(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text=LONG_TEXT, held_after=3, hang=True)])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    # vLLM's internal id alone reaches the request too
    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["generate-tokens-r-1"]})
    answer = await asyncio.wait_for(pending, timeout=5)

    expected = tokenizer.encode(LONG_TEXT, add_special_tokens=False)[:3]
    assert _choice(answer)["finish_reason"] == "abort"
    assert _tokens(answer) == expected
    assert _logprobs(answer) == [-0.01, -0.02, -0.03]
    assert _spans(answer) == [_span("default", 0, 3)]
    assert answer["usage"]["completion_tokens"] == 3
    assert "weight_version" not in answer
    assert fake_vllm.interrupted_request_ids == ["r-1"]
    assert fake_vllm.held_request_ids == []


async def test_a_held_turn_without_held_after_aborts_with_no_tokens_and_is_not_continued(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6], delay=60.0), ScriptedTurn(token_ids=[9])])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["r-1"]})
    aborted = await asyncio.wait_for(pending, timeout=5)
    again = await _generate(http, fake_vllm, PROMPT)

    assert (_choice(aborted)["finish_reason"], _tokens(aborted), _spans(aborted)) == ("abort", [], [])
    assert _tokens(again) == [9]
    assert fake_vllm.continuation_request_ids == []


async def test_a_partial_answer_is_cut_like_the_whole_output(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script(
        [
            ScriptedTurn(token_ids=[5, 6, 7, 8, 9], held_after=4, hang=True),
            ScriptedTurn(token_ids=[5, 6, 7], held_after=10, hang=True),
        ]
    )
    capped = await _held(http, fake_vllm, PROMPT, {"max_tokens": 2}, request_id="capped")
    short = await _held(http, fake_vllm, PROMPT, {"max_tokens": 8, "stop_token_ids": [6]}, request_id="short")

    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["capped", "short"]})

    assert _tokens(await asyncio.wait_for(capped, timeout=5)) == [5, 6]
    assert _tokens(await asyncio.wait_for(short, timeout=5)) == [5, 6]


async def test_a_request_that_is_not_aborted_answers_the_whole_turn_when_released(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7], held_after=1, hang=True)])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    assert fake_vllm.release("generate-tokens-r-1") == 1
    answer = await asyncio.wait_for(pending, timeout=5)

    assert (_choice(answer)["finish_reason"], _tokens(answer)) == ("stop", [5, 6, 7])
    assert _spans(answer) == [_span("default", 0, 3)]
    assert fake_vllm.interrupted_request_ids == []


async def test_pause_in_abort_mode_answers_every_held_request_with_its_partial_output(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7], held_after=1, hang=True)], session="a")
    fake_vllm.script([ScriptedTurn(token_ids=[8, 9], held_after=2, delay=60.0)], session="b")
    first = await _held(http, fake_vllm, PROMPT, request_id="a-1", session="a")
    second = await _held(http, fake_vllm, PROMPT, request_id="b-1", session="b")

    await client.pause("abort")

    # pause answers once the server has answered the aborted requests
    assert sorted(fake_vllm.interrupted_request_ids) == ["a-1", "b-1"]
    assert fake_vllm.waiting_request_ids == []
    first_answer, second_answer = await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
    assert (_choice(first_answer)["finish_reason"], _tokens(first_answer)) == ("abort", [5])
    assert (_choice(second_answer)["finish_reason"], _tokens(second_answer)) == ("abort", [8, 9])
    assert fake_vllm.paused and fake_vllm.pause_mode == "abort"
    assert fake_vllm.aborted_request_ids == []  # nothing was named by abort_requests


# ------------------------------------------------------------------ continuations


async def test_a_continuation_answers_the_rest_of_the_turn_across_a_stop_string(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    sampling = {"max_tokens": 32, "stop": ["</answer>"]}
    turn = ScriptedTurn(text=STOP_TEXT, held_after=7, hang=True)
    reference = await _uninterrupted(http, fake_vllm, _unheld(turn), sampling)
    # the stop string starts inside the partial output and ends in the continuation
    assert "</answer>" not in tokenizer.decode(_tokens(reference)[:7])
    assert len(_tokens(reference)) == 9
    fake_vllm.script([turn])
    pending = await _held(http, fake_vllm, PROMPT, sampling, request_id="r-1")

    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["r-1"]})
    partial = await asyncio.wait_for(pending, timeout=5)
    continuation = await _generate(
        http, fake_vllm, PROMPT + _tokens(partial), {**sampling, "max_tokens": 32 - 7}, request_id="r-1-c"
    )

    assert _tokens(partial) + _tokens(continuation) == _tokens(reference)
    assert _logprobs(partial) + _logprobs(continuation) == _logprobs(reference)
    assert _choice(continuation)["finish_reason"] == "stop"
    assert _spans(continuation) == [_span("default", 0, 2)]
    assert continuation["usage"] == {
        "prompt_tokens": len(PROMPT) + 7,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": None,  # vLLM's null details, sent since the conformance suite
        "completion_tokens_details": None,
    }
    assert fake_vllm.continuation_request_ids == ["r-1-c"]


async def test_one_turn_interrupted_three_times_equals_the_uninterrupted_turn(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    ids = list(range(200, 212))
    logprobs = [-0.5 - i for i in range(12)]
    turn = ScriptedTurn(token_ids=ids, logprobs=logprobs, held_after=2, held_again_after=(3, 0), hang=True)
    reference = await _uninterrupted(http, fake_vllm, _unheld(turn), {"max_tokens": 20})
    fake_vllm.script([turn], session="s")

    answers: list[dict[str, Any]] = []
    prompt, max_tokens = list(PROMPT), 20
    for number in range(3):  # held after 2, then 3 more, then 0 more: each one aborted differently
        pending = await _held(
            http, fake_vllm, prompt, {"max_tokens": max_tokens}, request_id=f"r-{number}", session="s"
        )
        if number == 1:
            await _post(http, fake_vllm.url + PAUSE_PATH + "?mode=abort")
            await _post(http, fake_vllm.url + RESUME_PATH)
        else:
            await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": [f"r-{number}"]})
        answers.append(await asyncio.wait_for(pending, timeout=5))
        prompt += _tokens(answers[-1])
        max_tokens -= len(_tokens(answers[-1]))
    # past held_again_after the continuation answers at once
    answers.append(await _generate(http, fake_vllm, prompt, {"max_tokens": max_tokens}, request_id="r-3", session="s"))

    assert [len(_tokens(answer)) for answer in answers] == [2, 3, 0, 7]
    assert [_choice(answer)["finish_reason"] for answer in answers] == ["abort", "abort", "abort", "stop"]
    assert [token for answer in answers for token in _tokens(answer)] == ids == _tokens(reference)
    assert [lp for answer in answers for lp in _logprobs(answer)] == logprobs == _logprobs(reference)
    assert fake_vllm.continuation_request_ids == ["r-1", "r-2", "r-3"]
    assert fake_vllm.interrupted_request_ids == ["r-0", "r-1", "r-2"]


async def test_a_continuation_counts_max_tokens_from_its_own_output(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    turn = ScriptedTurn(text=LONG_TEXT, held_after=2, hang=True)
    reference = await _uninterrupted(http, fake_vllm, _unheld(turn), {"max_tokens": 6})
    fake_vllm.script([turn])
    pending = await _held(http, fake_vllm, PROMPT, {"max_tokens": 6}, request_id="r-1")

    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["r-1"]})
    partial = await asyncio.wait_for(pending, timeout=5)
    continuation = await _generate(http, fake_vllm, PROMPT + _tokens(partial), {"max_tokens": 4})

    assert _choice(reference)["finish_reason"] == _choice(continuation)["finish_reason"] == "length"
    assert _tokens(partial) + _tokens(continuation) == _tokens(reference)
    assert _logprobs(partial) + _logprobs(continuation) == _logprobs(reference)


async def test_other_token_ids_or_another_session_draw_the_next_scripted_turn(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7], held_after=2, hang=True), ScriptedTurn(token_ids=[1])])
    fake_vllm.script([ScriptedTurn(token_ids=[2])], session="other")
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")
    await _post(http, fake_vllm.url + ABORT_PATH, {"request_ids": ["r-1"]})
    partial = await asyncio.wait_for(pending, timeout=5)

    wrong_ids = await _generate(http, fake_vllm, [*PROMPT, 5])
    other_session = await _generate(http, fake_vllm, PROMPT + _tokens(partial), session="other")
    continued = await _generate(http, fake_vllm, PROMPT + _tokens(partial), {"max_tokens": 62})

    assert (_tokens(wrong_ids), _tokens(other_session), _tokens(continued)) == ([1], [2], [7])
    assert len(fake_vllm.continuation_request_ids) == 1


async def test_concurrent_interrupted_turns_of_one_queue_are_told_apart_by_their_ids(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script(
        [
            ScriptedTurn(token_ids=[5, 6, 7], held_after=1, hang=True),
            ScriptedTurn(token_ids=[8, 9], held_after=1, hang=True),
        ]
    )
    first = await _held(http, fake_vllm, [1], request_id="r-1")
    second = await _held(http, fake_vllm, [2], request_id="r-2")
    await _post(http, fake_vllm.url + PAUSE_PATH + "?mode=abort")
    await _post(http, fake_vllm.url + RESUME_PATH)
    first_answer, second_answer = await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
    assert (_tokens(first_answer), _tokens(second_answer)) == ([5], [8])

    # continued in the other order
    assert _tokens(await _generate(http, fake_vllm, [2, 8])) == [9]
    assert _tokens(await _generate(http, fake_vllm, [1, 5])) == [6, 7]


# ------------------------------------------------------------------ pause modes


async def test_keep_freezes_a_held_request_and_splits_its_versions_at_held_after(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7, 8, 9], held_after=2, hang=True)])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    await client.pause("keep")
    fake_vllm.release("r-1")  # finished while frozen: it must still wait for resume
    assert (await _get(http, fake_vllm.url + IS_PAUSED_PATH)) == (200, {"is_paused": True})
    assert fake_vllm.held_request_ids == ["r-1"] and not pending.done()
    await client.update_weight_version("v2")
    await client.resume()
    await client.update_weight_version("v3")  # after resume: no token of the frozen request has it
    answer = await asyncio.wait_for(pending, timeout=5)

    assert (_choice(answer)["finish_reason"], _tokens(answer)) == ("stop", [5, 6, 7, 8, 9])
    assert _spans(answer) == [_span("default", 0, 2), _span("v2", 2, 5)]
    assert not fake_vllm.paused


async def test_an_abort_during_a_keep_pause_answers_the_partial_output_of_the_held_version(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7], held_after=2, delay=60.0)])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    await client.pause("keep")
    await client.update_weight_version("v2")
    await client.abort(["r-1"])
    answer = await asyncio.wait_for(pending, timeout=5)

    assert (_choice(answer)["finish_reason"], _tokens(answer)) == ("abort", [5, 6])
    assert _spans(answer) == [_span("default", 0, 2)]
    assert fake_vllm.paused


async def test_a_continuation_takes_the_version_current_when_it_starts_and_can_be_frozen_too(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6, 7], held_after=1, held_again_after=(1,), hang=True)])
    pending = await _held(http, fake_vllm, PROMPT, request_id="r-1")
    await client.pause("abort")
    await client.update_weight_version("v2")
    await client.resume()
    continuation = await _held(http, fake_vllm, [*PROMPT, 5], request_id="r-2")
    await client.pause("keep")  # frozen after its own held_again_after token
    await client.update_weight_version("v3")
    await client.resume()
    fake_vllm.release("r-2")

    assert _tokens(await asyncio.wait_for(pending, timeout=5)) == [5]
    answer = await asyncio.wait_for(continuation, timeout=5)
    assert _tokens(answer) == [6, 7]
    assert _spans(answer) == [_span("v2", 0, 1), _span("v3", 1, 2)]


async def test_wait_answers_once_held_requests_have_finished(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6], held_after=1, hang=True), ScriptedTurn(token_ids=[7])])
    held = await _held(http, fake_vllm, PROMPT, request_id="r-1")

    pause = asyncio.create_task(_post(http, fake_vllm.url + PAUSE_PATH + "?mode=wait"))
    await fake_vllm.wait_until(lambda: fake_vllm.paused)
    arriving = asyncio.create_task(_generate(http, fake_vllm, [1], request_id="r-2"))
    await fake_vllm.wait_until_waiting(2)
    assert fake_vllm.waiting_request_ids == ["r-1", "r-2"] and fake_vllm.held_request_ids == ["r-1"]
    assert not pause.done()
    fake_vllm.release("r-1")

    assert await asyncio.wait_for(pause, timeout=5) == (200, {"status": "paused"})
    assert _tokens(await asyncio.wait_for(held, timeout=5)) == [5, 6]  # it finished: wait mode does not freeze
    assert not arriving.done() and fake_vllm.waiting_request_ids == ["r-2"]
    await _post(http, fake_vllm.url + RESUME_PATH)
    assert _tokens(await asyncio.wait_for(arriving, timeout=5)) == [7]


async def test_requests_arriving_while_paused_wait_for_resume_and_take_the_new_version(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script([ScriptedTurn(token_ids=[5, 6]), ScriptedTurn(token_ids=[7], hang=True, held_after=1)])
    assert await _post(http, fake_vllm.url + PAUSE_PATH) == (200, {"status": "paused"})  # abort is the default
    assert fake_vllm.pause_mode == "abort"

    waiting = asyncio.create_task(_generate(http, fake_vllm, PROMPT, request_id="r-1"))
    hanging = asyncio.create_task(_generate(http, fake_vllm, PROMPT, request_id="r-2"))
    await fake_vllm.wait_until_waiting(2)
    # not at the engine yet: neither an abort nor another pause reaches them
    await client.abort(["r-1", "r-2"])
    await client.pause("abort")
    await client.update_weight_version("v2")
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2
    assert fake_vllm.waiting_request_ids == ["r-1", "r-2"] and fake_vllm.held_request_ids == []
    assert not waiting.done() and not hanging.done()
    await client.resume()

    answer = await asyncio.wait_for(waiting, timeout=5)
    assert (_tokens(answer), _spans(answer)) == ([5, 6], [_span("v2", 0, 2)])
    await fake_vllm.wait_until(lambda: fake_vllm.held_request_ids == ["r-2"])  # its hang starts at resume
    await client.abort(["r-2"])
    assert _tokens(await asyncio.wait_for(hanging, timeout=5)) == [7]


async def test_stop_answers_requests_waiting_for_resume_with_abort(tokenizer: Any, http: aiohttp.ClientSession) -> None:
    server = FakeVLLMServer(tokenizer, model=MODEL)
    await server.start()
    server.script([ScriptedTurn(token_ids=[5])])
    await _post(http, server.url + PAUSE_PATH + "?mode=keep")
    pending = asyncio.create_task(_generate(http, server, PROMPT))
    await server.wait_until_waiting()

    await asyncio.wait_for(server.stop(), timeout=5)
    answer = await asyncio.wait_for(pending, timeout=5)

    assert (_choice(answer)["finish_reason"], _tokens(answer), _spans(answer)) == ("abort", [], [])
    assert server.disconnected_request_ids == []


# ------------------------------------------------------------------ weight versions and the endpoints


async def test_every_answer_has_weight_version_spans_of_the_current_version(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, client: VLLMClient
) -> None:
    fake_vllm.script(
        [
            ScriptedTurn(token_ids=[5, 6, 7]),
            ScriptedTurn(token_ids=[]),
            ScriptedTurn(token_ids=[8]),
            ScriptedTurn(token_ids=[9], choice_extra={"weight_versions": [_span("x", 0, 1)]}),
            ScriptedTurn(token_ids=[9], choice_extra={"weight_versions": OMIT}),
            ScriptedTurn(token_ids=[9]),
        ]
    )

    first = await _generate(http, fake_vllm, PROMPT)
    empty = await _generate(http, fake_vllm, PROMPT)
    await client.update_weight_version("v7")
    after = await _generate(http, fake_vllm, PROMPT)
    overridden = await _generate(http, fake_vllm, PROMPT)
    omitted = await _generate(http, fake_vllm, PROMPT)

    assert _spans(first) == [_span("default", 0, 3)]
    assert _spans(empty) == []
    assert _spans(after) == [_span("v7", 0, 1)]
    assert _spans(overridden) == [_span("x", 0, 1)]
    assert "weight_versions" not in _choice(omitted)
    assert all("weight_version" not in answer for answer in (first, empty, after, overridden, omitted))
    body = {"model": MODEL, "token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}
    assert (await client.generate(body, request_id="parsed")).meta.weight_version == "v7"  # what the client reads


async def test_weight_info_update_weight_version_and_update_weights(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    assert await _get(http, fake_vllm.url + WEIGHT_INFO_PATH) == (200, {"weight_version": "default"})
    assert await _get(http, fake_vllm.url + IS_PAUSED_PATH) == (200, {"is_paused": False})

    updated = await _post(http, fake_vllm.url + UPDATE_WEIGHT_VERSION_PATH, {"new_version": "step-3"})
    loaded = await _post(http, fake_vllm.url + UPDATE_WEIGHTS_PATH, {"update_info": {"path": "/tmp/w"}})

    assert updated == (200, {"success": True, "new_version": "step-3"})
    assert loaded == (200, {"message": "Weights updated"})
    assert fake_vllm.weight_updates == [{"update_info": {"path": "/tmp/w"}}]
    assert fake_vllm.weight_version == "step-3"
    assert await _get(http, fake_vllm.url + WEIGHT_INFO_PATH) == (200, {"weight_version": "step-3"})
    assert await _post(http, fake_vllm.url + RESUME_PATH) == (200, {"status": "resumed"})
    assert [len(fake_vllm.requests_to(path)) for path in (WEIGHT_INFO_PATH, UPDATE_WEIGHTS_PATH)] == [2, 1]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (PAUSE_PATH + "?mode=later", {}, "mode"),
        (UPDATE_WEIGHT_VERSION_PATH, {}, "new_version"),
        (UPDATE_WEIGHT_VERSION_PATH, {"new_version": 3}, "new_version"),
        (UPDATE_WEIGHT_VERSION_PATH, ["v2"], None),
    ],
)
async def test_bad_weight_update_requests_answer_a_vllm_400(
    fake_vllm: FakeVLLMServer, http: aiohttp.ClientSession, path: str, body: Any, param: str | None
) -> None:
    status, answer = await _post(http, fake_vllm.url + path, body)

    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["code"] == 400
    assert answer["error"]["param"] == param
    assert not fake_vllm.paused
    assert fake_vllm.weight_version == "default"


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        (ScriptedTurn(token_ids=[1], held_after=1), "needs hang=True or delay > 0"),
        (ScriptedTurn(token_ids=[1], held_after=-1, hang=True), "non-negative int"),
        (ScriptedTurn(token_ids=[1], held_after=True, hang=True), "non-negative int"),
        (ScriptedTurn(raw={}, held_after=0, hang=True), "not raw= or an error status"),
        (ScriptedTurn(token_ids=[1], held_again_after=(1,), hang=True), "needs held_after"),
        (ScriptedTurn(token_ids=[1], held_after=0, held_again_after=(-1,), hang=True), "tuple of non-negative"),
    ],
)
def test_script_refuses_holds_that_cannot_happen(tokenizer: Any, turn: ScriptedTurn, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FakeVLLMServer(tokenizer).script([turn])


async def test_a_server_without_weight_version_spans_leaves_them_out(
    tokenizer: Any, http: aiohttp.ClientSession
) -> None:
    async with FakeVLLMServer(tokenizer, model=MODEL, weight_version_spans=False) as server:
        server.script([ScriptedTurn(token_ids=[5, 6])])
        answer = await _generate(http, server, PROMPT)

    assert _tokens(answer) == [5, 6]
    assert "weight_versions" not in _choice(answer)
