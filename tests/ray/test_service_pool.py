"""The RolloutService contract (tests/service_contract.py) against RayRolloutPool: two worker actors on the local
cluster, one fake vLLM server and one pool for the module (starting workers is the slow part)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import MODEL, SAMPLING, pool_config
from service_contract import *  # noqa: F403  (the contract's tests, collected here)
from service_contract import Contract

from fsm_rollout.distributed import RayRolloutPool
from fsm_rollout.testing.fake_vllm import FakeVLLMServer
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def contract(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Contract]:
    trace_dir: Path = tmp_path_factory.mktemp("service-pool")
    async with FakeVLLMServer(load_qwen_tokenizer(), model=MODEL) as server:
        config = pool_config(server.url, str(qwen_tokenizer_dir()), trace=str(trace_dir / "run.jsonl"))
        async with RayRolloutPool(config, sampling_params=SAMPLING, num_workers=2) as pool:
            yield Contract(pool, server, trace_dir, parallel=2)
