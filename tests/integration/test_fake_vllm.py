"""The fake vLLM server speaks vLLM's token-in/token-out protocol over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from fsm_rollout.testing.fake_vllm import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    FakeVLLMServer,
    ScriptedTurn,
)
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

MODEL = "fake-model"
EOS_ID = 151645  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_qwen_tokenizer()


@pytest.fixture
async def server(tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(tokenizer, model=MODEL) as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def _prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


async def _post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def _generate(
    http: aiohttp.ClientSession,
    server: FakeVLLMServer,
    prompt: list[int],
    sampling_params: dict[str, Any],
    *,
    session: str | None = None,
    request_id: str | None = None,
) -> tuple[int, Any]:
    body: dict[str, Any] = {"model": MODEL, "token_ids": prompt, "sampling_params": sampling_params}
    if request_id is not None:
        body["request_id"] = request_id
    headers = {"x-session-id": session} if session is not None else None
    return await _post(http, server.url + GENERATE_PATH, body, headers)


async def _eventually(predicate: Callable[[], bool]) -> None:
    """Wait (up to 120 s, for a loaded machine) for server-side state that the client cannot observe directly."""
    for _ in range(12000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not hold within 120 s")


# ------------------------------------------------------------------ render


async def test_render_returns_the_chat_template_ids(
    server: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Count to three."},
    ]
    status, body = await _post(http, server.url + RENDER_PATH, {"model": MODEL, "messages": messages})

    assert status == 200
    expected = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert body["token_ids"] == expected
    assert body["request_id"].startswith("chatcmpl-")
    assert body["features"] is None
    assert body["model"] == MODEL
    assert body["sampling_params"]["temperature"] == 1.0
    assert {"stream", "stream_options", "cache_salt", "priority"} <= body.keys()


async def test_render_passes_chat_template_kwargs_and_image_parts(
    server: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": "What is this?"}]}]
    status, body = await _post(
        http,
        server.url + RENDER_PATH,
        {"model": MODEL, "messages": messages, "chat_template_kwargs": {"add_vision_id": False}},
    )

    assert status == 200
    text = tokenizer.decode(body["token_ids"], skip_special_tokens=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?" in text
    assert body["features"] is None


async def test_render_of_an_unknown_model_is_vllms_404(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "hi"}]
    status, body = await _post(http, server.url + RENDER_PATH, {"model": "other", "messages": messages})

    assert status == 404
    assert body == {
        "error": {
            "message": f"The model `other` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize("messages", [None, [], "hello", [{"content": "no role"}]])
async def test_render_without_valid_messages_is_400(
    server: FakeVLLMServer, http: aiohttp.ClientSession, messages: Any
) -> None:
    body: dict[str, Any] = {"model": MODEL}
    if messages is not None:
        body["messages"] = messages
    status, answer = await _post(http, server.url + RENDER_PATH, body)

    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"
    assert answer["error"]["code"] == 400


# ------------------------------------------------------------------ generate


async def test_generate_answers_the_scripted_text_with_aligned_logprobs_and_usage(
    server: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    text = "Six times seven is forty-two."
    server.script([ScriptedTurn(text=text)])
    prompt = _prompt(tokenizer)

    status, body = await _generate(http, server, prompt, {"max_tokens": 64}, request_id="r-1")

    assert status == 200
    expected = tokenizer.encode(text, add_special_tokens=False)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["finish_reason"] == "stop"
    assert choice["index"] == 0
    assert choice["routed_experts"] is None
    assert choice["sampling_mask"] is None
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == expected
    assert [entry["logprob"] for entry in content] == pytest.approx([-0.01 * (i + 1) for i in range(len(expected))])
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt) + len(expected),
        "prompt_tokens_details": None,  # vLLM sends both details (null): the conformance suite made the fake too
        "completion_tokens_details": None,
    }
    assert body["request_id"] == "generate-tokens-r-1"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)


async def test_generate_answers_scripted_token_ids_and_logprobs_exactly(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[10, 20, 30], logprobs=[-0.5, -1.5, -2.5])])

    _, body = await _generate(http, server, [1, 2, 3], {"max_tokens": 8})

    choice = body["choices"][0]
    assert choice["token_ids"] == [10, 20, 30]
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5, -1.5, -2.5]


async def test_generate_cuts_at_a_stop_string_keeping_the_token_that_completes_it(
    server: FakeVLLMServer, http: aiohttp.ClientSession, tokenizer: Any
) -> None:
    text = "The answer is 42. And more text after it."
    server.script([ScriptedTurn(text=text)])

    _, body = await _generate(http, server, [1, 2], {"max_tokens": 64, "stop": ["42", "never"]})

    choice = body["choices"][0]
    scripted = tokenizer.encode(text, add_special_tokens=False)
    assert choice["token_ids"] == scripted[: len(choice["token_ids"])]
    assert tokenizer.decode(choice["token_ids"]) == "The answer is 42"
    assert choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


async def test_generate_cuts_at_a_stop_token_id_keeping_it(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6, 7, 8, 9])])

    _, body = await _generate(http, server, [1], {"max_tokens": 16, "stop_token_ids": [7]})

    assert body["choices"][0]["token_ids"] == [5, 6, 7]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_generate_cuts_at_eos_keeping_it(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6, EOS_ID, 8, 9])])

    _, body = await _generate(http, server, [1], {"max_tokens": 16})

    assert body["choices"][0]["token_ids"] == [5, 6, EOS_ID]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_generate_with_ignore_eos_runs_past_eos(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6, EOS_ID, 8, 9])])

    _, body = await _generate(http, server, [1], {"max_tokens": 16, "ignore_eos": True})

    assert body["choices"][0]["token_ids"] == [5, 6, EOS_ID, 8, 9]


async def test_generate_capped_by_max_tokens_finishes_with_length(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6, 7, 8, 9])])

    _, body = await _generate(http, server, [1], {"max_tokens": 3})

    choice = body["choices"][0]
    assert choice["token_ids"] == [5, 6, 7]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


async def test_generate_without_max_tokens_uses_the_remaining_context(
    tokenizer: Any, http: aiohttp.ClientSession
) -> None:
    async with FakeVLLMServer(tokenizer, model=MODEL, max_model_len=10) as small:
        small.script([ScriptedTurn(token_ids=list(range(100, 120)))])

        _, body = await _generate(http, small, [1, 2, 3, 4, 5, 6], {"temperature": 1.0})

    choice = body["choices"][0]
    assert choice["token_ids"] == [100, 101, 102, 103]
    assert choice["finish_reason"] == "length"


async def test_generate_with_a_prompt_filling_the_context_is_400(tokenizer: Any, http: aiohttp.ClientSession) -> None:
    async with FakeVLLMServer(tokenizer, model=MODEL, max_model_len=4) as small:
        small.script([ScriptedTurn(text="unused")])

        status, body = await _generate(http, small, [1, 2, 3, 4], {"max_tokens": 1})

    assert status == 400
    assert "maximum context length is 4 tokens" in body["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": [], "sampling_params": {}},
        {"token_ids": [1, -2], "sampling_params": {}},
        {"token_ids": [1, "2"], "sampling_params": {}},
        {"token_ids": [1, 2.0], "sampling_params": {}},
        {"token_ids": [1, 2]},
        {"token_ids": [1, 2], "sampling_params": []},
        {"token_ids": [1, 2], "sampling_params": {}, "request_id": ""},
    ],
    ids=[
        "empty",
        "negative",
        "string",
        "float",
        "no-sampling-params",
        "sampling-params-not-object",
        "empty-request-id",
    ],
)
async def test_generate_rejects_an_invalid_request_with_400(
    server: FakeVLLMServer, http: aiohttp.ClientSession, body: dict[str, Any]
) -> None:
    server.script([ScriptedTurn(text="unused")])

    status, answer = await _post(http, server.url + GENERATE_PATH, body)

    assert status == 400
    assert answer["error"]["type"] == "BadRequestError"


async def test_generate_with_a_body_that_is_not_json_is_400(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(server.url + GENERATE_PATH, data=b"{not json") as response:
        assert response.status == 400
        assert (await response.json())["error"]["code"] == 400


async def test_scripted_finish_overrides_the_servers_decision(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6], finish="abort")])

    _, body = await _generate(http, server, [1], {"max_tokens": 8})

    assert body["choices"][0]["token_ids"] == [5, 6]
    assert body["choices"][0]["finish_reason"] == "abort"


async def test_choice_extra_and_top_extra_are_merged_into_the_answer(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script(
        [
            ScriptedTurn(
                token_ids=[5],
                choice_extra={"routed_experts": "AAAA", "sampling_mask": [[5, 9]]},
                top_extra={"weight_version": "7"},
            )
        ]
    )

    _, body = await _generate(http, server, [1], {"max_tokens": 8})

    assert body["choices"][0]["routed_experts"] == "AAAA"
    assert body["choices"][0]["sampling_mask"] == [[5, 9]]
    assert body["weight_version"] == "7"


async def test_a_raw_turn_is_sent_verbatim_with_its_status(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(raw={"choices": "not a list"}, status=200)])

    status, body = await _generate(http, server, [1], {"max_tokens": 8})

    assert status == 200
    assert body == {"choices": "not a list"}


async def test_a_turn_with_an_error_status_answers_a_vllm_error_body(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(status=503)])

    status, body = await _generate(http, server, [1], {"max_tokens": 8})

    assert status == 503
    assert body["error"]["code"] == 503
    assert body["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("style", ["token_id", "token"])
async def test_logprob_entries_follow_the_configured_style(
    tokenizer: Any, http: aiohttp.ClientSession, style: Any
) -> None:
    async with FakeVLLMServer(tokenizer, model=MODEL, logprob_entry_style=style) as fake:
        fake.script([ScriptedTurn(token_ids=[5, 6], logprobs=[-0.25, -0.75])])

        _, body = await _generate(http, fake, [1], {"max_tokens": 8})

    content = body["choices"][0]["logprobs"]["content"]
    if style == "token_id":
        assert content == [
            {"token_id": 5, "logprob": -0.25, "rank": 1, "top_logprobs": []},
            {"token_id": 6, "logprob": -0.75, "rank": 1, "top_logprobs": []},
        ]
    else:
        assert content == [
            {"token": "token_id:5", "logprob": -0.25, "top_logprobs": []},
            {"token": "token_id:6", "logprob": -0.75, "top_logprobs": []},
        ]


# ------------------------------------------------------------------ scripts and sessions


async def test_each_session_draws_from_its_own_queue(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[11]), ScriptedTurn(token_ids=[12])], session="a")
    server.script([ScriptedTurn(token_ids=[21])], session="b")

    answers = [await _generate(http, server, [1], {"max_tokens": 4}, session=session) for session in ("b", "a", "a")]

    assert [body["choices"][0]["token_ids"] for _, body in answers] == [[21], [11], [12]]


async def test_a_request_without_a_scripted_session_uses_the_default_queue(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[1]), ScriptedTurn(token_ids=[2])])

    _, without_header = await _generate(http, server, [1], {"max_tokens": 4})
    _, unknown_session = await _generate(http, server, [1], {"max_tokens": 4}, session="never-scripted")

    assert without_header["choices"][0]["token_ids"] == [1]
    assert unknown_session["choices"][0]["token_ids"] == [2]


async def test_an_exhausted_script_answers_500_naming_the_session(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[1])], session="s1")
    await _generate(http, server, [1], {"max_tokens": 4}, session="s1")

    status, body = await _generate(http, server, [1], {"max_tokens": 4}, session="s1")

    assert status == 500
    assert body["error"]["message"] == "fake vLLM: no scripted turn left for session s1"


async def test_an_exhausted_default_queue_answers_500(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    status, body = await _generate(http, server, [1], {"max_tokens": 4})

    assert status == 500
    assert body["error"]["message"] == "fake vLLM: no scripted turn left for session <default>"
    assert body["error"]["type"] == "InternalServerError"


# ------------------------------------------------------------------ fault injection


async def test_fail_next_with_a_status_answers_a_vllm_error_body(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.fail_next(GENERATE_PATH, status=502)
    server.script([ScriptedTurn(token_ids=[7])])

    status, body = await _generate(http, server, [1], {"max_tokens": 4})

    assert status == 502
    assert body["error"]["code"] == 502
    assert body["error"]["type"] == "BadGatewayError"


async def test_fail_next_is_used_up_after_the_given_number_of_requests(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.fail_next(GENERATE_PATH, status=503, times=2)
    server.script([ScriptedTurn(token_ids=[7])])

    statuses = [(await _generate(http, server, [1], {"max_tokens": 4}))[0] for _ in range(3)]

    assert statuses == [503, 503, 200]


async def test_fail_next_with_malformed_json_answers_200_with_an_unparsable_body(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.fail_next(GENERATE_PATH, malformed_json=True)

    async with http.post(server.url + GENERATE_PATH, json={"token_ids": [1], "sampling_params": {}}) as response:
        assert response.status == 200
        with pytest.raises(ValueError):
            await response.json()


async def test_fail_next_with_reset_drops_the_connection(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.fail_next(RENDER_PATH, reset=True)

    with pytest.raises(aiohttp.ClientConnectionError):
        await _post(http, server.url + RENDER_PATH, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})

    assert len(server.requests_to(RENDER_PATH)) == 1


# ------------------------------------------------------------------ abort and disconnect


async def test_abort_requests_ends_a_hanging_generate_with_abort(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[5, 6], hang=True)])
    pending = asyncio.create_task(_generate(http, server, [1, 2], {"max_tokens": 8}, request_id="hung-1"))
    await _eventually(lambda: len(server.requests_to(GENERATE_PATH)) == 1)

    abort_status, abort_body = await _post(http, server.url + ABORT_PATH, {"request_ids": ["hung-1"]})
    status, body = await asyncio.wait_for(pending, timeout=2.0)

    assert (abort_status, abort_body) == (200, None)  # vLLM's empty 200 (the fake answered {} before)
    assert status == 200
    assert body["request_id"] == "generate-tokens-hung-1"
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["token_ids"] == []
    assert server.aborted_request_ids == ["hung-1"]


async def test_abort_requests_cuts_a_delay_short(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5], delay=30.0)])
    started = time.monotonic()
    pending = asyncio.create_task(_generate(http, server, [1], {"max_tokens": 8}, request_id="slow-1"))
    await _eventually(lambda: len(server.requests_to(GENERATE_PATH)) == 1)

    await _post(http, server.url + ABORT_PATH, {"request_ids": ["slow-1"]})
    _, body = await asyncio.wait_for(pending, timeout=2.0)

    assert body["choices"][0]["finish_reason"] == "abort"
    assert time.monotonic() - started < 5.0


async def test_a_delay_holds_the_answer_back(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5], delay=0.3)])
    started = time.monotonic()

    _, body = await _generate(http, server, [1], {"max_tokens": 8})

    assert time.monotonic() - started >= 0.3
    assert body["choices"][0]["token_ids"] == [5]


async def test_a_client_disconnect_during_a_hang_is_recorded(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    server.script([ScriptedTurn(token_ids=[5], hang=True), ScriptedTurn(token_ids=[9])])
    body = {"model": MODEL, "token_ids": [1], "sampling_params": {"max_tokens": 4}, "request_id": "gone-1"}

    with pytest.raises(TimeoutError):
        async with http.post(
            server.url + GENERATE_PATH, json=body, timeout=aiohttp.ClientTimeout(total=0.3)
        ) as response:
            await response.read()

    await _eventually(lambda: server.disconnected_request_ids == ["gone-1"])
    assert server.aborted_request_ids == []
    _, after = await _generate(http, server, [1], {"max_tokens": 4})
    assert after["choices"][0]["token_ids"] == [9]


# ------------------------------------------------------------------ bookkeeping and misc endpoints


async def test_every_request_is_recorded_in_arrival_order(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    server.script([ScriptedTurn(token_ids=[5])])
    render_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    await _post(http, server.url + RENDER_PATH, render_body)
    await _post(http, server.url + GENERATE_PATH, {"token_ids": []})
    await _generate(http, server, [1], {"max_tokens": 4}, session="s")
    await _post(http, server.url + ABORT_PATH, {"request_ids": ["x"]})

    assert [recorded.path for recorded in server.requests] == [
        RENDER_PATH,
        GENERATE_PATH,
        GENERATE_PATH,
        ABORT_PATH,
    ]
    assert server.requests[0].body == render_body
    assert server.requests[1].body == {"token_ids": []}
    assert server.requests[2].headers["x-session-id"] == "s"
    times = [recorded.at for recorded in server.requests]
    assert times == sorted(times)
    assert len(server.requests_to(GENERATE_PATH)) == 2


async def test_health_and_models_describe_the_server(server: FakeVLLMServer, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/health") as health:
        assert health.status == 200
    async with http.get(server.url + "/v1/models") as models:
        listing = await models.json()

    assert listing["object"] == "list"
    assert [(card["id"], card["object"], card["max_model_len"]) for card in listing["data"]] == [(MODEL, "model", 4096)]


async def test_an_unknown_path_is_a_json_404_and_is_recorded(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    status, body = await _post(http, server.url + "/v1/completions", {"prompt": "hi"})

    assert status == 404
    assert body == {"detail": "Not Found"}
    assert [recorded.path for recorded in server.requests] == ["/v1/completions"]


async def test_render_copies_the_chat_requests_sampling_fields(
    server: FakeVLLMServer, http: aiohttp.ClientSession
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 32,
        "temperature": 0.5,
        "stop": ["</answer>"],
    }

    _, answer = await _post(http, server.url + RENDER_PATH, body)

    sampling = answer["sampling_params"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["stop"]) == (32, 0.5, ["</answer>"])


async def test_stop_answers_a_waiting_generate_with_abort(tokenizer: Any, http: aiohttp.ClientSession) -> None:
    fake = FakeVLLMServer(tokenizer, model=MODEL)
    await fake.start()
    fake.script([ScriptedTurn(token_ids=[5], hang=True)])
    pending = asyncio.create_task(_generate(http, fake, [1], {"max_tokens": 4}))
    await _eventually(lambda: len(fake.requests_to(GENERATE_PATH)) == 1)

    await asyncio.wait_for(fake.stop(), timeout=5.0)
    _, body = await asyncio.wait_for(pending, timeout=2.0)

    assert body["choices"][0]["finish_reason"] == "abort"
    assert fake.disconnected_request_ids == []


def test_script_rejects_logprobs_that_do_not_match_the_token_ids(tokenizer: Any) -> None:
    fake = FakeVLLMServer(tokenizer)

    with pytest.raises(ValueError, match="2 logprobs for 3 token ids"):
        fake.script([ScriptedTurn(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2])])


def test_a_scripted_turn_needs_exactly_one_of_text_and_token_ids() -> None:
    with pytest.raises(ValueError, match="exactly one of text= or token_ids="):
        ScriptedTurn(text="a", token_ids=[1])
