"""Shared fixtures (the real Qwen tokenizer, a fake vLLM server on loopback, a client, configs and a runner) and the
Hypothesis profiles of the property tests.

Hypothesis profiles, chosen with ``HYPOTHESIS_PROFILE`` (or ``--hypothesis-profile``):

* ``repeatable`` (the default, and what CI runs): ``derandomize=True`` and no example database, so every run
  tries the same examples and a red CI run is red again on any machine.
* ``explore``: new random examples on every run, from one seed for the whole session. The seed is printed in the
  session header and again in the summary; ``HYPOTHESIS_PROFILE=explore HYPOTHESIS_SEED=<seed> pytest ...`` (or
  ``--hypothesis-seed=<seed>``) replays the same examples. Failures also print a ``@reproduce_failure`` blob.

Per-test budgets (``max_examples``, deadlines, health checks) stay with the tests; only the choice of examples
is the profile's.
"""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, VLLMClient, capture_transitions
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

# the process's peak memory in the summary, and per-test resource lines on request; modules marked own_process run
# in a child pytest
pytest_plugins = ["resource_watch", "own_process"]

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}

PROFILE_ENV_VAR = "HYPOTHESIS_PROFILE"
SEED_ENV_VAR = "HYPOTHESIS_SEED"
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get(PROFILE_ENV_VAR) or "repeatable")


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' own plugin reads --hypothesis-seed
def pytest_configure(config: pytest.Config) -> None:
    if settings.get_current_profile_name() != "explore" or config.getoption("hypothesis_seed", None) is not None:
        return
    config.option.hypothesis_seed = int(os.environ.get(SEED_ENV_VAR) or random.SystemRandom().getrandbits(32))


def _exploring_with(config: pytest.Config) -> str | None:
    seed = config.getoption("hypothesis_seed", None)
    if settings.get_current_profile_name() != "explore" or seed is None:
        return None
    return f"{PROFILE_ENV_VAR}=explore {SEED_ENV_VAR}={seed}"


def pytest_report_header(config: pytest.Config) -> str | None:
    exploring = _exploring_with(config)
    return None if exploring is None else f"hypothesis: exploring new examples; replay them with {exploring}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    exploring = _exploring_with(config)
    if exploring is not None:
        terminalreporter.write_sep("=", f"hypothesis examples explored with {exploring}")


@pytest.fixture(autouse=True)
def _aiohttp_forgets_finished_servers() -> Iterator[None]:
    """After each test, empty aiohttp's module-level cache of middleware chains (up to 1024 of them, keyed by handler
    and app): it holds every app a test served, and with it the server object behind its handlers (an engine and
    its model, a fake server and the requests it recorded, a gateway and its runner's tokenizer) for the rest of the
    session. The library releases what its own servers hold when they stop; this keeps the rest bounded too."""
    yield
    from aiohttp import web_app

    cache = getattr(web_app, "_cached_build_middleware", None)  # aiohttp >= 3.10; absent, there is nothing to clear
    if cache is not None and hasattr(cache, "cache_clear"):
        cache.cache_clear()


def _heap_trimmer() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc: nothing to trim
        return None
    return trim


_MALLOC_TRIM = _heap_trimmer()


@pytest.fixture(autouse=True)
def _freed_memory_goes_back_to_the_system() -> Iterator[None]:
    """After each test (its fixtures closed first: autouse fixtures are torn down last), hand the heap memory it
    freed back to the system (glibc's ``malloc_trim``). glibc keeps freed memory for reuse, so the one pytest
    process's resident size would otherwise hold the largest heap any earlier test needed (three Qwen3.6 tokenizers
    freed: 628 MiB resident, 90 MiB after the trim), and each later test's own need would stack on top of it."""
    yield
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return load_qwen_tokenizer()


@pytest.fixture
async def fake_vllm(tokenizer: Any) -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(tokenizer, model=MODEL) as server:
        yield server


@pytest.fixture
async def client(fake_vllm: FakeVLLMServer) -> AsyncIterator[VLLMClient]:
    async with VLLMClient(fake_vllm.url, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01)) as engine:
        yield engine


@pytest.fixture
def make_config(fake_vllm: FakeVLLMServer) -> Callable[..., RolloutConfig]:
    def make(**overrides: Any) -> RolloutConfig:
        values: dict[str, Any] = {
            "engine_url": fake_vllm.url,
            "model": MODEL,
            "max_turns": 3,
            "check_invariants": True,
            "retry": RetryPolicy(max_attempts=3, base_delay_s=0.01),
        }
        values.update(overrides)
        return RolloutConfig(**values)

    return make


class RunResult:
    """What one rollout run left behind: the rollout, its sample, the environment and the transition events."""

    def __init__(self, rollout: Rollout, envs: ScriptedEnvFactory, events: list[dict[str, Any]]) -> None:
        self.rollout = rollout
        self.sample = rollout.sample
        self.envs = envs
        self.events = events

    @property
    def path(self) -> list[tuple[str, str, str]]:
        return [(event["src"], event["trigger"], event["dst"]) for event in self.events]


@pytest.fixture
def make_rollout(
    make_config: Callable[..., RolloutConfig], client: VLLMClient, tokenizer: Any
) -> Callable[..., tuple[Rollout, ScriptedEnvFactory]]:
    def make(
        sample: Sample | None = None,
        *,
        envs: ScriptedEnvFactory | None = None,
        sampling: dict[str, Any] | None = None,
        **config: Any,
    ) -> tuple[Rollout, ScriptedEnvFactory]:
        envs = envs or ScriptedEnvFactory()
        rollout = Rollout(
            sample or Sample(prompt="What is 6 * 7?", index=0),
            config=make_config(**config),
            sampling_params=sampling or dict(SAMPLING),
            client=client,
            tokenizer=tokenizer,
            env_factory=envs,
        )
        return rollout, envs

    return make


@pytest.fixture
def run_rollout(make_rollout: Callable[..., tuple[Rollout, ScriptedEnvFactory]]) -> Callable[..., Any]:
    async def run(sample: Sample | None = None, **kwargs: Any) -> RunResult:
        rollout, envs = make_rollout(sample, **kwargs)
        with capture_transitions() as events:
            await rollout.run()
        return RunResult(rollout, envs, events)

    return run


def illegal_steps(events: list[dict[str, Any]]) -> list[str]:
    """Problems with the traced paths: every transition an edge of the table, consecutive, ending terminal."""
    from fsm_rollout.machine import lifecycle

    edges = {(edge.source, edge.trigger, edge.dest) for edge in lifecycle.TRANSITIONS}
    state_of: dict[str, str] = {}
    handed_back: dict[str, bool] = {}
    problems = []
    for number, event in enumerate(events):
        key = str(event.get("sample_id"))
        current = state_of.get(key, lifecycle.INITIAL)
        if current in lifecycle.TERMINAL and event["src"] == lifecycle.INITIAL:
            current = lifecycle.INITIAL  # the same sample id reused by a later rollout in the test
        if handed_back.pop(key, False) and event["src"] == "suspended":
            current = "suspended"  # a handed-back sample resumes where it stopped
        step = (event["src"], event["trigger"], event["dst"])
        if event["src"] != current:
            problems.append(f"event {number} of {key}: from {event['src']} but the sample was in {current}")
        if step not in edges:
            problems.append(f"event {number} of {key}: {step} is not an edge of the table")
        state_of[key] = event["dst"]
        handed_back[key] = event["trigger"] == "hand_back"
    problems.extend(
        f"{key} ended in non-terminal {state}" for key, state in state_of.items() if state not in lifecycle.TERMINAL
    )
    return problems


@pytest.fixture(autouse=True)
def every_traced_path_is_legal(request: pytest.FixtureRequest) -> Any:
    """Every rollout a test runs must take only edges of the table, one after another, and end terminal.

    Tests that place a rollout in a state by hand or emit synthetic events are marked ``synthetic_paths``.
    """
    from fsm_rollout.trace import capture_transitions as capture

    if request.node.get_closest_marker("synthetic_paths"):
        yield
        return
    with capture() as events:
        yield
    problems = illegal_steps(events)
    assert not problems, "illegal lifecycle paths:\n" + "\n".join(problems[:20])
