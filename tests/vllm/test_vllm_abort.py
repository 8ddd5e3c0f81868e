"""Aborting a long generation on a real ``vllm serve``: the sample ends aborted, the server stops, nothing follows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from vllm_helpers import ABORT_PATH, GENERATE_PATH, RENDER_PATH, SERVED_MODEL, metrics

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPT = "Write a very long story."
#: Far more than the ~0.5 s the tests wait before aborting (the tiny model makes ~75 tokens/s on 2 cores).
LONG = {"max_new_tokens": 900, "temperature": 1.0, "top_p": 1.0, "seed": 7}


async def eventually(predicate: Callable[[], Any], limit_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + limit_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def generating(base_url: str) -> bool:
    return (await metrics(base_url)).get("vllm:num_requests_running", 0.0) >= 1


async def server_idle(base_url: str) -> bool:
    return (await metrics(base_url)).get("vllm:num_requests_running", 0.0) == 0


async def test_abort_of_a_long_generation_stops_it_at_the_server_and_sends_nothing_after(
    make_real_rollout: Any, proxy: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    rollout, envs = make_real_rollout(Sample(prompt=PROMPT, index=0, session_id="abort-1"), sampling=dict(LONG))
    tokens_before = (await metrics(vllm_server.url))["vllm:generation_tokens_total"]
    task = asyncio.create_task(rollout.run())
    await eventually(lambda: proxy.to(GENERATE_PATH), what="the generate request")
    await eventually(lambda: generating(vllm_server.url), what="vLLM to run the request")
    await asyncio.sleep(0.3)

    started = time.monotonic()
    await rollout.abort("weight_update")
    assert time.monotonic() - started < 5.0
    assert await task is rollout.sample

    sample = rollout.sample
    assert rollout.state == "aborted"
    assert sample.status == Status.ABORTED
    assert sample.metadata["rollout_reason"] == "weight_update"
    assert "abort_notice_error" not in sample.metadata
    # the request in flight was named to the abort endpoint, and it is the last request
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, ABORT_PATH]
    (generate,) = proxy.to(GENERATE_PATH)
    (abort,) = proxy.to(ABORT_PATH)
    assert generate.body["request_id"] == "abort-1-turn0"
    assert abort.body == {"request_ids": ["abort-1-turn0", "generate-tokens-abort-1-turn0"]}
    assert abort.status == 200
    assert generate.client_gone
    # the aborted turn left nothing behind
    assert sample.tokens == generate.body["token_ids"]
    assert sample.response_length == 0 and sample.loss_mask == [] and sample.rollout_log_probs == []
    assert sample.response == ""
    assert envs.last.close_count == 1
    # the server stopped generating long before max_tokens
    await eventually(lambda: server_idle(vllm_server.url), limit_s=5.0, what="vLLM to drop the request")
    settled = (await metrics(vllm_server.url))["vllm:generation_tokens_total"]
    await asyncio.sleep(1.0)
    assert (await metrics(vllm_server.url))["vllm:generation_tokens_total"] == settled
    assert settled - tokens_before < LONG["max_new_tokens"]
    # no request follows the abort
    await asyncio.sleep(0.5)
    assert len(proxy.exchanges) == 3


async def test_cancelling_the_rollout_task_aborts_with_reason_cancelled(
    make_real_rollout: Any, proxy: Any, vllm_server: Any
) -> None:
    rollout, envs = make_real_rollout(Sample(prompt=PROMPT, index=1, session_id="cancel-1"), sampling=dict(LONG))
    task = asyncio.create_task(rollout.run())
    await eventually(lambda: proxy.to(GENERATE_PATH), what="the generate request")
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rollout.state == "aborted" and rollout.reason == "cancelled"
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, ABORT_PATH]
    assert proxy.to(ABORT_PATH)[0].body == {"request_ids": ["cancel-1-turn0", "generate-tokens-cancel-1-turn0"]}
    assert envs.last.close_count == 1
    await eventually(lambda: server_idle(vllm_server.url), limit_s=5.0, what="vLLM to drop the request")


async def test_abort_notice_alone_stops_the_request_at_the_server(
    holding_proxy: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.05)
    config = RolloutConfig(engine_url=holding_proxy.url, model=SERVED_MODEL, max_turns=2, retry=retry)
    async with VLLMClient(holding_proxy.url, retry=retry) as client:
        rollout = Rollout(
            Sample(prompt=PROMPT, index=2, session_id="held-1"),
            config=config,
            sampling_params={**LONG, "max_new_tokens": 600},
            client=client,
            tokenizer=vllm_tokenizer,
            env_factory=ScriptedEnvFactory(),
        )
        task = asyncio.create_task(rollout.run())
        await eventually(lambda: holding_proxy.to(GENERATE_PATH), what="the generate request")
        await eventually(lambda: generating(vllm_server.url), what="vLLM to run the request")
        await asyncio.sleep(0.3)
        await rollout.abort("weight_update")
        await task
    assert rollout.sample.status == Status.ABORTED
    assert holding_proxy.to(ABORT_PATH)[0].body == {"request_ids": ["held-1-turn0", "generate-tokens-held-1-turn0"]}
    await holding_proxy.settle(60.0)
    (generate,) = holding_proxy.to(GENERATE_PATH)
    assert generate.client_gone
    answer = generate.response["choices"][0]
    assert answer["finish_reason"] == "abort", (
        f"vLLM finished the abandoned request with {answer['finish_reason']!r} after {len(answer['token_ids'])} "
        f"tokens; its id at the server was {generate.response['request_id']!r}"
    )
