"""The fault matrix: every non-terminal state where a fault can strike x every fault -> the expected terminal state.

The base scenario is two generate turns and an environment that answers "Continue." then "correct" (done):
``pending -> rendered -> generating -> stepping -> observing -> generating -> stepping -> completed``. Faults
strike the render request (``pending``), the first generate (``generating``, turn 0), the second generate
(``generating``, turn 1, after ``observing``), the environment's methods, or interrupt the rollout (caller abort,
runner abort, task cancellation) in each state. For every cell: the terminal state and reason, the failing
transition in the trace, the environment closed exactly once (or never built), no request after an abort, the
sample's arrays aligned, and -- for transient faults within the retry policy -- a result identical to the
fault-free run of the same script.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from _support import (
    FAST_RETRY,
    HookedEnvFactory,
    Outcome,
    check_common,
    make_config,
    run_scenario,
    wait_until,
)

from fsm_rollout import RetryPolicy, Sample
from fsm_rollout.errors import (
    BudgetExceededError,
    EngineConnectionError,
    EngineHTTPError,
    EngineTimeoutError,
    GenerationError,
    MalformedTokensError,
    RenderError,
)
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnv
from fsm_rollout.testing.fake_vllm import ABORT_PATH, GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

ENV_STEPS = [("Continue.", False), ("correct", True)]
TURNS = ("Let me think.", "The answer is 42.")


def base_turns() -> list[ScriptedTurn]:
    return [ScriptedTurn(text=TURNS[0]), ScriptedTurn(text=TURNS[1])]


@pytest.fixture
async def reference(fake_vllm: FakeVLLMServer, tokenizer: Any) -> Outcome:
    """The fault-free run of the base scenario (on a fresh server, so the test's server stays untouched)."""
    async with FakeVLLMServer(tokenizer, model="fake-model") as clean:
        clean.script(base_turns())
        outcome = await run_scenario(clean, tokenizer, envs=HookedEnvFactory(steps=ENV_STEPS))
    assert outcome.error is None
    assert outcome.rollout.state == "completed"
    assert outcome.sample.metadata["rollout_reason"] == "env_done"
    return outcome


# ----------------------------------------------------------------------------------------------------------------
# server faults x the three states that send requests

SITES = {
    # site: (path, state the fault strikes in, trigger that fails, requests before the faulted one)
    "render": (RENDER_PATH, "pending", "render"),
    "generate-turn0": (GENERATE_PATH, "generating", "step"),
    "generate-turn1": (GENERATE_PATH, "generating", "step"),
}


@dataclass(frozen=True)
class ServerFault:
    """A fault injected with ``fail_next``; ``error`` None means: ends as the fault-free run."""

    name: str
    inject: dict[str, Any]
    error: type[BaseException] | None
    message: str = ""
    retry: RetryPolicy = FAST_RETRY
    timeout_s: float | None = 30.0
    extra_requests: int = 0


SERVER_FAULTS = [
    ServerFault(
        "500-once-500-not-retryable",
        {"status": 500},
        EngineHTTPError,
        "HTTP 500",
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.001, retry_statuses=frozenset({503})),
    ),
    ServerFault("500-once", {"status": 500}, None, extra_requests=1),
    *[ServerFault(f"{s}-transient", {"status": s, "times": 2}, None, extra_requests=2) for s in (500, 502, 503, 429)],
    *[
        ServerFault(f"{s}-persistent", {"status": s, "times": 3}, EngineHTTPError, f"HTTP {s}")
        for s in (500, 502, 503, 429)
    ],
    ServerFault("reset-transient", {"reset": True, "times": 2}, None, extra_requests=2),
    ServerFault("reset-persistent", {"reset": True, "times": 3}, EngineConnectionError, "3 attempt"),
    ServerFault("timeout", {"status": 503, "delay": 5.0}, EngineTimeoutError, "timed out", timeout_s=0.2),
    ServerFault("malformed-json", {"malformed_json": True}, None),  # error class depends on the site
]


def malformed_error(site: str) -> type[BaseException]:
    return RenderError if site == "render" else GenerationError


@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=lambda fault: fault.name)
async def test_server_fault(
    fake_vllm: FakeVLLMServer, tokenizer: Any, reference: Outcome, site: str, fault: ServerFault
) -> None:
    path, state, trigger = SITES[site]
    fake_vllm.script(base_turns())
    hook = None
    if site == "generate-turn1":

        def hook(method: str, env: ScriptedEnv) -> None:
            if method == "step:1":
                fake_vllm.fail_next(path, **fault.inject)
    else:
        fake_vllm.fail_next(path, **fault.inject)
    envs = HookedEnvFactory(steps=ENV_STEPS, hook=hook)
    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs, retry=fault.retry, request_timeout_s=fault.timeout_s)
    check_common(outcome)
    expected = malformed_error(site) if fault.name == "malformed-json" else fault.error
    if expected is None:  # transient, within the retry policy: as if nothing happened
        assert outcome.error is None, outcome.error
        assert outcome.training_view() == reference.training_view()
        assert outcome.path == reference.path
        assert len(fake_vllm.requests) == len(reference_requests()) + fault.extra_requests
        return
    assert isinstance(outcome.error, expected), repr(outcome.error)
    assert fault.message in str(outcome.error)
    assert outcome.rollout.state == "failed"
    assert outcome.sample.metadata["rollout_reason"] == "error"
    last = outcome.events[-1]
    assert (last["src"], last["trigger"], last["dst"]) == (state, "fail", "failed")
    assert last["failed_trigger"] == trigger
    assert last["error_type"] == type(outcome.error).__name__
    recorded = outcome.sample.metadata["rollout_error"]
    assert (recorded["state"], recorded["trigger"]) == (state, trigger)
    assert len(envs.built) == 1 and envs.last.close_count == 1
    if site == "generate-turn1":  # the first turn and its observation are kept
        assert outcome.sample.response.startswith(TURNS[0])
        assert outcome.sample.loss_mask.count(1) == len(tokenizer.encode(TURNS[0], add_special_tokens=False))
        assert envs.last.calls.count("step") == 1
    else:
        assert outcome.sample.response_length == 0
        assert envs.last.calls.count("step") == 0


def reference_requests() -> list[str]:
    return [RENDER_PATH, GENERATE_PATH, GENERATE_PATH]


# ----------------------------------------------------------------------------------------------------------------
# schema violations in the generate answer x the two generate states


def raw_choice(**choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, **choice}]}


def logprobs(n: int) -> dict[str, Any]:
    return {"content": [{"logprob": -0.1}] * n}


SCHEMA_FAULTS = {
    "non-int-token": (
        raw_choice(finish_reason="stop", token_ids=[9707, "11"], logprobs=logprobs(2)),
        MalformedTokensError,
        "token",
    ),
    "bool-token": (
        raw_choice(finish_reason="stop", token_ids=[9707, True], logprobs=logprobs(2)),
        MalformedTokensError,
        "token",
    ),
    "negative-token": (
        raw_choice(finish_reason="stop", token_ids=[9707, -3], logprobs=logprobs(2)),
        GenerationError,
        "token",
    ),
    "logprob-count-mismatch": (
        raw_choice(finish_reason="stop", token_ids=[9707, 11], logprobs=logprobs(1)),
        GenerationError,
        "logprob",
    ),
    "unknown-finish-reason": (
        raw_choice(finish_reason="tool_calls", token_ids=[9707], logprobs=logprobs(1)),
        GenerationError,
        "finish",
    ),
    "more-tokens-than-requested": (
        raw_choice(finish_reason="length", token_ids=[9707] * 200, logprobs=logprobs(200)),
        BudgetExceededError,
        "generated_tokens=200",
    ),
    "bad-routed-experts": (
        raw_choice(finish_reason="stop", token_ids=[9707], logprobs=logprobs(1), routed_experts="not base64!"),
        GenerationError,
        "routed",
    ),
    "missing-choices": ({"request_id": "x"}, GenerationError, "choices"),
}


@pytest.mark.parametrize("turn", [0, 1])
@pytest.mark.parametrize(
    "name",
    [name for name in SCHEMA_FAULTS],
)
async def test_schema_violation(fake_vllm: FakeVLLMServer, tokenizer: Any, name: str, turn: int) -> None:
    raw, error, fragment = SCHEMA_FAULTS[name]
    fake_vllm.script([*base_turns()[:turn], ScriptedTurn(raw=raw)])
    envs = HookedEnvFactory(steps=ENV_STEPS)
    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs)
    check_common(outcome)
    assert isinstance(outcome.error, error), repr(outcome.error)
    assert fragment.lower() in str(outcome.error).lower()
    last = outcome.events[-1]
    assert (last["src"], last["dst"], last["failed_trigger"]) == ("generating", "failed", "step")
    assert envs.last.close_count == 1
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == turn + 1  # a schema violation is not retried
    expected_trainable = len(tokenizer.encode(TURNS[0], add_special_tokens=False)) if turn else 0
    assert outcome.sample.loss_mask.count(1) == expected_trainable  # the bad turn appended nothing


# ----------------------------------------------------------------------------------------------------------------
# environment exceptions


@dataclass(frozen=True)
class EnvFault:
    method: str  # hook key: "build", "reset:1", "step:1", "step:2", "format_observation:1", "close:1"
    state: str  # where the failing transition starts
    trigger: str
    generates: int  # generate requests sent
    script: tuple[str, ...] = TURNS
    steps: tuple[tuple[str, bool], ...] = tuple(ENV_STEPS)
    config: tuple[tuple[str, Any], ...] = ()
    sampling: tuple[tuple[str, Any], ...] = ()


ENV_FAULTS = {
    "build_env": EnvFault("build", "pending", "render", 0),
    "reset": EnvFault("reset:1", "pending", "render", 0),
    "step-turn0": EnvFault("step:1", "stepping", "observe", 1),
    "step-turn1": EnvFault("step:2", "stepping", "observe", 2),
    "format_observation": EnvFault("format_observation:1", "observing", "generate", 1),
    "close-on-completed": EnvFault("close:1", "stepping", "observe", 2),
    "close-on-max-turns": EnvFault("close:1", "stepping", "observe", 1, config=(("max_turns", 1),)),
    "close-on-length": EnvFault(
        "close:1", "generating", "step", 1, script=("one two three four five six",), sampling=(("max_new_tokens", 3),)
    ),
    "close-on-budget-exhausted": EnvFault("close:1", "rendered", "generate", 0, sampling=(("max_new_tokens", 0),)),
}


class EnvBoom(RuntimeError):
    pass


@pytest.mark.parametrize("name", list(ENV_FAULTS))
async def test_environment_fault(fake_vllm: FakeVLLMServer, tokenizer: Any, name: str) -> None:
    fault = ENV_FAULTS[name]
    fake_vllm.script([ScriptedTurn(text=text) for text in fault.script])

    def hook(method: str, env: ScriptedEnv) -> None:
        if method == fault.method:
            raise EnvBoom(f"{method} broke")

    closing = fault.method.startswith("close")  # close is counted by the env itself, then raises
    envs = HookedEnvFactory(
        steps=list(fault.steps),
        hook=None if closing else hook,
        raise_in={"close": EnvBoom("close broke")} if closing else {},
        build_error=EnvBoom("build broke") if fault.method == "build" else None,
    )
    outcome = await run_scenario(
        fake_vllm, tokenizer, envs=envs, sampling={**SAMPLING_BASE, **dict(fault.sampling)}, **dict(fault.config)
    )
    check_common(outcome)
    assert isinstance(outcome.error, EnvBoom)
    assert outcome.rollout.state == "failed"
    last = outcome.events[-1]
    assert (last["src"], last["trigger"], last["dst"]) == (fault.state, "fail", "failed")
    assert last["failed_trigger"] == fault.trigger
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == fault.generates
    if fault.method == "build":
        assert envs.built == [] and fake_vllm.requests == []
        return
    assert envs.last.close_count == 1
    if fault.method == "reset:1":
        assert fake_vllm.requests == []  # nothing is sent for an environment that could not reset
    if fault.generates:
        assert outcome.sample.response_length > 0
        assert outcome.sample.response  # the text of the kept tokens


SAMPLING_BASE = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


async def test_close_error_on_abort_fails_the_sample_and_keeps_the_abort_reason_visible(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="never", hang=True)])

    async def interrupt(rollout: Any, task: asyncio.Task[Any]) -> None:
        await wait_until(lambda: len(fake_vllm.requests_to(GENERATE_PATH)) == 1, "the generate")
        await rollout.abort("weight_update")

    envs = HookedEnvFactory(raise_in={"close": EnvBoom("close broke")})
    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs, interrupt=interrupt)
    check_common(outcome)
    assert outcome.rollout.state == "failed"
    last = outcome.events[-1]
    assert (last["src"], last["dst"], last["failed_trigger"]) == ("generating", "failed", "abort")
    assert envs.last.close_count == 1
    assert outcome.sample.metadata["rollout_error"]["message"] == "close broke"


async def test_a_sample_that_fails_while_aborting_has_reason_error(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.script([ScriptedTurn(text="never", hang=True)])

    async def interrupt(rollout: Any, task: asyncio.Task[Any]) -> None:
        await wait_until(lambda: len(fake_vllm.requests_to(GENERATE_PATH)) == 1, "the generate")
        await rollout.abort("weight_update")

    envs = HookedEnvFactory(raise_in={"close": EnvBoom("close broke")})
    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs, interrupt=interrupt)
    assert outcome.rollout.state == "failed"
    assert outcome.sample.metadata["rollout_reason"] == "error"


# ----------------------------------------------------------------------------------------------------------------
# interrupts: caller abort, runner abort, task cancellation x every non-terminal state where the caller can act


INTERRUPT_STATES = ["pending", "generating-turn0", "generating-turn1", "stepping", "observing"]


def hanging_script(state: str) -> list[ScriptedTurn]:
    if state == "generating-turn0":
        return [ScriptedTurn(text="never", hang=True)]
    if state == "generating-turn1":
        return [ScriptedTurn(text=TURNS[0]), ScriptedTurn(text="never", hang=True)]
    return base_turns()


def from_inside(state: str, act: Callable[[], None]) -> Any:
    """An environment hook that interrupts from inside ``step`` (stepping) or ``format_observation`` (observing)."""
    key = {"stepping": "step:1", "observing": "format_observation:1"}[state]

    def hook(method: str, env: ScriptedEnv) -> None:
        if method == key:
            act()

    return hook


async def wait_for_state(fake_vllm: FakeVLLMServer, state: str) -> None:
    if state == "pending":
        await wait_until(lambda: len(fake_vllm.requests_to(RENDER_PATH)) == 1, "the render")
    else:
        count = 1 if state == "generating-turn0" else 2
        await wait_until(lambda: len(fake_vllm.requests_to(GENERATE_PATH)) == count, "the generate")


def check_no_requests_after(fake_vllm: FakeVLLMServer, count: int) -> None:
    extra = fake_vllm.requests[count:]
    assert not extra, [request.path for request in extra]


LANDING = {  # the state the abort edge leaves from, per interrupted state (caller abort / cancellation)
    "pending": ("pending", "pending"),
    "generating-turn0": ("generating", "generating"),
    "generating-turn1": ("generating", "generating"),
    "stepping": ("stepping", "generating"),  # a cancellation lands at the next await: the next generate
    "observing": ("observing", "generating"),
}


@pytest.mark.parametrize("state", INTERRUPT_STATES)
async def test_caller_abort(fake_vllm: FakeVLLMServer, tokenizer: Any, state: str) -> None:
    fake_vllm.script(hanging_script(state))
    if state == "pending":
        fake_vllm.fail_next(RENDER_PATH, status=503, delay=30.0)
    holder: dict[str, Any] = {}
    envs = HookedEnvFactory(steps=ENV_STEPS)
    if state in ("stepping", "observing"):
        envs.hook = from_inside(state, lambda: holder["rollout"].request_abort("env_deadline"))
    reason = "env_deadline" if state in ("stepping", "observing") else "weight_update"

    async def interrupt(rollout: Any, task: asyncio.Task[Any]) -> dict[str, Any]:
        holder["rollout"] = rollout
        if state in ("stepping", "observing"):
            return {}
        await wait_for_state(fake_vllm, state)
        await rollout.abort("weight_update")
        return {"sent": len(fake_vllm.requests)}

    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs, interrupt=interrupt)
    await asyncio.sleep(0.05)
    check_common(outcome)
    assert outcome.error is None
    assert (outcome.rollout.state, outcome.sample.metadata["rollout_reason"]) == ("aborted", reason)
    last = outcome.events[-1]
    assert (last["src"], last["trigger"], last["dst"]) == (LANDING[state][0], "abort", "aborted")
    check_no_requests_after(fake_vllm, outcome.extra.get("sent", outcome.requests_at_end))
    assert envs.last.close_count == 1
    if state.startswith("generating"):
        turn = 0 if state.endswith("0") else 1
        assert f"{outcome.rollout.request_prefix}-turn{turn}" in fake_vllm.aborted_request_ids
    else:
        assert fake_vllm.requests_to(ABORT_PATH) == []  # no request was in flight: no notice
    if state in ("stepping", "observing"):
        assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1
        assert outcome.sample.response == TURNS[0]  # the turn kept, the observation never appended


@pytest.mark.parametrize("state", INTERRUPT_STATES)
async def test_task_cancellation(fake_vllm: FakeVLLMServer, tokenizer: Any, state: str) -> None:
    fake_vllm.script(hanging_script(state))
    if state == "pending":
        fake_vllm.fail_next(RENDER_PATH, status=503, delay=30.0)
    envs = HookedEnvFactory(steps=ENV_STEPS)
    if state in ("stepping", "observing"):
        envs.hook = from_inside(state, lambda: asyncio.current_task().cancel())  # type: ignore[union-attr]

    async def interrupt(rollout: Any, task: asyncio.Task[Any]) -> None:
        if state not in ("stepping", "observing"):
            await wait_for_state(fake_vllm, state)
            task.cancel()

    outcome = await run_scenario(fake_vllm, tokenizer, envs=envs, interrupt=interrupt)
    await asyncio.sleep(0.05)
    check_common(outcome)
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert (outcome.rollout.state, outcome.sample.metadata["rollout_reason"]) == ("aborted", "cancelled")
    last = outcome.events[-1]
    assert (last["src"], last["trigger"], last["dst"]) == (LANDING[state][1], "abort", "aborted")
    check_no_requests_after(fake_vllm, outcome.requests_at_end)
    assert envs.last.close_count == 1
    if state in ("stepping", "observing"):  # the cancelled task never sent its next generate
        assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1


@pytest.mark.parametrize("state", ["pending", "generating-turn0", "generating-turn1"])
async def test_runner_abort(fake_vllm: FakeVLLMServer, tokenizer: Any, state: str) -> None:
    fake_vllm.script(hanging_script(state))
    if state == "pending":
        fake_vllm.fail_next(RENDER_PATH, status=503, delay=30.0)
    envs = HookedEnvFactory(steps=ENV_STEPS)
    config = make_config(fake_vllm.url)
    sample = Sample(prompt="What is 6 * 7?", index=0)
    queued = Sample(prompt="queued", index=1)
    from fsm_rollout import capture_transitions

    with capture_transitions() as events:
        runner = RolloutRunner(config, sampling_params=SAMPLING_BASE, tokenizer=tokenizer, env_factory=envs)
        async with runner:
            task = asyncio.ensure_future(runner.run_batch([sample, queued], concurrency=1))
            await wait_for_state(fake_vllm, state)
            await runner.abort("weight_update")
            sent = len(fake_vllm.requests)
            done = await task
            await asyncio.sleep(0.05)
            check_no_requests_after(fake_vllm, sent)
            assert runner.in_flight == 0
            assert runner.metrics().reasons == {"weight_update": 1, "not_started": 1}
    assert [s.status.value for s in done] == ["aborted", "aborted"]
    # the queued sample never had a concurrency slot: its reason says it never started
    assert [s.metadata["rollout_reason"] for s in done] == ["weight_update", "not_started"]
    assert len(envs.built) == 1 and envs.last.close_count == 1  # the queued sample never built one
    mine = [e for e in events if e.get("sample_id") == "0"]
    assert (mine[-1]["src"], mine[-1]["dst"]) == (LANDING[state][0], "aborted")
    queued_events = [e for e in events if e.get("sample_id") == "1"]
    assert [(e["src"], e["dst"]) for e in queued_events] == [("pending", "aborted")]
    for s in done:
        s.check_invariants()
