"""Rollouts against a real ``vllm serve``: the seed's end-to-end checks, budgets, stop strings and turn limits.

The model has random weights, so its text cannot be chosen; greedy decoding (temperature 0) makes it deterministic
instead. A probe request generates greedily from the test prompt; stop strings and stop token ids are then picked
from that output so that vLLM stops at a known token, and every expectation is derived from what vLLM answered
(the recording proxy keeps each request and answer).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from vllm_helpers import (
    ASCII_STOPS,
    GENERATE_PATH,
    MAX_MODEL_LEN,
    OBSERVATION,
    RENDER_PATH,
    GreedyProbe,
    assert_logprobs_aligned,
    greedy_probe,
    partial_stop_string,
    pick_stop_string,
    pick_stop_token,
)

from fsm_rollout import Sample, Status
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPT = "What is 6 * 7?"
EOS = "<|im_end|>"
OBSERVATION_SUFFIX = f"{EOS}\n<|im_start|>user\n{OBSERVATION}{EOS}\n<|im_start|>assistant\n"
#: A prompt of about 950 tokens: a turn without a budget reaches the served context limit after about 70 tokens.
CONTEXT_FILLING_PROMPT = "Summarise: " + " ".join(["lorem"] * 930)


@pytest.fixture(scope="session")
def greedy(vllm_server: Any, vllm_tokenizer: Any) -> GreedyProbe:
    """The server's greedy continuation of :data:`PROMPT` (deterministic for the fixed-seed model)."""
    return asyncio.run(greedy_probe(vllm_server.url, PROMPT, vllm_tokenizer))


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def choice(exchange: Any) -> dict[str, Any]:
    assert exchange.status == 200, exchange.response
    first: dict[str, Any] = exchange.response["choices"][0]
    return first


def step_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["trigger"] == "step"]


def greedy_sampling(**extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, **extra}


# --------------------------------------------------------------------------- the seed's end-to-end checks


async def test_two_turn_rollout_matches_the_seeds_end_to_end_checks(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k = pick_stop_token(greedy, vllm_tokenizer)
    stop_id = greedy.token_ids[k]
    result = await run_real(
        Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(stop_token_ids=[stop_id]), max_turns=2
    )
    sample = result.sample

    # 1. exactly render, generate, generate
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, GENERATE_PATH]
    first, second = proxy.to(GENERATE_PATH)
    first_turn, second_turn = choice(first), choice(second)
    # 2. the first generate has non-empty request and response ids; here they are exactly the probe's
    assert first.body["token_ids"] == greedy.prompt_ids
    assert first_turn["finish_reason"] == "stop"
    assert first_turn["stop_reason"] == stop_id
    assert first_turn["token_ids"] == greedy.token_ids[: k + 1]
    # 3. the second request = first request + first response + the observation suffix (no re-tokenization)
    prefix = first.body["token_ids"] + first_turn["token_ids"]
    assert second.body["token_ids"][: len(prefix)] == prefix
    suffix = second.body["token_ids"][len(prefix) :]
    assert decode(vllm_tokenizer, suffix) == OBSERVATION_SUFFIX
    # 4. the final tokens = last request + last response: nothing appended after the last turn
    assert sample.tokens == second.body["token_ids"] + second_turn["token_ids"]
    # 5. text-only: render gave no features, and none are sent
    assert first.body.get("features") is None and second.body.get("features") is None
    # 6. the response-side arrays line up
    prompt_length = len(first.body["token_ids"])
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response_length == len(sample.tokens) - prompt_length
    n1, n2 = len(first_turn["token_ids"]), len(second_turn["token_ids"])
    assert sample.loss_mask == [1] * n1 + [0] * len(suffix) + [1] * n2
    logprobs = assert_logprobs_aligned(first.response) + [0.0] * len(suffix) + assert_logprobs_aligned(second.response)
    assert sample.rollout_log_probs == logprobs
    # budgets: every turn asks for what is left of the 64 response tokens
    assert first.body["sampling_params"]["max_tokens"] == 64
    assert second.body["sampling_params"]["max_tokens"] == 64 - n1 - len(suffix)
    assert sample.response == decode(vllm_tokenizer, first_turn["token_ids"] + second_turn["token_ids"])
    assert sample.status == Status.TRUNCATED
    assert result.rollout.reason == ("length" if second_turn["finish_reason"] == "length" else "max_turns")
    assert all(body["request_id"].endswith(f"-turn{i}") for i, body in enumerate([first.body, second.body]))


async def test_logprobs_are_present_finite_and_aligned_with_sampling(run_real: Any, proxy: Any) -> None:
    sampling = {"max_new_tokens": 96, "temperature": 0.8, "top_p": 0.95, "seed": 1234, "stop": ASCII_STOPS}
    result = await run_real(Sample(prompt="Name a colour.", index=3), sampling=sampling, max_turns=3)
    sample = result.sample
    generated = []
    for exchange in proxy.to(GENERATE_PATH):
        generated.extend(assert_logprobs_aligned(exchange.response))
    model_logprobs = [lp for lp, bit in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if bit]
    assert model_logprobs == generated
    assert all(lp == 0.0 for lp, bit in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not bit)
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert any(lp < 0.0 for lp in generated)


# --------------------------------------------------------------------------- budgets


async def test_max_tokens_16_is_honoured_on_a_single_turn(run_real: Any, proxy: Any, greedy: GreedyProbe) -> None:
    # vLLM's render drops max_tokens equal to its default (16); the library must still send it on generate.
    result = await run_real(Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(max_new_tokens=16))
    (request,) = proxy.to(GENERATE_PATH)
    assert request.body["sampling_params"]["max_tokens"] == 16
    assert choice(request)["finish_reason"] == "length"
    assert choice(request)["token_ids"] == greedy.token_ids[:16]
    assert result.sample.response_length == 16
    assert result.sample.status == Status.TRUNCATED and result.rollout.reason == "length"


async def test_max_tokens_is_honoured_on_every_turn_including_16_on_a_later_turn(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k = pick_stop_token(greedy, vllm_tokenizer)
    stop = {"stop_token_ids": [greedy.token_ids[k]]}
    # A first run measures the observation suffix; the budget then leaves exactly 16 tokens for the second turn.
    await run_real(Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(**stop), max_turns=2)
    first, second = proxy.to(GENERATE_PATH)
    suffix_length = len(second.body["token_ids"]) - len(first.body["token_ids"]) - (k + 1)
    budget = (k + 1) + suffix_length + 16
    proxy.exchanges.clear()

    result = await run_real(
        Sample(prompt=PROMPT, index=1), sampling=greedy_sampling(max_new_tokens=budget, **stop), max_turns=3
    )
    first, second = proxy.to(GENERATE_PATH)
    assert first.body["sampling_params"]["max_tokens"] == budget
    assert len(choice(first)["token_ids"]) == k + 1
    assert second.body["sampling_params"]["max_tokens"] == 16
    assert choice(second)["finish_reason"] == "length"
    assert len(choice(second)["token_ids"]) == 16
    assert result.sample.response_length == budget
    assert result.sample.status == Status.TRUNCATED and result.rollout.reason == "length"
    for exchange in proxy.to(GENERATE_PATH):
        assert len(choice(exchange)["token_ids"]) <= exchange.body["sampling_params"]["max_tokens"]


async def test_a_turn_without_a_budget_sends_max_tokens_null_and_runs_to_the_context_limit(
    run_real: Any, proxy: Any
) -> None:
    sampling = greedy_sampling(max_new_tokens=None)
    result = await run_real(Sample(prompt=CONTEXT_FILLING_PROMPT, index=0), sampling=sampling, max_turns=1)
    (request,) = proxy.to(GENERATE_PATH)
    turn = choice(request)
    # greedy decoding of this prompt never emits EOS: vLLM generates up to its context limit, not 16 tokens
    assert turn["finish_reason"] == "length"
    assert len(request.body["token_ids"]) + len(turn["token_ids"]) == MAX_MODEL_LEN
    assert len(turn["token_ids"]) > 16
    assert result.sample.response_length == len(turn["token_ids"])
    assert result.sample.status == Status.TRUNCATED and result.rollout.reason == "length"
    # the request said "no budget" explicitly: a null max_tokens means the context limit on every vLLM, while an
    # absent one means 16 on servers older than 0.32
    params = request.body["sampling_params"]
    assert "max_tokens" in params
    assert params["max_tokens"] is None


async def test_length_finish_truncates_without_stepping_the_environment(
    run_real: Any, proxy: Any, greedy: GreedyProbe
) -> None:
    result = await run_real(Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(max_new_tokens=8), max_turns=3)
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH]
    (request,) = proxy.to(GENERATE_PATH)
    assert choice(request)["finish_reason"] == "length"
    assert result.sample.tokens == greedy.prompt_ids + greedy.token_ids[:8]
    assert result.sample.response_length == 8
    assert result.sample.status == Status.TRUNCATED and result.rollout.reason == "length"
    assert result.envs.last.calls == ["reset", "close"]


async def test_env_done_completes_after_one_turn(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k = pick_stop_token(greedy, vllm_tokenizer)
    result = await run_real(
        Sample(prompt=PROMPT, index=0),
        sampling=greedy_sampling(stop_token_ids=[greedy.token_ids[k]]),
        envs=ScriptedEnvFactory(steps=[("correct", True)]),
        max_turns=3,
    )
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH]
    assert result.sample.status == Status.COMPLETED and result.rollout.reason == "env_done"
    assert result.sample.tokens == greedy.prompt_ids + greedy.token_ids[: k + 1]
    assert result.envs.last.calls == ["reset", "step", "close"]


# --------------------------------------------------------------------------- stop strings and the masked EOS


@pytest.mark.parametrize("no_stop_trim", [True, False], ids=["stop-string-kept", "stop-string-trimmed"])
async def test_stop_string_at_the_end_of_the_turn_gets_one_masked_eos(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any, no_stop_trim: bool
) -> None:
    k, stop = pick_stop_string(greedy, vllm_tokenizer)
    eos = vllm_tokenizer.eos_token_id
    sampling = greedy_sampling(stop=[stop], no_stop_trim=no_stop_trim)
    result = await run_real(Sample(prompt=PROMPT, index=0), sampling=sampling, max_turns=2)
    first, second = proxy.to(GENERATE_PATH)
    turn = choice(first)
    assert first.body["sampling_params"]["stop"] == [stop]
    assert first.body["sampling_params"].get("include_stop_str_in_output", False) is no_stop_trim
    # vLLM stops after token k; it trims only its text, never the token ids (both modes)
    assert (turn["finish_reason"], turn["stop_reason"]) == ("stop", stop)
    assert turn["token_ids"] == greedy.token_ids[: k + 1]
    assert decode(vllm_tokenizer, turn["token_ids"]).endswith(stop)
    # the rule: the turn's text ends with the stop string and not with EOS -> exactly one masked EOS
    start = len(first.body["token_ids"])
    after = second.body["token_ids"][start + k + 1 :]
    assert after[0] == eos and after[1] != eos
    assert decode(vllm_tokenizer, after) == OBSERVATION_SUFFIX
    assert result.sample.loss_mask[k + 1] == 0 and result.sample.rollout_log_probs[k + 1] == 0.0
    assert step_events(result.events)[0]["eos_inserted"] is True


async def test_stop_string_ending_mid_token_gets_no_eos_by_the_rule(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k, whole = pick_stop_string(greedy, vllm_tokenizer)
    stop = partial_stop_string(greedy, vllm_tokenizer, k, whole)
    result = await run_real(
        Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(stop=[stop], no_stop_trim=True), max_turns=1
    )
    (request,) = proxy.to(GENERATE_PATH)
    turn = choice(request)
    assert (turn["finish_reason"], turn["stop_reason"]) == ("stop", stop)
    assert turn["token_ids"] == greedy.token_ids[: k + 1]
    # the decoded turn does not end with the stop string: no EOS is appended, even on the last turn
    assert result.sample.tokens == request.body["token_ids"] + turn["token_ids"]
    assert step_events(result.events)[0]["eos_inserted"] is False
    assert result.rollout.reason == "max_turns"


async def test_stop_string_on_the_last_turn_leaves_the_masked_eos_at_the_end(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k, stop = pick_stop_string(greedy, vllm_tokenizer)
    result = await run_real(
        Sample(prompt=PROMPT, index=0), sampling=greedy_sampling(stop=[stop], no_stop_trim=True), max_turns=1
    )
    (request,) = proxy.to(GENERATE_PATH)
    eos = vllm_tokenizer.eos_token_id
    assert result.sample.tokens == request.body["token_ids"] + greedy.token_ids[: k + 1] + [eos]
    assert result.sample.loss_mask == [1] * (k + 1) + [0]
    assert result.sample.response_length == k + 2
    assert result.rollout.reason == "max_turns"


async def test_stop_string_without_budget_for_the_eos_truncates(
    run_real: Any, proxy: Any, greedy: GreedyProbe, vllm_tokenizer: Any
) -> None:
    k, stop = pick_stop_string(greedy, vllm_tokenizer)
    sampling = greedy_sampling(max_new_tokens=k + 1, stop=[stop], no_stop_trim=True)
    result = await run_real(Sample(prompt=PROMPT, index=0), sampling=sampling, max_turns=3)
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH]
    (request,) = proxy.to(GENERATE_PATH)
    # the stop string lands on the last allowed token: vLLM reports "stop" (not "length")
    assert (choice(request)["finish_reason"], choice(request)["stop_reason"]) == ("stop", stop)
    assert result.sample.status == Status.TRUNCATED
    assert result.rollout.reason == "insufficient_budget_for_stop_eos"
    assert result.sample.tokens == request.body["token_ids"] + greedy.token_ids[: k + 1]
    assert result.sample.metadata["multiturn_truncation"] == {
        "reason": "insufficient_budget_for_stop_eos",
        "remaining_budget": 0,
    }


async def test_stop_string_that_never_appears_changes_nothing(run_real: Any, proxy: Any, greedy: GreedyProbe) -> None:
    sampling = greedy_sampling(max_new_tokens=12, stop=["\u2603never-generated\u2603"], no_stop_trim=True)
    result = await run_real(Sample(prompt=PROMPT, index=0), sampling=sampling)
    (request,) = proxy.to(GENERATE_PATH)
    assert choice(request)["finish_reason"] == "length"
    assert result.sample.tokens == greedy.prompt_ids + greedy.token_ids[:12]
    assert result.rollout.reason == "length"


# --------------------------------------------------------------------------- turn limits


async def test_every_turn_follows_the_eos_rule_until_the_turn_limit(
    run_real: Any, proxy: Any, vllm_tokenizer: Any
) -> None:
    eos = vllm_tokenizer.eos_token_id
    sampling = {"max_new_tokens": 300, "temperature": 0.0, "top_p": 1.0, "stop": ASCII_STOPS, "no_stop_trim": True}
    result = await run_real(Sample(prompt="Count to three.", index=5), sampling=sampling, max_turns=3)
    sample = result.sample
    requests = proxy.to(GENERATE_PATH)
    assert proxy.paths == [RENDER_PATH, GENERATE_PATH, GENERATE_PATH, GENERATE_PATH]
    assert sample.status == Status.TRUNCATED and result.rollout.reason == "max_turns"
    assert result.envs.last.calls == ["reset", "step", "format_observation", "step", "format_observation", "step",
                                      "close"]  # fmt: skip
    steps = step_events(result.events)
    observations = [event["observation_tokens"] for event in result.events if "observation_tokens" in event]
    for index, exchange in enumerate(requests):
        turn = choice(exchange)
        assert turn["finish_reason"] == "stop"
        text = decode(vllm_tokenizer, turn["token_ids"])
        due = text.endswith(tuple(ASCII_STOPS)) and turn["token_ids"][-1] != eos
        assert steps[index]["eos_inserted"] is due, (index, text)
        done = exchange.body["token_ids"] + turn["token_ids"] + ([eos] if due else [])
        if index + 1 < len(requests):
            following = requests[index + 1].body["token_ids"]
            assert following[: len(done)] == done
            assert len(following) - len(done) == observations[index]
            assert decode(vllm_tokenizer, following[len(exchange.body["token_ids"]) + len(turn["token_ids"]) :]) == (
                OBSERVATION_SUFFIX
            )
        else:
            assert sample.tokens == done
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
