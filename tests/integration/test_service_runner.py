"""The RolloutService contract (tests/service_contract.py) against RolloutRunner."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from service_contract import *  # noqa: F403  (the contract's tests, collected here)
from service_contract import Contract

from fsm_rollout import RetryPolicy, RolloutConfig
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import FakeVLLMServer

SAMPLING = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0}


@pytest.fixture
async def contract(fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Path) -> AsyncIterator[Contract]:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=2, router_policy="consistent_hash",
                           env_path="fsm_rollout.testing.envs", trace=tmp_path / "run.jsonl",
                           retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))  # fmt: skip
    async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer) as runner:
        yield Contract(runner, fake_vllm, tmp_path, parallel=1)
        runner.tracer.flush()
