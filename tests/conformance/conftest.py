"""The conformance suite's fixtures: an HTTP session and each vLLM-speaking server in turn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from wire_servers import SERVERS, BenchHarness, EngineHarness, FakeHarness, Harness

from fsm_rollout.cli.bench.server import Server
from fsm_rollout.engine.local import TINY_MODEL_NAME, LocalEngine, tiny_model_dir
from fsm_rollout.testing.fake_vllm import FakeVLLMServer
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS)
async def wire(request: pytest.FixtureRequest, http: aiohttp.ClientSession) -> AsyncIterator[Harness]:
    """Each server in turn, started once for the module."""
    if request.param == "engine":
        async with LocalEngine(
            tiny_model_dir(), served_model_name=TINY_MODEL_NAME, max_model_len=256, max_num_seqs=2, torch_threads=1
        ) as engine:
            yield EngineHarness(http, engine)
    elif request.param == "fake":
        async with FakeVLLMServer(load_qwen_tokenizer(), max_model_len=256) as server:
            yield FakeHarness(http, server)
    else:
        server = Server(0.0)
        try:
            harness = BenchHarness(http, await asyncio.to_thread(server.url))
            await harness.start()
            yield harness
        finally:
            await asyncio.to_thread(server.stop)
