"""Shared pieces of the reliability suite: hookable environments, a scenario runner, fault-free references."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, VLLMClient, capture_transitions
from fsm_rollout.machine import lifecycle
from fsm_rollout.testing.envs import ScriptedEnv, ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.001)

Hook = Callable[[str, ScriptedEnv], None]
"""Called with ``(method, env)`` before a hooked environment method runs (``step`` #n is ``step:n``)."""


@dataclass
class HookedEnvFactory(ScriptedEnvFactory):
    """A :class:`ScriptedEnvFactory` whose environments call ``hook`` before each method (to inject faults)."""

    hook: Hook | None = None

    def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
        env = super().__call__(sample=sample, args=args)
        hook = self.hook
        if hook is None:
            return env
        counts: dict[str, int] = {}
        for name in ("reset", "step", "format_observation", "close"):
            original = getattr(env, name)

            def wrapped(*call_args: Any, _name: str = name, _original: Any = original) -> Any:
                counts[_name] = counts.get(_name, 0) + 1
                hook(f"{_name}:{counts[_name]}", env)
                return _original(*call_args)

            setattr(env, name, wrapped)
        return env


@dataclass
class Outcome:
    """What one scripted rollout left behind."""

    rollout: Rollout
    envs: ScriptedEnvFactory
    events: list[dict[str, Any]]
    error: BaseException | None = None
    requests_at_end: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sample(self) -> Sample:
        return self.rollout.sample

    @property
    def path(self) -> list[tuple[str, str, str]]:
        return [(event["src"], event["trigger"], event["dst"]) for event in self.events]

    def training_view(self) -> tuple[Any, ...]:
        """The fields a trainer consumes (and a fault-free run must match)."""
        sample = self.sample
        return (
            sample.status.value,
            sample.metadata.get("rollout_reason"),
            list(sample.tokens),
            list(sample.loss_mask or []),
            list(sample.rollout_log_probs or []),
            sample.response_length,
            sample.response,
        )


def make_config(url: str, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": url,
        "model": MODEL,
        "max_turns": 3,
        "check_invariants": True,
        "retry": FAST_RETRY,
    }
    values.update(overrides)
    return RolloutConfig(**values)


async def run_scenario(
    server: FakeVLLMServer,
    tokenizer: Any,
    *,
    sample: Sample | None = None,
    envs: ScriptedEnvFactory | None = None,
    sampling: dict[str, Any] | None = None,
    client: VLLMClient | None = None,
    request_timeout_s: float | None = 30.0,
    retry: RetryPolicy = FAST_RETRY,
    interrupt: Callable[[Rollout, asyncio.Task[Any]], Any] | None = None,
    **config: Any,
) -> Outcome:
    """Run one rollout against ``server``; errors are caught into :attr:`Outcome.error`."""
    envs = envs if envs is not None else ScriptedEnvFactory()
    own_client = client is None
    engine = client or VLLMClient(server.url, request_timeout_s=request_timeout_s, retry=retry)
    try:
        rollout = Rollout(
            sample or Sample(prompt="What is 6 * 7?", index=0),
            config=make_config(server.url, retry=retry, **config),
            sampling_params=dict(sampling or SAMPLING),
            client=engine,
            tokenizer=tokenizer,
            env_factory=envs,
        )
        outcome_error: BaseException | None = None
        with capture_transitions() as events:
            task = asyncio.ensure_future(rollout.run())
            extra: dict[str, Any] = {}
            if interrupt is not None:
                extra = await interrupt(rollout, task) or {}
            try:
                await task
            except BaseException as error:
                outcome_error = error
        return Outcome(rollout, envs, list(events), outcome_error, len(server.requests), extra)
    finally:
        if own_client:
            await engine.close()


def illegal(events: list[dict[str, Any]]) -> list[str]:
    """Transitions that are not consecutive edges of the table, or a path that does not end terminal."""
    edges = {(edge.source, edge.trigger, edge.dest) for edge in lifecycle.TRANSITIONS}
    problems: list[str] = []
    state = lifecycle.INITIAL
    for event in events:
        step = (event["src"], event["trigger"], event["dst"])
        if event["src"] != state:
            problems.append(f"{step} taken from {state}")
        if step not in edges:
            problems.append(f"{step} is not an edge")
        state = event["dst"]
    if state not in lifecycle.TERMINAL:
        problems.append(f"ended in {state}")
    return problems


def check_common(outcome: Outcome) -> None:
    """Invariants every outcome must satisfy: terminal, legal path, arrays aligned, env closed at most once."""
    rollout = outcome.rollout
    assert rollout.state in lifecycle.TERMINAL, rollout.state
    assert outcome.sample.status.value == rollout.state
    assert not illegal(outcome.events), illegal(outcome.events)
    assert outcome.events and outcome.events[-1]["dst"] == rollout.state
    outcome.sample.check_invariants(rollout.prompt_length)
    assert "rollout_reason" in outcome.sample.metadata
    for env in outcome.envs.built:
        assert env.close_count == 1, env.calls
    if rollout.state == "failed":
        recorded = outcome.sample.metadata["rollout_error"]
        assert recorded["type"] == type(rollout.error).__name__


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)
