"""Weight updates against a real ``vllm serve``: rollouts suspended and resumed lose no token.

Greedy decoding (temperature 0) makes the random model deterministic, so a rollout suspended mid-turn (its request
aborted at vLLM, the tokens made so far kept and sent back as part of the continuation's prompt) must end exactly as
the uninterrupted one. Turns are long: ``min_new_tokens`` keeps vLLM from stopping (EOS and stop strings alike)
before :data:`TURN_MIN` tokens, then any ASCII letter ends the turn, so every turn is a little over
:data:`TURN_MIN` tokens and a suspension taken a few tokens into a turn lands mid-turn.

The tests never race vLLM. They freeze its scheduler (``vllm_helpers.freeze``) before the requests they mean to
catch are sent, so those queue at vLLM and cannot advance; then they let the engine run in short windows
(``vllm_helpers.step_until``: resume, then pause at once) until vLLM's own count shows the requests a few tokens in,
and suspend while it is still frozen: every request is then in flight and mid-turn, whatever the machine's load.
The other moments are events too: a request has reached the proxy, a rollout took a transition (the runner's
hooks), an answer is held at the proxy. Waits are bounded and fail naming what they waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from vllm_helpers import (
    ABORT_PATH,
    ASCII_STOPS,
    GENERATE_PATH,
    RENDER_PATH,
    freeze,
    generated_since,
    generation_tokens,
    metrics,
    post,
    quiet_server,
    step_until,
    thaw,
)

from fsm_rollout import RolloutRunner, Sample, Status
from fsm_rollout.engine.client import server_request_ids
from fsm_rollout.engine.schema import PAUSE_PATH, RESUME_PATH, UPDATE_WEIGHT_VERSION_PATH
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.rollout import Rollout
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPTS = ["Question 0: tell me a long story.", "Question 1: explain the sky.", "Question 2: count to a hundred."]
#: Tokens every turn makes before it may stop: long, so that a step window stretched by a loaded machine (a window
#: is two HTTP calls, resume then pause) moves a turn by a fraction of it, never to its end.
TURN_MIN = 256
MAX_TURNS = 3
#: Tokens every turn makes in the keep test, which freezes its first turn a few tokens in and lets it go on after
#: the weight update: long, so that it is still going when the runner's own pause lands.
KEEP_TURN_MIN = 400
#: Room for the keep test's two turns and the observation between them (within the server's context length).
KEEP_BUDGET = 900
#: Room for MAX_TURNS turns of a little over TURN_MIN tokens and the observations between them.
BUDGET = 900
SAMPLING = {"max_new_tokens": BUDGET, "temperature": 0.0, "top_p": 1.0, "min_new_tokens": TURN_MIN,
            "stop": ASCII_STOPS}  # fmt: skip
#: The weight version vLLM reports until one is set.
DEFAULT_VERSION = "default"
WAIT_S = 120.0


class Watch(RolloutHooks):
    """The transitions of a runner's rollouts, with waits on them."""

    wants_events = True

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.rollouts: dict[str, Rollout] = {}
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    def transition(
        self, rollout: Rollout, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        self.rollouts[rollout.sample_id] = rollout
        self.events.append({**(fields or {}), "sample": rollout.sample_id, "trigger": trigger, "src": src,
                            "dst": rollout.state})  # fmt: skip
        for predicate, waiter in self._waiters:
            if not waiter.done() and predicate():
                waiter.set_result(None)

    def of(self, trigger: str, sample: str | None = None) -> list[dict[str, Any]]:
        return [event for event in self.events
                if event["trigger"] == trigger and (sample is None or event["sample"] == sample)]  # fmt: skip

    async def until(self, predicate: Callable[[], bool], what: str, limit_s: float = WAIT_S) -> None:
        if predicate():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (predicate, waiter)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(waiter, limit_s)
        except TimeoutError:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}") from None
        finally:
            self._waiters.remove(entry)


def samples(prefix: str, count: int = len(PROMPTS)) -> list[Sample]:
    # The session id names the requests (``<session>-turn<N>[-part<M>]``).
    return [Sample(prompt=PROMPTS[index], index=index, session_id=f"{prefix}-{index}") for index in range(count)]


async def running_requests(base_url: str) -> float:
    return (await metrics(base_url)).get("vllm:num_requests_running", 0.0)


def finish_reason(exchange: Any) -> str | None:
    response = exchange.response
    if not isinstance(response, dict) or not response.get("choices"):
        return None
    reason: str | None = response["choices"][0].get("finish_reason")
    return reason


def turns_of(loss_mask: Sequence[int]) -> int:
    """How many runs of generated (mask 1) positions the response has."""
    return len(turn_lengths(loss_mask))


def turn_lengths(loss_mask: Sequence[int]) -> list[int]:
    """The length of each run of generated (mask 1) positions, in order: the tokens of each turn."""
    lengths: list[int] = []
    for index, bit in enumerate(loss_mask):
        if bit == 1:
            if index == 0 or loss_mask[index - 1] != 1:
                lengths.append(0)
            lengths[-1] += 1
    return lengths


def span_positions(sample: Sample) -> list[int]:
    spans = sample.metadata.get("weight_version_spans") or []
    return [position for span in spans for position in range(span["start"], span["end"])]


def generated_positions(sample: Sample) -> list[int]:
    return [position for position, bit in enumerate(sample.loss_mask or []) if bit == 1]


def versions_of(sample: Sample) -> list[str]:
    return [span["version"] for span in sample.metadata.get("weight_version_spans") or []]


def new_runner(config: Any, tokenizer: Any, watch: Watch | None = None, *, turn_min: int = TURN_MIN,
               budget: int = BUDGET) -> RolloutRunner:  # fmt: skip
    sampling = {**SAMPLING, "min_new_tokens": turn_min, "max_new_tokens": budget}
    return RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer, env_factory=ScriptedEnvFactory(),
                         hooks=watch, raise_on_error=True)  # fmt: skip


async def test_greedy_rollouts_suspended_mid_turn_and_between_turns_match_uninterrupted_ones(
    proxy: Any, vllm_config: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    url = vllm_server.url
    config = vllm_config(max_turns=MAX_TURNS)
    await quiet_server(url)
    async with new_runner(config, vllm_tokenizer) as runner:
        reference = await runner.run_batch(samples("ref"), concurrency=len(PROMPTS))
    for sample in reference:  # the premise: every turn ends on a stop string, so each sample has MAX_TURNS turns
        assert (sample.status, sample.metadata["rollout_reason"]) == (Status.TRUNCATED, "max_turns"), sample.metadata
        assert turns_of(sample.loss_mask) == MAX_TURNS
    # the premise of the third suspension: while sample 0 ends its first turn, no other sample can end its last one
    # (each would need a whole TURN_MIN of tokens more than sample 0 has made)
    first_turn = turn_lengths(reference[0].loss_mask or [])[0]
    assert all(sum(turn_lengths(sample.loss_mask or [])) >= first_turn + TURN_MIN for sample in reference[1:]), [
        turn_lengths(sample.loss_mask or []) for sample in reference
    ]

    watch = Watch()
    name = "wu"
    try:
        suspended_run = await _suspend_three_ways(proxy, url, config, vllm_tokenizer, watch, name)
    finally:  # the server is shared
        await thaw(url)

    suspends = watch.of("suspend")
    assert max(event["partial_tokens"] for event in suspends) > 0, suspends
    assert sorted(rollout.suspensions for rollout in watch.rollouts.values()) == [3, 3, 3], suspends
    worst = 0.0
    for before, after in zip(reference, suspended_run, strict=True):
        assert after.tokens == before.tokens
        assert after.loss_mask == before.loss_mask
        assert (after.status, after.metadata["rollout_reason"]) == (before.status, before.metadata["rollout_reason"])
        assert after.response == before.response
        assert after.rollout_log_probs == pytest.approx(before.rollout_log_probs, abs=1e-5)
        worst = max([worst, *(abs(a - b) for a, b in zip(after.rollout_log_probs, before.rollout_log_probs,
                                                          strict=True))])  # fmt: skip
        assert span_positions(after) == generated_positions(after)
        assert set(versions_of(after)) == {DEFAULT_VERSION}
    print(f"largest logprob difference after suspensions: {worst:.3g}")
    # the suspended run really continued turns: aborted requests answered with tokens, continuations were sent
    aborted = [exchange for exchange in proxy.to(GENERATE_PATH)
               if str(exchange.request_id).startswith(f"{name}-") and finish_reason(exchange) == "abort"]  # fmt: skip
    assert any(exchange.response["choices"][0]["token_ids"] for exchange in aborted)
    assert any("-part" in str(exchange.request_id) for exchange in proxy.to(GENERATE_PATH)
               if str(exchange.request_id).startswith(f"{name}-"))  # fmt: skip


async def _suspended_everywhere(runner: RolloutRunner, watch: Watch, count: int) -> None:
    """Wait until every sample took its ``count``-th ``suspend`` transition, and check they all wait."""
    ids = [str(index) for index in range(len(PROMPTS))]
    await watch.until(lambda: all(len(watch.of("suspend", sample)) >= count for sample in ids),
                      f"every sample to suspend a {count}. time")  # fmt: skip
    assert runner.suspender.requests_in_flight == 0
    assert runner.metrics().suspended == len(PROMPTS)


async def _suspend_three_ways(proxy: Any, url: str, config: Any, tokenizer: Any, watch: Watch,
                              name: str) -> list[Sample]:  # fmt: skip
    """Suspend a greedy batch twice mid-turn and once with sample 0 between turns; the batch's results.

    vLLM is frozen before the batch starts, so its first requests queue there; it only runs in the test's windows
    until the third suspension.
    """
    tokens = await quiet_server(url)
    await freeze(url)
    async with new_runner(config, tokenizer, watch) as runner:
        sent = len(proxy.to(GENERATE_PATH))
        run = asyncio.create_task(runner.run_batch(samples(name), concurrency=len(PROMPTS)))

        # 1 and 2: mid-turn, a few tokens into every sample's first turn, then into its continuation. The requests
        # wait at the frozen vLLM; the engine runs until it has generated a token, a few steps at most, far from the
        # TURN_MIN tokens that could end the turn; the suspension aborts them there.
        for count in (1, 2):
            await proxy.arrivals(GENERATE_PATH, sent + len(PROMPTS), limit_s=WAIT_S)
            await step_until(url, generated_since(url, tokens), f"vLLM to generate a token before suspension {count}")
            await runner.suspend()
            await _suspended_everywhere(runner, watch, count)
            tokens = await generation_tokens(url)
            sent = len(proxy.to(GENERATE_PATH))
            # every suspended rollout continues its turn with one request, which waits at the frozen vLLM
            await runner.resume()
        await proxy.arrivals(GENERATE_PATH, sent + len(PROMPTS), limit_s=WAIT_S)

        # 3: sample 0 between turns. vLLM runs on until its first turn's answer is in, which the proxy keeps, and is
        # frozen again there, so the others stay where they are (none can have ended its last turn: the premise).
        # The suspension lands while sample 0's answer is on its way, so sample 0 steps its environment with the
        # gate closed and suspends before it sends the next turn.
        hold = proxy.hold_answer_when(
            lambda exchange: (
                exchange.path == GENERATE_PATH
                and str(exchange.request_id).startswith(f"{name}-0-")
                and finish_reason(exchange) not in (None, "abort")
            )
        )
        await thaw(url)
        held = await asyncio.wait_for(hold.held, WAIT_S)
        await freeze(url)
        assert held.request_id is not None and held.request_id.startswith(f"{name}-0-turn0"), held.request_id
        aborts = len(proxy.to(ABORT_PATH))
        suspending = asyncio.create_task(runner.suspend())
        await proxy.arrivals(ABORT_PATH, aborts + 1, limit_s=WAIT_S)
        hold.release()
        await suspending
        await _suspended_everywhere(runner, watch, 3)
        between = [(event["src"], event["partial_tokens"]) for event in watch.of("suspend", "0")
                   if event["turn"] == 1]  # fmt: skip
        assert between == [("generating", 0)], watch.of("suspend", "0")
        await thaw(url)
        await runner.resume()
        return await asyncio.wait_for(run, WAIT_S)


async def test_keep_strategy_freezes_the_request_in_flight_and_its_tokens_carry_both_versions(
    proxy: Any, vllm_config: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    url = vllm_server.url
    config = vllm_config(max_turns=2, weight_update_strategy="keep")
    name = "keep"
    watch = Watch()
    tokens = await quiet_server(url)
    generates, renders = len(proxy.to(GENERATE_PATH)), len(proxy.to(RENDER_PATH))
    # Frozen before the first turn is sent: it waits at vLLM, runs a few tokens in the test's windows and is frozen
    # there when the runner's own pause lands (a second keep pause is a no-op at vLLM; the runner's resume lets it
    # go on), however slow the machine.
    await freeze(url)
    try:
        async with new_runner(config, vllm_tokenizer, watch, turn_min=KEEP_TURN_MIN, budget=KEEP_BUDGET) as runner:
            first = asyncio.create_task(runner.run(Sample(prompt=PROMPTS[0], index=0, session_id=f"{name}-0")))
            frozen = (await proxy.arrivals(GENERATE_PATH, generates + 1, limit_s=WAIT_S))[generates]
            await step_until(url, generated_since(url, tokens), "vLLM to generate the first turn's first token")
            # The second sample's render answer waits at the proxy: it reaches ``generating`` only inside the body.
            proxy.hold_answers(RENDER_PATH)
            second = asyncio.create_task(runner.run(Sample(prompt=PROMPTS[1], index=1, session_id=f"{name}-1")))
            render = (await proxy.arrivals(RENDER_PATH, renders + 2, limit_s=WAIT_S))[renders + 1]
            await asyncio.wait_for(render.upstream_done.wait(), WAIT_S)

            async with runner.weight_update(version="7"):
                seen = len(proxy.exchanges)
                proxy.release_answers(RENDER_PATH)
                await watch.until(lambda: bool(watch.of("suspend", "1")), "sample 1 to suspend")
                # sample 1 was about to send its first turn: it suspended instead
                assert watch.of("suspend", "1")[0]["src"] == "generating"
                assert [exchange.path for exchange in proxy.exchanges[seen:]] == [], "a request reached the server"
                assert not frozen.answered
            stats = runner.last_suspension
            results = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    finally:  # the server is shared
        await thaw(url)
        await post(url + UPDATE_WEIGHT_VERSION_PATH, {"new_version": DEFAULT_VERSION})

    assert (stats.strategy, stats.pause_calls, stats.abort_calls, stats.requests_in_flight) == ("keep", 1, 0, 1)
    assert proxy.to(ABORT_PATH) == []
    paused = proxy.to(PAUSE_PATH)
    (resumed,) = proxy.to(RESUME_PATH)
    (versioned,) = proxy.to(UPDATE_WEIGHT_VERSION_PATH)
    assert [exchange.query for exchange in paused] == ["mode=keep"]
    assert versioned.body == {"new_version": "7"}
    assert paused[0].received_at < versioned.received_at < resumed.received_at
    # nothing was sent while the engine was paused but setting the version
    during = [exchange.path for exchange in proxy.exchanges
              if paused[0].received_at < exchange.received_at < resumed.received_at]  # fmt: skip
    assert during == [UPDATE_WEIGHT_VERSION_PATH]

    # the frozen request was never aborted: one answer, its tokens before the pause "default", after it "7"
    assert frozen.request_id == f"{name}-0-turn0"
    assert [exchange.request_id for exchange in proxy.to(GENERATE_PATH)].count(f"{name}-0-turn0") == 1
    choice = frozen.response["choices"][0]
    generated = len(choice["token_ids"])
    spans = choice["weight_versions"]
    assert [span["version"] for span in spans] == [DEFAULT_VERSION, "7"], spans
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == generated
    assert choice["finish_reason"] != "abort"

    sample0, sample1 = results
    for sample in results:
        assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
        assert span_positions(sample) == generated_positions(sample)
    assert versions_of(sample0) == [DEFAULT_VERSION, "7", "7"]  # turn 0 split, turn 1 after the update
    prompt0 = len(sample0.tokens) - sample0.response_length
    assert sample0.metadata["weight_version_spans"][0] == {"version": DEFAULT_VERSION, "start": 0,
                                                           "end": spans[0]["end"]}  # fmt: skip
    assert sample0.tokens[prompt0 : prompt0 + generated] == choice["token_ids"]
    assert set(versions_of(sample1)) == {"7"}  # it generated nothing before the update


async def test_one_suspension_aborts_every_request_in_flight_with_one_call(
    proxy: Any, vllm_config: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    url = vllm_server.url
    await quiet_server(url)
    sent, aborts = len(proxy.to(GENERATE_PATH)), len(proxy.to(ABORT_PATH))
    await freeze(url)  # the requests queue at vLLM: none can end before the suspension
    try:
        async with new_runner(vllm_config(max_turns=1), vllm_tokenizer) as runner:
            # A second abort round only for a request the engine did not know when the first one landed (never
            # here, below), not for one whose abort answer is merely slow on a loaded machine.
            runner.suspender.abort_retry_s = WAIT_S
            run = asyncio.create_task(runner.run_batch(samples("one"), concurrency=len(PROMPTS)))
            generates = (await proxy.arrivals(GENERATE_PATH, sent + len(PROMPTS), limit_s=WAIT_S))[sent:]
            # vLLM knows and runs every request (an id it did not know yet would need a second abort round), a few
            # tokens into turns of TURN_MIN tokens at least, and stays frozen until they are aborted.
            await step_until(url, lambda: _running(url, len(PROMPTS)), f"vLLM to run the {len(PROMPTS)} requests")
            await runner.suspend()
            assert runner.suspender.requests_in_flight == 0
            stats = runner.last_suspension
            await thaw(url)
            await runner.resume()
            results = await asyncio.wait_for(run, WAIT_S)
    finally:  # the server is shared
        await thaw(url)
    (abort,) = proxy.to(ABORT_PATH)[aborts:]

    assert (stats.strategy, stats.requests_in_flight, stats.abort_calls, stats.errors) == ("abort", 3, 1, [])
    named = sorted(alias for exchange in generates for alias in server_request_ids(str(exchange.request_id)))
    assert sorted(abort.body["request_ids"]) == named
    assert [finish_reason(exchange) for exchange in generates] == ["abort"] * len(PROMPTS)
    for sample in results:
        assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
        assert span_positions(sample) == generated_positions(sample)


async def _running(url: str, count: int) -> bool:
    return await running_requests(url) >= count
