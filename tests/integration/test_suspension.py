"""Suspending rollouts for weight updates without losing a token: greedy equivalence at random moments.

The engine here is a deterministic "greedy model" behind the transport seam: the next token is a function of the
whole context, so a turn continued from its partial tokens must produce exactly what the uninterrupted request
produces. Generate requests can be held after a chosen number of tokens (the engine's "progress" when the
suspension lands); an abort answers them with those tokens, as vLLM does. Everything waits on events, never on time.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH, server_request_id
from fsm_rollout.rollout import Rollout
from fsm_rollout.trace import capture_transitions
from fsm_rollout.types import GeneratedTurn, TurnMeta
from fsm_rollout.weights.partial_turn import merge_turns
from fsm_rollout.weights.suspension import Suspender, weight_staleness

MODEL = "greedy-model"
WORDS = list(range(1000, 1400))  # ordinary word-piece ids of the Qwen vocabulary


def next_token(context: list[int], eos: int) -> int:
    """The greedy model: a hash of the context picks the next token; long enough answers end with EOS."""
    value = (sum(context[-4:]) * 2654435761 + len(context) * 40503) % 1_000_003
    if value % 11 == 0:
        return eos
    return WORDS[value % len(WORDS)]


def logprob_of(context_length: int, token: int) -> float:
    return -((token % 97) + context_length % 13) / 100.0


class GreedyEngine:
    """A transport answering render, generate and abort in process; generate requests can be held."""

    base_url = "http://greedy.invalid"

    def __init__(self, tokenizer: Any, *, rng: random.Random | None = None, hold_probability: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.rng = rng or random.Random(0)
        self.hold_probability = hold_probability
        self.version = "default"
        self.held: dict[str, tuple[asyncio.Event, list[str]]] = {}
        self.held_changed = asyncio.Event()
        self.requests: list[tuple[str, Mapping[str, Any]]] = []
        self.abort_calls = 0

    async def close(self) -> None:
        pass

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        self.requests.append((path, payload))
        if path == RENDER_PATH:
            ids = self.tokenizer.apply_chat_template(payload["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            return {"token_ids": ids, "features": None, "model": MODEL, "sampling_params": {}}
        if path == ABORT_PATH:
            self.abort_calls += 1
            for name in payload["request_ids"]:
                held = self.held.get(name)
                if held is not None:
                    held[1].append("abort")
                    held[0].set()
            return {}
        assert path == GENERATE_PATH
        return await self._generate(payload)

    async def _generate(self, payload: Mapping[str, Any]) -> Any:
        context = list(payload["token_ids"])
        limit = payload["sampling_params"].get("max_tokens")
        limit = 10_000 if limit is None else limit
        tokens: list[int] = []
        finish = "length"
        while len(tokens) < limit:
            token = next_token(context + tokens, self.eos)
            tokens.append(token)
            if token == self.eos:
                finish = "stop"
                break
        versions = [self.version] * len(tokens)
        if tokens and self.rng.random() < self.hold_probability:
            progress = self.rng.randrange(0, len(tokens))
            event: asyncio.Event = asyncio.Event()
            outcome: list[str] = []
            request_id = payload["request_id"]
            self.held[request_id] = (event, outcome)
            self.held_changed.set()
            held_version = self.version
            try:
                await event.wait()
            finally:
                del self.held[request_id]
                self.held_changed.set()
            if outcome == ["abort"]:
                tokens, finish = tokens[:progress], "abort"
                versions = [held_version] * progress
            else:
                versions = [held_version] * progress + [self.version] * (len(tokens) - progress)
        return self._answer(payload["request_id"], context, tokens, versions, finish)

    @staticmethod
    def _answer(request_id: str, context: list[int], tokens: list[int], versions: list[str], finish: str) -> Any:
        spans: list[dict[str, Any]] = []
        for position, version in enumerate(versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = position + 1
            else:
                spans.append({"version": version, "start": position, "end": position + 1})
        return {
            "request_id": server_request_id(request_id),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish,
                    "token_ids": tokens,
                    "logprobs": {
                        "content": [
                            {"token_id": token, "logprob": logprob_of(len(context) + i, token)}
                            for i, token in enumerate(tokens)
                        ]
                    },
                    "weight_versions": spans,
                }
            ],
            "usage": {"prompt_tokens": len(context), "completion_tokens": len(tokens)},
        }

    def release_all(self) -> None:
        for event, outcome in list(self.held.values()):
            outcome.append("release")
            event.set()


class CountingEnv:
    """Three turns unless the answer says otherwise; its steps can run a callback (a suspension mid-step)."""

    def __init__(self, on_step: Any = None) -> None:
        self.turns = 0
        self.closed = 0
        self.on_step = on_step

    def reset(self) -> None:
        self.turns = 0

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        self.turns += 1
        if self.on_step is not None:
            self.on_step()
        return f"observation {self.turns}", self.turns >= 3, {}

    def format_observation(self, observation: Any) -> dict[str, str]:
        return {"role": "user", "content": str(observation)}

    def close(self) -> None:
        self.closed += 1

    def snapshot(self) -> dict[str, Any]:
        return {"turns": self.turns}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.turns = int(state["turns"])


def config(**overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": "http://greedy.invalid",
        "model": MODEL,
        "max_turns": 4,
        "check_invariants": True,
    }
    values.update(overrides)
    return RolloutConfig(**values)


SAMPLING = {"max_new_tokens": 160, "temperature": 0.0, "top_p": 1.0}
PROMPTS = [f"Question {i}: what is {i} + {i * 3}?" for i in range(12)]


async def run_all(
    tokenizer: Any,
    engine: GreedyEngine,
    suspender: Suspender | None,
    *,
    on_step: Any = None,
    sampling: Mapping[str, Any] = SAMPLING,
    **overrides: Any,
) -> list[Rollout]:
    client = VLLMClient(transport=engine)
    rollouts = [
        Rollout(
            Sample(prompt=prompt, index=index),
            config=config(**overrides),
            sampling_params=sampling,
            client=client,
            tokenizer=tokenizer,
            env_factory=lambda **_: CountingEnv(on_step),
            suspender=suspender,
        )
        for index, prompt in enumerate(PROMPTS)
    ]
    await asyncio.gather(*(rollout.run() for rollout in rollouts))
    return rollouts


def outcome(rollout: Rollout) -> tuple[Any, ...]:
    sample = rollout.sample
    return (sample.tokens, sample.loss_mask, sample.status, rollout.reason, sample.response)


def assert_spans_cover_generated_positions(sample: Sample) -> None:
    spans = sample.metadata.get("weight_version_spans", [])
    covered = [position for span in spans for position in range(span["start"], span["end"])]
    generated = [position for position, mask in enumerate(sample.loss_mask or []) if mask == 1]
    assert covered == generated


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_greedy_rollouts_suspended_at_random_moments_match_uninterrupted_ones(tokenizer: Any, seed: int) -> None:
    reference = await run_all(tokenizer, GreedyEngine(tokenizer), None)
    assert {rollout.sample.status.value for rollout in reference} >= {"completed"}

    rng = random.Random(seed)
    engine = GreedyEngine(tokenizer, rng=rng, hold_probability=0.6)
    client = VLLMClient(transport=engine)
    suspender = Suspender(lambda: [client])
    pending_suspensions: list[asyncio.Task[None]] = []

    def maybe_suspend_mid_step() -> None:  # a weight update that starts while environments are stepping
        if rng.random() < 0.3 and not suspender.suspended:
            pending_suspensions.append(asyncio.ensure_future(suspender.suspend()))

    run = asyncio.ensure_future(run_all(tokenizer, engine, suspender, on_step=maybe_suspend_mid_step))
    weight_updates = 0
    while not run.done():
        changed = asyncio.ensure_future(engine.held_changed.wait())
        await asyncio.wait([run, changed], return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
        engine.held_changed.clear()
        if pending_suspensions:
            await asyncio.gather(*pending_suspensions)
            pending_suspensions.clear()
            await suspender.resume()
        if not engine.held:
            continue
        if rng.random() < 0.5:
            await suspender.suspend()
            assert suspender.requests_in_flight == 0
            weight_updates += 1
            await suspender.resume()
        else:
            engine.release_all()
    today = run.result()
    assert weight_updates > 0
    suspended = sum(rollout.suspensions for rollout in today)
    assert suspended > 0
    for before, after in zip(reference, today, strict=True):
        assert outcome(after) == outcome(before)
        assert after.sample.rollout_log_probs == pytest.approx(before.sample.rollout_log_probs, abs=1e-5)
        assert_spans_cover_generated_positions(after.sample)
        assert after.env is not None and after.env.closed == 1


async def test_suspend_returns_with_nothing_in_flight_and_resume_continues_the_turn(tokenizer: Any) -> None:
    engine = GreedyEngine(tokenizer, hold_probability=1.0, rng=random.Random(5))
    client = VLLMClient(transport=engine)
    suspender = Suspender(lambda: [client])
    with capture_transitions() as events:
        run = asyncio.ensure_future(run_all(tokenizer, engine, suspender))
        while len(engine.held) < len(PROMPTS):
            await engine.held_changed.wait()
            engine.held_changed.clear()
        sent_before = len(engine.requests)
        await suspender.suspend()
        assert suspender.requests_in_flight == 0
        assert suspender.stats.abort_calls == 1  # one abort call for all twelve requests
        assert suspender.stats.requests_in_flight == len(PROMPTS)
        assert len(engine.requests) == sent_before + 1  # nothing but the abort call was sent
        engine.hold_probability = 0.0
        await suspender.resume()
        rollouts = await run
    suspends = [event for event in events if event["trigger"] == "suspend"]
    resumes = [event for event in events if event["trigger"] == "resume"]
    assert len(suspends) == len(resumes) == len(PROMPTS)
    assert all(event["suspend_reason"] == "weight_update" for event in suspends)
    assert all(event["partial_tokens"] >= 0 and "suspended_ms" in event for event in resumes)
    reference = await run_all(tokenizer, GreedyEngine(tokenizer), None)
    for before, after in zip(reference, rollouts, strict=True):
        assert outcome(after) == outcome(before)


async def test_a_weight_update_labels_the_tokens_after_it_with_the_new_version(tokenizer: Any) -> None:
    engine = GreedyEngine(tokenizer, hold_probability=1.0, rng=random.Random(11))
    client = VLLMClient(transport=engine)

    async def set_version(version: str) -> None:
        engine.version = version

    client.update_weight_version = set_version  # type: ignore[method-assign]
    suspender = Suspender(lambda: [client])
    engine.hold_probability = 0.0
    warm_up = Rollout(
        Sample(prompt="warm up", index=99),
        config=config(),
        sampling_params=SAMPLING,
        client=client,
        tokenizer=tokenizer,
        env_factory=lambda **_: CountingEnv(),
        suspender=suspender,
    )
    await warm_up.run()  # an answer tells the runner the engine's version before the update
    assert suspender.weight_version == "default"
    engine.hold_probability = 1.0
    run = asyncio.ensure_future(run_all(tokenizer, engine, suspender))
    while len(engine.held) < len(PROMPTS):
        await engine.held_changed.wait()
        engine.held_changed.clear()
    engine.hold_probability = 0.0
    async with suspender.weight_update(version="1"):
        pass
    rollouts = await run
    for rollout in rollouts:
        sample = rollout.sample
        assert_spans_cover_generated_positions(sample)
        versions = [span["version"] for span in sample.metadata["weight_version_spans"]]
        assert versions[-1] == "1"
        assert sample.metadata["start_weight_version"] == "default"
        assert sample.weight_versions[-1] == "1"
        assert weight_staleness(sample, "1", history=["default", "1"]) == (1 if "default" in versions else 0)


async def test_a_partial_turn_that_used_the_whole_budget_ends_length_without_another_request(tokenizer: Any) -> None:
    engine = GreedyEngine(tokenizer)
    client = VLLMClient(transport=engine)
    suspender = Suspender(lambda: [client])
    sampling = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0}
    rollout = Rollout(
        Sample(prompt=PROMPTS[0], index=0),
        config=config(),
        sampling_params=sampling,
        client=client,
        tokenizer=tokenizer,
        env_factory=lambda **_: CountingEnv(),
        suspender=suspender,
    )
    engine.hold_probability = 1.0
    engine.rng.randrange = lambda start, stop: stop  # type: ignore[method-assign,assignment]  # held after every token
    run = asyncio.ensure_future(rollout.run())
    while not engine.held:
        await engine.held_changed.wait()
        engine.held_changed.clear()
    await suspender.suspend()
    engine.hold_probability = 0.0
    generates_before = sum(1 for path, _ in engine.requests if path == GENERATE_PATH)
    await suspender.resume()
    await run
    assert rollout.sample.status.value == "truncated" and rollout.reason == "length"
    assert rollout.sample.response_length == 4
    assert sum(1 for path, _ in engine.requests if path == GENERATE_PATH) == generates_before


@pytest.mark.parametrize(("min_new_tokens", "kept"), [(None, 2), (2, 5), (4, 5), (5, 8), (8, 8)])
def test_a_turn_merged_from_its_answers_ends_at_the_stop_string_vllm_stops_at(
    tokenizer: Any, min_new_tokens: int | None, kept: int
) -> None:
    # vLLM looks for stop strings only past the text of the first min_tokens tokens; a turn cut off by a
    # suspension and continued must end where the uninterrupted request would have.
    token_ids = tokenizer.encode("one cat, two cats, three cats", add_special_tokens=False)
    assert len(token_ids) == 8  # "one", " cat", ",", " two", " cats", ",", " three", " cats"
    sampling = {**SAMPLING, "stop": ["cat"], "min_new_tokens": min_new_tokens}
    rollout = Rollout(
        Sample(prompt=PROMPTS[0], index=0),
        config=config(),
        sampling_params=sampling,
        client=VLLMClient(transport=GreedyEngine(tokenizer)),
        tokenizer=tokenizer,
        env_factory=lambda **_: CountingEnv(),
    )
    parts = [
        GeneratedTurn(
            request_id="r",
            finish=finish,
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            meta=TurnMeta(finish_reason=finish),
        )
        for finish, ids in (("abort", token_ids[:1]), ("length", token_ids[1:]))
    ]
    turn, spans = merge_turns(parts, request_id="r", fallback_version=None, cut_at_stop=rollout._stop_string_end)
    assert turn.token_ids == token_ids[:kept]
    assert turn.finish == ("stop" if kept < len(token_ids) else "length")
    assert spans == [("default", 0, kept)]
