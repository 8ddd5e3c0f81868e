"""The servers the conformance suite runs against, each behind one small harness (the fixtures are in conftest.py).

The wire tests are the same for every server; a harness only supplies what a server cannot be asked over vLLM's
wire: how to make a generate request wait (so that an abort or a pause meets it in flight), how to see that it
waits, and what it will generate (the fake server needs a scripted turn per generate request).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from fsm_rollout.cli.bench.server import HOLD_PATH, STATS_PATH, WAIT_PATH
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.schema import GENERATE_PATH, MODELS_PATH
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

SERVERS = ("engine", "fake", "bench")
FAKE_TEXT = "x = 1, x = 2, x = 3, x = 4, x = 5, x = 6, x = 7, x = 8."
"""What the fake server generates: repeated tokens, so a stop string can recur after ``min_tokens``."""
HELD_TOKENS = 2
"""How many tokens a held generate request has produced when it is aborted."""
POLLS = 3000


async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
    """Wait until the server reaches a state (checked every 10 ms; the test fails after 30 s)."""
    for _ in range(POLLS):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never reached the state the test waits for")


class Harness:
    """One server under test: its URL and served model name, and the few things the wire cannot do."""

    name: str
    url: str
    model: str
    max_model_len: int

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None, **query: str) -> tuple[int, Any]:
        """POST JSON ``body`` (or the bytes ``raw``): the status and the decoded answer (None when empty)."""
        data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
        headers = {"Content-Type": "application/json"}
        async with self.http.post(self.url + path, data=data, params=query, headers=headers) as response:
            text = await response.read()
            return response.status, (await response.json(content_type=None)) if text else None

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as response:
            text = await response.read()
            return response.status, (await response.json(content_type=None)) if text else None

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    tokenizer: Any

    def will_generate(self, count: int = 1) -> None:
        """``count`` more generate requests will be sent that must produce tokens."""

    async def held_generate(self, body: dict[str, Any], request_id: str) -> asyncio.Task[tuple[int, Any]]:
        """Send a generate request that does not end by itself, once it has produced :data:`HELD_TOKENS`."""
        raise NotImplementedError

    async def release(self) -> None:
        """Undo what :meth:`held_generate` arranged (the held request has been answered by then)."""

    async def parked(self, request_id: str) -> bool:
        """Whether a generate request sent while paused has arrived and waits for ``/resume``."""
        raise NotImplementedError

    async def generate_body(self, **sampling: Any) -> dict[str, Any]:
        """A generate body for the server's prompt (a render of a one-message conversation)."""
        status, rendered = await self.post(
            "/v1/chat/completions/render",
            {"model": self.model, "messages": [{"role": "user", "content": "What is 6 * 7?"}]},
        )
        assert status == 200, rendered
        return {"model": self.model, "token_ids": rendered["token_ids"], "sampling_params": sampling}


class EngineHarness(Harness):
    """The embedded engine with the tiny random model: greedy decoding repeats a token and never meets EOS."""

    name = "engine"

    def __init__(self, http: aiohttp.ClientSession, engine: LocalEngine) -> None:
        super().__init__(http)
        self.engine = engine
        self.url = engine.url
        self.model = engine.served_model_name
        self.max_model_len = engine.max_model_len
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)

    async def held_generate(self, body: dict[str, Any], request_id: str) -> asyncio.Task[tuple[int, Any]]:
        body = {**body, "request_id": request_id}
        room = self.max_model_len - len(body["token_ids"])  # long enough not to finish before the pause
        body["sampling_params"] = {**body["sampling_params"], "max_tokens": room, "ignore_eos": True}
        task = asyncio.create_task(self.post(GENERATE_PATH, body))

        async def produced() -> bool:
            assert not task.done(), task.result()
            return self.engine.live_token_counts().get(request_id, 0) >= HELD_TOKENS

        await until(produced)
        await self.engine.pause("keep")  # frozen in flight: it cannot finish before the abort lands
        return task

    async def release(self) -> None:
        await self.engine.resume()

    async def parked(self, request_id: str) -> bool:
        return request_id in self.engine.live_request_ids()


class FakeHarness(Harness):
    """The fake vLLM server; every generate request draws a scripted turn of :data:`FAKE_TEXT`."""

    name = "fake"

    def __init__(self, http: aiohttp.ClientSession, server: FakeVLLMServer) -> None:
        super().__init__(http)
        self.server = server
        self.url = server.url
        self.model = server.model
        self.max_model_len = server.max_model_len
        self.tokenizer = server.tokenizer

    def will_generate(self, count: int = 1) -> None:
        self.server.script([ScriptedTurn(text=FAKE_TEXT)] * count)

    async def held_generate(self, body: dict[str, Any], request_id: str) -> asyncio.Task[tuple[int, Any]]:
        self.server.script([ScriptedTurn(text=FAKE_TEXT, hang=True, held_after=HELD_TOKENS)])
        task = asyncio.create_task(self.post(GENERATE_PATH, {**body, "request_id": request_id}))
        await self.server.wait_until(lambda: request_id in self.server.held_request_ids)
        return task

    async def parked(self, request_id: str) -> bool:
        return request_id in self.server.waiting_request_ids


class BenchHarness(Harness):
    """The bench's canned server (in its own process); its hold mode holds first-turn requests."""

    name = "bench"

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        super().__init__(http)
        self.url = url
        self.tokenizer = load_qwen_tokenizer()

    async def start(self) -> None:
        status, models = await self.get(MODELS_PATH)
        assert status == 200, models
        self.model = models["data"][0]["id"]
        self.max_model_len = models["data"][0]["max_model_len"]

    async def held_generate(self, body: dict[str, Any], request_id: str) -> asyncio.Task[tuple[int, Any]]:
        status, _ = await self.post(HOLD_PATH, {"mode": "hold", "partial_tokens": HELD_TOKENS})
        assert status == 200
        task = asyncio.create_task(self.post(GENERATE_PATH, {**body, "request_id": request_id}))
        status, _ = await self.post(WAIT_PATH, {"held": 1})
        assert status == 200
        return task

    async def release(self) -> None:
        status, _ = await self.post(HOLD_PATH, {"mode": "off"})
        assert status == 200

    async def parked(self, request_id: str) -> bool:
        status, stats = await self.post(STATS_PATH, {})
        assert status == 200
        return bool(stats["parked"])
