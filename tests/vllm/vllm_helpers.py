"""Helpers of the real-vLLM tier: direct calls to the server (probes, metrics, pause) and shared assertions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH

__all__ = [
    "ABORT_PATH",
    "ASCII_STOPS",
    "GENERATE_PATH",
    "MAX_MODEL_LEN",
    "OBSERVATION",
    "RENDER_PATH",
    "SERVED_MODEL",
    "GreedyProbe",
    "assert_logprobs_aligned",
    "freeze",
    "frozen",
    "generated_alongside",
    "generated_since",
    "generation_tokens",
    "greedy_probe",
    "metrics",
    "partial_stop_string",
    "pick_stop_string",
    "pick_stop_token",
    "quiet_server",
    "server_idle",
    "server_session",
    "step_until",
    "thaw",
    "wait_until",
]

SERVED_MODEL = "tiny-qwen2"
#: The served context length (``--max-model-len``): prompt plus generated tokens never exceed it.
MAX_MODEL_LEN = 1024
OBSERVATION = "Continue the reasoning."
#: Stop strings that end almost every turn of the random model within a few tokens (any ASCII letter).
ASCII_STOPS = list(string.ascii_letters)


def server_session() -> aiohttp.ClientSession:
    """A client session for direct calls to vLLM that opens a new connection for every request.

    uvicorn closes a keep-alive connection after 5 idle seconds; a pooled connection reused just then fails with
    ``ServerDisconnectedError`` (seen after a slow step between two calls on a loaded machine).
    """
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def post(url: str, body: dict[str, Any]) -> Any:
    async with server_session() as session, session.post(url, json=body) as answer:
        answer.raise_for_status()
        return await answer.json()


@dataclass
class GreedyProbe:
    """What the server generates greedily (temperature 0) for a prompt: the tokens and their texts."""

    prompt_ids: list[int]
    token_ids: list[int]
    texts: list[str]


async def greedy_probe(base_url: str, prompt: str, tokenizer: Any, max_tokens: int = 48) -> GreedyProbe:
    """Render ``prompt`` as one user message and generate ``max_tokens`` tokens greedily, directly at vLLM."""
    rendered = await post(
        base_url + RENDER_PATH, {"model": SERVED_MODEL, "messages": [{"role": "user", "content": prompt}]}
    )
    answer = await post(
        base_url + GENERATE_PATH,
        {
            "token_ids": rendered["token_ids"],
            "model": SERVED_MODEL,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1},
        },
    )
    token_ids = answer["choices"][0]["token_ids"]
    return GreedyProbe(
        prompt_ids=rendered["token_ids"],
        token_ids=token_ids,
        texts=[tokenizer.decode([token], skip_special_tokens=False) for token in token_ids],
    )


def _clean(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and text.isprintable()


def pick_stop_token(probe: GreedyProbe, tokenizer: Any, start: int = 3) -> int:
    """An index ``k >= start`` whose token first occurs there and is an ordinary token (not EOS/special)."""
    specials = set(tokenizer.all_special_ids)
    for k in range(start, len(probe.token_ids) - 4):
        token = probe.token_ids[k]
        if token not in probe.token_ids[:k] and token not in specials and token < len(tokenizer):
            return k
    raise AssertionError(f"no usable stop token in the greedy output {probe.token_ids}")


def pick_stop_string(probe: GreedyProbe, tokenizer: Any, start: int = 3, *, min_len: int = 4) -> tuple[int, str]:
    """An index ``k >= start`` and a stop string (the stripped text of token ``k``) whose first occurrence in the
    decoded greedy output ends exactly at the end of token ``k``, so vLLM stops right after token ``k``."""
    for k in range(start, len(probe.token_ids) - 4):
        candidate = probe.texts[k].strip()
        if len(candidate) < min_len or not _clean(candidate) or not candidate.isascii():
            continue
        through = tokenizer.decode(probe.token_ids[: k + 1], skip_special_tokens=False)
        if through.find(candidate) == len(through) - len(candidate):
            return k, candidate
    raise AssertionError(f"no usable stop string in the greedy output {probe.texts}")


def partial_stop_string(probe: GreedyProbe, tokenizer: Any, k: int, candidate: str) -> str:
    """A stop string that completes inside token ``k`` but is not a suffix of the text through token ``k``."""
    partial = candidate[:-1]
    before = tokenizer.decode(probe.token_ids[:k], skip_special_tokens=False)
    through = tokenizer.decode(probe.token_ids[: k + 1], skip_special_tokens=False)
    assert partial not in before and partial in through and not through.endswith(partial), (partial, through)
    return partial


async def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over labels (``name -> value``)."""
    async with server_session() as session, session.get(base_url + "/metrics") as answer:
        text = await answer.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def assert_logprobs_aligned(response: dict[str, Any]) -> list[float]:
    """One finite, non-positive logprob per generated token, each entry naming its token; returns the values."""
    choice = response["choices"][0]
    token_ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(token_ids)
    values = []
    for token, entry in zip(token_ids, content, strict=True):
        assert entry["token_id"] == token
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0.0
        values.append(entry["logprob"])
    return values


def model_positions(loss_mask: Sequence[int]) -> list[int]:
    return [index for index, bit in enumerate(loss_mask) if bit == 1]


# --------------------------------------------------------------------------- waiting on the server's state


async def wait_until(predicate: Callable[[], Awaitable[bool] | bool], what: str, limit_s: float = 60.0) -> None:
    """Poll ``predicate`` until it holds; the limit only turns a hang into a failure that names ``what``."""
    deadline = time.monotonic() + limit_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def generation_tokens(base_url: str) -> float:
    """vLLM's count of tokens generated since it started (all requests)."""
    return (await metrics(base_url))["vllm:generation_tokens_total"]


async def server_idle(base_url: str) -> bool:
    values = await metrics(base_url)
    return values.get("vllm:num_requests_running", 0.0) == 0 and values.get("vllm:num_requests_waiting", 0.0) == 0


async def quiet_server(base_url: str) -> float:
    """Wait until vLLM runs and queues nothing, then return its generated-token count: a test's own baseline.

    vLLM's request gauges are only refreshed by an engine step (after an abort they read 1 until the next one), so
    a sentinel request then checks that nothing generates beside it. From the baseline on, every generated token
    belongs to the test that took it (tests run one at a time).
    """
    await wait_until(lambda: server_idle(base_url), "vLLM to have no request running or waiting")
    leftover = await generated_alongside(base_url)
    assert leftover == 0, f"a request of an earlier test still generates at the server ({leftover} tokens)"
    return await generation_tokens(base_url)


def generated_since(base_url: str, baseline: float) -> Callable[[], Awaitable[bool]]:
    """A predicate for :func:`step_until`: vLLM has generated a token since ``baseline`` (its counter), so the test's
    request (the only one since the baseline) is registered, running, and has a token."""

    async def moved() -> bool:
        return await generation_tokens(base_url) > baseline

    return moved


async def freeze(base_url: str) -> None:
    """Freeze vLLM's scheduler (``/pause?mode=keep``): no engine step runs until :func:`thaw`.

    Running requests keep their place and requests that arrive meanwhile queue, so no generation can advance or
    finish, whatever the time the test's next move takes; vLLM still answers an aborted request
    (``finish_reason: "abort"``, with the tokens made before the freeze). The call returns once the engine core has
    stopped and sent out its last step's outputs. Needs ``VLLM_SERVER_DEV_MODE=1`` on the server
    (``conftest.SERVE_ENV``); freezing a frozen server is a no-op.
    """
    params = {"mode": "keep", "clear_cache": "false"}
    async with server_session() as session, session.post(base_url + "/pause", params=params) as answer:
        if answer.status != 200:
            raise AssertionError(
                f"POST /pause?mode=keep answered HTTP {answer.status}: {await answer.text()!r}; the tier's server "
                "must run with VLLM_SERVER_DEV_MODE=1"
            )


async def thaw(base_url: str) -> None:
    """Let a frozen vLLM run again (``/resume``; a no-op on a running server)."""
    async with server_session() as session, session.post(base_url + "/resume") as answer:
        answer.raise_for_status()


@contextlib.asynccontextmanager
async def frozen(base_url: str) -> AsyncIterator[None]:
    """vLLM frozen (:func:`freeze`) for the block, then let go (:func:`thaw`): a request not aborted carries on."""
    await freeze(base_url)
    try:
        yield
    finally:
        await thaw(base_url)


async def step_until(base_url: str, predicate: Callable[[], Awaitable[bool]], what: str,
                     limit_s: float = 120.0) -> int:  # fmt: skip
    """On a frozen vLLM, let the engine run in short windows until ``predicate`` holds; returns the windows used.

    A window is :func:`thaw` followed at once by :func:`freeze`: the engine runs from the one to the other, a few
    steps (a step is one token for every running request), so requests held at vLLM move on by a few tokens, never
    to the end of a long turn. ``predicate`` is a question about vLLM (its generated-token count, its running
    gauge), asked while frozen after each window, never about time: the freeze returns once the engine core has
    stopped and sent its last step's outputs, which vLLM's front end counts on receipt, so the answer describes
    the frozen engine (one lagging a little only costs another window). The limit only turns a hang into a failure
    that names ``what``.
    """
    deadline = time.monotonic() + limit_s
    windows = 0
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s of engine windows waiting for {what}")
        await thaw(base_url)
        await freeze(base_url)
        windows += 1
    return windows


#: The sentinel of :func:`generated_alongside`: a short prompt ("Hello, world!") and a fixed number of tokens.
SENTINEL_PROMPT = [9707, 11, 1879, 0]
SENTINEL_TOKENS = 8


async def generated_alongside(base_url: str) -> float:
    """Tokens vLLM generated for other requests while it generated a short sentinel request of its own.

    vLLM schedules every running request in each step, so a request still alive at the server generates tokens
    alongside the sentinel: 0 means the server runs nothing else. This waits on the sentinel's answer, not on time.
    """
    before = await generation_tokens(base_url)
    answer = await post(
        base_url + GENERATE_PATH,
        {
            "token_ids": SENTINEL_PROMPT,
            "model": SERVED_MODEL,
            "sampling_params": {"max_tokens": SENTINEL_TOKENS, "min_tokens": SENTINEL_TOKENS, "ignore_eos": True,
                                "temperature": 0.0},
        },
    )  # fmt: skip
    assert len(answer["choices"][0]["token_ids"]) == SENTINEL_TOKENS, answer
    return await generation_tokens(base_url) - before - SENTINEL_TOKENS


def generated_tokens(response: Any) -> list[int]:
    """The tokens of one generate answer: a JSON body's, or, for a streamed request (the gateway streams its
    agents' calls), the tokens of every SSE chunk in order."""
    if not isinstance(response, str):
        return list(response["choices"][0]["token_ids"])
    tokens: list[int] = []
    for line in response.splitlines():
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if data and data != "[DONE]":
            for choice in json.loads(data).get("choices") or []:
                tokens += choice.get("token_ids") or []
    return tokens


def check_exported_as_generated(generates: Sequence[Any], samples: Sequence[Any]) -> list[list[int]]:
    """Each generate request (the proxy's exchanges, in order) continued an exported sequence: what it sent is a
    prefix and what vLLM generated follows with mask 1; every trained token is one vLLM generated, exactly once, in
    order, and nothing else is trained. Returns each request's generated tokens."""
    generated = [generated_tokens(exchange.response) for exchange in generates]
    assert all(generated)
    for exchange, tokens in zip(generates, generated, strict=True):
        sent = list(exchange.body["token_ids"])
        holders = [sample for sample in samples if sample.tokens[: len(sent) + len(tokens)] == sent + tokens]
        assert len(holders) == 1, "no exported sequence continues this request with vLLM's tokens"
        sample = holders[0]
        assert sample.loss_mask is not None
        start = len(sent) - (len(sample.tokens) - sample.response_length)
        assert sample.loss_mask[start : start + len(tokens)] == [1] * len(tokens)
    trained = [
        token
        for sample in samples
        for token, bit in zip(
            sample.tokens[len(sample.tokens) - sample.response_length :], sample.loss_mask or [], strict=True
        )
        if bit == 1
    ]
    assert trained == [token for tokens in generated for token in tokens]
    return generated
