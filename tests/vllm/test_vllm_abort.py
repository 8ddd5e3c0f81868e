"""Aborting a long generation on a real ``vllm serve``: the sample ends aborted, the server stops, nothing follows.

The tests wait on events, never on time. Each starts on a quiet server and takes its own baseline of vLLM's
generated-token count (``quiet_server``), so the first token counted after it is its own request's. The proxy keeps
vLLM's answer to the generate request until the test is over, so the rollout can only see the abort, however fast
vLLM is; and the tests that check vLLM's side abort while its scheduler is frozen (``frozen``), so the generation
cannot finish before the abort lands. After ``/resume`` a short sentinel request shows whether anything else still
generates (``generated_alongside``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from vllm_helpers import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    SERVED_MODEL,
    frozen,
    generated_alongside,
    generation_started,
    generation_tokens,
    quiet_server,
    server_idle,
    wait_until,
)

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPT = "Write a very long story."
#: A generation that would run for many seconds (the tiny model makes ~55-75 tokens/s on 2 cores); the tests do
#: not rely on that: they freeze the scheduler or hold vLLM's answer at the proxy while the abort is on its way.
LONG = {"max_new_tokens": 900, "temperature": 1.0, "top_p": 1.0, "seed": 7}


async def test_abort_of_a_long_generation_stops_it_at_the_server_and_sends_nothing_after(
    make_real_rollout: Any, proxy: Any, vllm_server: Any
) -> None:
    tokens_before = await quiet_server(vllm_server.url)
    rollout, envs = make_real_rollout(Sample(prompt=PROMPT, index=0, session_id="abort-1"), sampling=dict(LONG))
    proxy.hold_answers(GENERATE_PATH)
    task = asyncio.create_task(rollout.run())
    generate = await proxy.arrival(GENERATE_PATH)
    await generation_started(vllm_server.url, tokens_before)

    async with frozen(vllm_server.url):
        started = time.monotonic()
        await rollout.abort("weight_update")
        assert time.monotonic() - started < 5.0
        assert await task is rollout.sample
        # the rollout ended while its generation was still going at the server: it did not wait for the answer
        assert not generate.answered

    sample = rollout.sample
    assert rollout.state == "aborted"
    assert sample.status == Status.ABORTED
    assert sample.metadata["rollout_reason"] == "weight_update"
    assert "abort_notice_error" not in sample.metadata
    # the request in flight was named to the abort endpoint, and it is the last request
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, ABORT_PATH]
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
    # the server dropped the request: after /resume it generates nothing beside a sentinel request
    assert await generated_alongside(vllm_server.url) == 0
    await wait_until(lambda: server_idle(vllm_server.url), "vLLM to drop the request", limit_s=5.0)
    settled = await generation_tokens(vllm_server.url)
    assert settled - tokens_before < LONG["max_new_tokens"]
    # no request follows the abort (the rollout's task is over, so nothing of it can still send one)
    assert task.done()
    assert len(proxy.exchanges) == 3


async def test_cancelling_the_rollout_task_aborts_with_reason_cancelled(
    make_real_rollout: Any, proxy: Any, vllm_server: Any
) -> None:
    tokens_before = await quiet_server(vllm_server.url)
    rollout, envs = make_real_rollout(Sample(prompt=PROMPT, index=1, session_id="cancel-1"), sampling=dict(LONG))
    proxy.hold_answers(GENERATE_PATH)  # the turn is in flight when the task is cancelled, whatever vLLM's speed
    task = asyncio.create_task(rollout.run())
    await proxy.arrival(GENERATE_PATH)
    await generation_started(vllm_server.url, tokens_before)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rollout.state == "aborted" and rollout.reason == "cancelled"
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, ABORT_PATH]
    assert proxy.to(ABORT_PATH)[0].body == {"request_ids": ["cancel-1-turn0", "generate-tokens-cancel-1-turn0"]}
    assert envs.last.close_count == 1
    await wait_until(lambda: server_idle(vllm_server.url), "vLLM to drop the request", limit_s=5.0)
    assert await generated_alongside(vllm_server.url) == 0


async def test_abort_notice_alone_stops_the_request_at_the_server(
    holding_proxy: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    tokens_before = await quiet_server(vllm_server.url)
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.05)
    config = RolloutConfig(engine_url=holding_proxy.url, model=SERVED_MODEL, max_turns=2, retry=retry)
    holding_proxy.hold_answers(GENERATE_PATH)
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
        generate = await holding_proxy.arrival(GENERATE_PATH)
        await generation_started(vllm_server.url, tokens_before)
        async with frozen(vllm_server.url):
            await rollout.abort("weight_update")
            await task
            # the proxy kept the upstream request going: only the abort notice can end it, and vLLM answers it
            await asyncio.wait_for(generate.upstream_done.wait(), 60.0)
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
    # the engine dropped it too: after /resume nothing generates beside a sentinel request
    assert await generated_alongside(vllm_server.url) == 0
