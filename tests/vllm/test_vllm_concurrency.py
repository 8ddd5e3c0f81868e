"""64 samples at once through one client against one real ``vllm serve`` (8 sequences at a time)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import pytest
from vllm_helpers import ASCII_STOPS, GENERATE_PATH, OBSERVATION, RENDER_PATH, assert_logprobs_aligned

from fsm_rollout import Rollout, Sample, Status, capture_transitions
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

SAMPLES = 64
EOS = "<|im_end|>"


async def test_64_concurrent_samples_complete_with_correct_invariants(
    vllm_config: Any, engine: Any, vllm_tokenizer: Any, proxy: Any
) -> None:
    eos = vllm_tokenizer.eos_token_id
    config = vllm_config(max_turns=3)
    rollouts = []
    for index in range(SAMPLES):
        # Half stop quickly (the ASCII stop strings), half run into their budget: a mix of turn counts and ends.
        sampling: dict[str, Any] = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 1.0, "seed": index}
        if index % 2 == 0:
            sampling.update(stop=ASCII_STOPS, no_stop_trim=True)
        rollouts.append(
            Rollout(
                Sample(prompt=f"Question {index}: what is {index} + {index}?", index=index, session_id=f"c{index}"),
                config=config,
                sampling_params=sampling,
                client=engine,
                tokenizer=vllm_tokenizer,
                env_factory=ScriptedEnvFactory(),
            )
        )
    started = time.perf_counter()
    with capture_transitions() as events:
        results = await asyncio.gather(*(rollout.run() for rollout in rollouts), return_exceptions=True)
    elapsed = time.perf_counter() - started
    failures = [result for result in results if isinstance(result, BaseException)]
    assert not failures, failures[:3]

    by_sample: dict[str, list[Any]] = defaultdict(list)
    for exchange in proxy.to(GENERATE_PATH):
        by_sample[exchange.request_id.rsplit("-turn", 1)[0]].append(exchange)
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["trigger"] == "step":
            steps[event["sample_id"]].append(event)
    assert len(proxy.to(RENDER_PATH)) == SAMPLES
    assert {exchange.status for exchange in proxy.exchanges} == {200}

    outcomes: dict[str, int] = defaultdict(int)
    for rollout in rollouts:
        sample = rollout.sample
        outcomes[rollout.reason or "?"] += 1
        assert sample.status in (Status.TRUNCATED, Status.COMPLETED), (sample.index, sample.status, rollout.reason)
        requests = sorted(by_sample[sample.session_id], key=lambda exchange: exchange.request_id)
        assert [exchange.request_id for exchange in requests] == [
            f"{sample.session_id}-turn{turn}" for turn in range(len(requests))
        ]
        assert 1 <= len(requests) <= 3
        prompt = requests[0].body["token_ids"]
        assert vllm_tokenizer.decode(prompt).endswith(
            f"Question {sample.index}: what is {sample.index} + {sample.index}?{EOS}\n<|im_start|>assistant\n"
        )
        expected_mask: list[int] = []
        expected_logprobs: list[float] = []
        for turn, exchange in enumerate(requests):
            answer = exchange.response["choices"][0]
            logprobs = assert_logprobs_aligned(exchange.response)
            assert len(answer["token_ids"]) <= exchange.body["sampling_params"]["max_tokens"]
            inserted = steps[str(sample.index)][turn].get("eos_inserted", False)
            done = exchange.body["token_ids"] + answer["token_ids"] + ([eos] if inserted else [])
            expected_mask += [1] * len(answer["token_ids"]) + ([0] if inserted else [])
            expected_logprobs += logprobs + ([0.0] if inserted else [])
            if turn + 1 < len(requests):
                following = requests[turn + 1].body["token_ids"]
                assert following[: len(done)] == done  # no re-tokenization, no interleaving between samples
                suffix = following[len(exchange.body["token_ids"]) + len(answer["token_ids"]) :]
                assert vllm_tokenizer.decode(suffix) == (
                    f"{EOS}\n<|im_start|>user\n{OBSERVATION}{EOS}\n<|im_start|>assistant\n"
                )
                observation = len(following) - len(done)
                expected_mask += [0] * observation
                expected_logprobs += [0.0] * observation
            else:
                assert sample.tokens == done
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
        assert sample.response_length == len(sample.tokens) - len(prompt) <= 40
        assert sample.loss_mask == expected_mask
        assert sample.rollout_log_probs == expected_logprobs
    print(f"\n64 concurrent samples in {elapsed:.1f} s; outcomes {dict(outcomes)}")
    assert outcomes["max_turns"] > 0 and outcomes["length"] > 0
