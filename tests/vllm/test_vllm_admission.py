"""Adaptive admission reads a real ``vllm serve``'s load from ``GET /metrics`` and runs a batch by it."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_rollout import Sample, Status
from fsm_rollout.engine.load import LoadReader
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm


async def test_adaptive_admission_reads_vllms_metrics_and_runs_a_batch_by_them(
    vllm_server: Any, vllm_config: Any, vllm_tokenizer: Any
) -> None:
    reader = LoadReader()
    try:
        load = await reader.read(vllm_server.url)
    finally:
        await reader.close()
    assert load is not None, "vLLM published none of vllm:num_requests_running / vllm:num_requests_waiting"
    assert load.running >= 0 and load.waiting >= 0 and 0.0 <= load.kv_cache_usage <= 1.0 and load.preemptions >= 0

    config = vllm_config(max_turns=2, admission="adaptive", admission_max_waiting=1)
    sampling = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0}
    factory = ScriptedEnvFactory()
    async with RolloutRunner(config, sampling_params=sampling, tokenizer=vllm_tokenizer, env_factory=factory) as runner:
        assert runner.admission is not None  # the server's /metrics was read (through the test's proxy)
        controller = runner.admission.controllers[config.engine_url]
        samples = [Sample(prompt=f"Question {i}: what is {i} + {i}?", index=i) for i in range(6)]
        done = await runner.run_batch(samples)
    assert all(sample.status in (Status.COMPLETED, Status.TRUNCATED) for sample in done)
    assert controller.load is not None and controller.in_flight == 0
