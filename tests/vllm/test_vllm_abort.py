"""Aborting a long generation on a real ``vllm serve``: the sample ends aborted, the server stops, nothing follows.

The tests wait on events, never on time. Each starts on a quiet server and takes its own baseline of vLLM's
generated-token count (``quiet_server``), so the first token counted after it is its own request's. The proxy keeps
vLLM's answer to the generate request until the test is over, so the rollout can only see the abort, however fast
vLLM is. vLLM's scheduler is frozen (``frozen``) before the rollout sends its request, and runs only in short
windows until that request has a token (``step_until``), so the request is registered and running, a few tokens
into a long generation, and cannot finish before the abort lands, however loaded the machine. After ``/resume`` a
short sentinel request shows whether anything else still generates (``generated_alongside``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from vllm_helpers import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    SERVED_MODEL,
    frozen,
    generated_alongside,
    generated_since,
    generation_tokens,
    quiet_server,
    server_idle,
    step_until,
    wait_until,
)

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPT = "Write a very long story."
#: The limit of a wait on an event (it only turns a hang into a failure).
WAIT_S = 120.0
#: A generation that would run for many seconds (the tiny model makes ~55-75 tokens/s on 2 cores), and cannot end
#: early on a sampled end token (``min_new_tokens``); the tests do not rely on its length: they freeze the
#: scheduler or hold vLLM's answer at the proxy while the abort is on its way.
LONG = {"max_new_tokens": 900, "min_new_tokens": 900, "temperature": 1.0, "top_p": 1.0, "seed": 7}


async def test_abort_of_a_long_generation_stops_it_at_the_server_and_sends_nothing_after(
    make_real_rollout: Any, proxy: Any, vllm_server: Any
) -> None:
    tokens_before = await quiet_server(vllm_server.url)
    rollout, envs = make_real_rollout(Sample(prompt=PROMPT, index=0, session_id="abort-1"), sampling=dict(LONG))
    proxy.hold_answers(GENERATE_PATH)
    async with frozen(vllm_server.url):  # the generation waits at vLLM and runs only in the test's short windows
        task = asyncio.create_task(rollout.run())
        generate = await proxy.arrival(GENERATE_PATH)
        await step_until(vllm_server.url, generated_since(vllm_server.url, tokens_before), "the first token")
        await rollout.abort("weight_update")
        # the rollout ends while its generation cannot (the server is frozen, its answer held at the proxy): it did
        # not wait for the answer (the limit only turns a hang into a failure)
        assert await asyncio.wait_for(task, WAIT_S) is rollout.sample
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
    await proxy.client_left(generate)  # the rollout dropped its request: the proxy saw the disconnect
    # the aborted turn left nothing behind
    assert sample.tokens == generate.body["token_ids"]
    assert sample.response_length == 0 and sample.loss_mask == [] and sample.rollout_log_probs == []
    assert sample.response == ""
    assert envs.last.close_count == 1
    # the server dropped the request: after /resume it generates nothing beside a sentinel request
    assert await generated_alongside(vllm_server.url) == 0
    await wait_until(lambda: server_idle(vllm_server.url), "vLLM to drop the request")
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
    async with frozen(vllm_server.url):  # the generation waits at vLLM and runs only in the test's short windows
        task = asyncio.create_task(rollout.run())
        await proxy.arrival(GENERATE_PATH)
        await step_until(vllm_server.url, generated_since(vllm_server.url, tokens_before), "the first token")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
    assert rollout.state == "aborted" and rollout.reason == "cancelled"
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, ABORT_PATH]
    assert proxy.to(ABORT_PATH)[0].body == {"request_ids": ["cancel-1-turn0", "generate-tokens-cancel-1-turn0"]}
    assert envs.last.close_count == 1
    # the sentinel runs engine steps, which refresh the request gauges the idle check reads
    assert await generated_alongside(vllm_server.url) == 0
    await wait_until(lambda: server_idle(vllm_server.url), "vLLM to drop the request")


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
            sampling_params={**LONG, "max_new_tokens": 600, "min_new_tokens": 600},
            client=client,
            tokenizer=vllm_tokenizer,
            env_factory=ScriptedEnvFactory(),
        )
        async with frozen(vllm_server.url):  # the generation waits at vLLM and runs only in the test's windows
            task = asyncio.create_task(rollout.run())
            generate = await holding_proxy.arrival(GENERATE_PATH)
            await step_until(vllm_server.url, generated_since(vllm_server.url, tokens_before), "the first token")
            await rollout.abort("weight_update")
            await asyncio.wait_for(task, WAIT_S)
            # the client dropped its request, and the proxy saw it go
            await holding_proxy.client_left(generate)
            # the proxy kept the upstream request going: only the abort notice can end it, and vLLM answers it
            await asyncio.wait_for(generate.upstream_done.wait(), WAIT_S)
    assert rollout.sample.status == Status.ABORTED
    assert holding_proxy.to(ABORT_PATH)[0].body == {"request_ids": ["held-1-turn0", "generate-tokens-held-1-turn0"]}
    await holding_proxy.settle(60.0)
    (generate,) = holding_proxy.to(GENERATE_PATH)
    answer = generate.response["choices"][0]
    assert answer["finish_reason"] == "abort", (
        f"vLLM finished the abandoned request with {answer['finish_reason']!r} after {len(answer['token_ids'])} "
        f"tokens; its id at the server was {generate.response['request_id']!r}"
    )
    # the engine dropped it too: after /resume nothing generates beside a sentinel request
    assert await generated_alongside(vllm_server.url) == 0
