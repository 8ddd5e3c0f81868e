"""Property-based lifecycle tests: random scenarios against the fake vLLM server.

Each example draws a scenario -- scripted turns (text, stop strings, EOS, forced finish reasons), turn and token
budgets, environment outcomes and exceptions, transient or persistent server faults, and an abort at some
generate -- runs it, and checks: a terminal state is reached, the path is a legal walk of the table, the sample's
arrays line up, the environment is closed exactly once, nothing is sent after an abort, and the outcome agrees with
the scenario. One property compares transient-fault runs with their fault-free twin; another records a subset and
re-executes the recording with :func:`fsm_rollout.replay.replay`.

One fake server and one client serve each test function, on an event loop in a background thread; each example
runs its coroutine there (hypothesis drives a plain synchronous test).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _support import FAST_RETRY, HookedEnvFactory, Outcome, check_common, illegal, run_scenario, wait_until
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fsm_rollout import Rollout, Sample, VLLMClient, capture_transitions
from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_path_for
from fsm_rollout.replay import replay
from fsm_rollout.testing.envs import ScriptedEnv
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import Tracer

EOS = "<|im_end|>"
STOP = "</a>"
_ids = itertools.count(1)


class LoopThread:
    """An event loop in a daemon thread holding one fake server and one client for a whole test function."""

    def __init__(self, tokenizer: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = FakeVLLMServer(tokenizer, model="fake-model")
        self.run(self.server.start())
        self.client = VLLMClient(self.server.url, retry=FAST_RETRY, request_timeout_s=30.0)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tokenizer: Any) -> Iterator[LoopThread]:
    loop = LoopThread(tokenizer)
    yield loop
    loop.close()


# ------------------------------------------------------------ scenarios

WORDS = ["alpha", "beta", " 42", " think", "\n", " x", "gamma delta", STOP, EOS]


@st.composite
def turn_texts(draw: st.DrawFn) -> str:
    text = "".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=8)))
    return text if text.strip() else "ok"


@dataclass
class Scenario:
    texts: list[str]
    finishes: list[str | None]
    max_turns: int
    max_new_tokens: int | None
    context_len: int | None
    stop: bool
    env_steps: list[tuple[str, bool]]
    env_raise: str | None  # "step:n" / "format_observation:n" / "reset:1" / "close:1"
    faults: list[tuple[int, str, int]]  # (before generate #k, kind, times)
    abort_at: int | None  # abort while generate #k hangs

    def sampling(self) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": 1.0, "top_p": 1.0}
        if self.stop:
            sampling.update(stop=[STOP], no_stop_trim=True)
        return sampling

    @property
    def persistent_fault(self) -> bool:
        return any(times >= FAST_RETRY.max_attempts or kind == "500" for _, kind, times in self.faults)


@st.composite
def scenarios(draw: st.DrawFn, *, faults: bool = True, aborts: bool = True, env_errors: bool = True) -> Scenario:
    n = draw(st.integers(1, 4))  # max_turns: one scripted turn per possible generate
    texts = [draw(turn_texts()) for _ in range(n)]
    finishes = [draw(st.sampled_from([None, None, None, None, "length", "abort"])) for _ in range(n)]
    obs = st.sampled_from(["Continue.", "no", "Try again with more care, please. " * 3])
    env_steps = draw(st.lists(st.tuples(obs, st.booleans()), min_size=0, max_size=4))
    env_raise = None
    if env_errors and draw(st.integers(0, 9)) == 0:
        env_raise = draw(st.sampled_from(["reset:1", "step:1", "step:2", "format_observation:1", "close:1"]))
    fault_list: list[tuple[int, str, int]] = []
    if faults:
        fault_list = draw(
            st.lists(
                st.tuples(
                    st.integers(0, n - 1), st.sampled_from(["503", "429", "502", "reset", "500"]), st.integers(1, 3)
                ),
                max_size=2,
                unique_by=lambda fault: fault[0],
            )
        )
    abort_at = draw(st.one_of(st.none(), st.integers(0, n - 1))) if aborts else None
    return Scenario(
        texts=texts,
        finishes=finishes,
        max_turns=n,
        max_new_tokens=draw(st.one_of(st.none(), st.integers(0, 80))),
        context_len=draw(st.one_of(st.none(), st.integers(10, 200))),
        stop=draw(st.booleans()),
        env_steps=env_steps,
        env_raise=env_raise,
        faults=fault_list,
        abort_at=abort_at,
    )


def inject(server: FakeVLLMServer, kind: str, times: int) -> None:
    if kind == "reset":
        server.fail_next(GENERATE_PATH, reset=True, times=times)
    else:
        server.fail_next(GENERATE_PATH, status=int(kind), times=times)


class EnvError(RuntimeError):
    pass


async def play(
    server: FakeVLLMServer,
    client: VLLMClient,
    tokenizer: Any,
    scenario: Scenario,
    *,
    with_faults: bool = True,
    record_dir: Path | None = None,
) -> Outcome:
    """Run one scenario on its own session of the shared server."""
    index = next(_ids)
    session = f"prop-{index}"
    turns = [
        ScriptedTurn(text="never", hang=True) if k == scenario.abort_at else ScriptedTurn(text=text, finish=finish)
        for k, (text, finish) in enumerate(zip(scenario.texts, scenario.finishes, strict=True))
    ]
    server.script(turns, session=session)
    faults = {k: (kind, times) for k, kind, times in scenario.faults} if with_faults else {}

    def hook(method: str, env: ScriptedEnv) -> None:
        if method == scenario.env_raise and not method.startswith("close"):
            raise EnvError(f"{method} broke")
        name, _, count = method.partition(":")
        if name == "step" and int(count) in faults:
            inject(server, *faults[int(count)])

    envs = HookedEnvFactory(
        steps=scenario.env_steps,
        hook=hook,
        raise_in={"close": EnvError("close broke")} if scenario.env_raise == "close:1" else {},
    )
    if 0 in faults:
        inject(server, *faults[0])
    sample = Sample(prompt="What is 6 * 7?", index=index, session_id=session)
    tracer = tape = None
    if record_dir is not None:
        trace = record_dir / f"{session}.jsonl"
        tracer = Tracer(trace.open("ab"), owns_stream=True)
        tape = TapeWriter(tape_path_for(trace))

    async def interrupt(rollout: Rollout, task: asyncio.Task[Any]) -> dict[str, Any]:
        if scenario.abort_at is None:
            return {}
        target = scenario.abort_at + 1

        def arrived() -> bool:
            mine = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session]
            return task.done() or (len(mine) >= target and rollout.turn_index == scenario.abort_at)

        await wait_until(arrived, "the hanging generate", timeout_s=20)
        if task.done():
            return {}
        await rollout.abort("weight_update")
        return {"aborted_at": len(server.requests)}

    try:
        if tracer is not None:
            rollout = recorded_rollout(
                sample,
                config=_config(server, scenario),
                sampling_params=scenario.sampling(),
                client=client,
                tokenizer=tokenizer,
                env_factory=envs,
                tracer=tracer,
                tape=tape,
            )
            with capture_transitions() as events:
                task = asyncio.ensure_future(rollout.run())
                extra = await interrupt(rollout, task)
                error = None
                try:
                    await task
                except Exception as caught:
                    error = caught
            outcome = Outcome(rollout, envs, list(events), error, len(server.requests), extra)
        else:
            outcome = await run_scenario(
                server,
                tokenizer,
                sample=sample,
                envs=envs,
                sampling=scenario.sampling(),
                client=client,
                interrupt=interrupt,
                **_config_kwargs(scenario),
            )
        if "aborted_at" in outcome.extra:
            await asyncio.sleep(0.01)
    finally:
        server.clear_faults()  # a fault the rollout never reached must not leak into the next example
        if tracer is not None and tape is not None:
            tape.close()
            tracer.close()
    return outcome


def _config_kwargs(scenario: Scenario) -> dict[str, Any]:
    return {
        "max_turns": scenario.max_turns,
        "rollout_max_context_len": scenario.context_len,
        "router_policy": "consistent_hash",
    }


def _config(server: FakeVLLMServer, scenario: Scenario) -> Any:
    from _support import make_config

    return make_config(server.url, **_config_kwargs(scenario))


def check_outcome(outcome: Outcome, scenario: Scenario, server: FakeVLLMServer, with_faults: bool = True) -> None:
    check_common(outcome)
    state = outcome.rollout.state
    reason = outcome.sample.metadata["rollout_reason"]
    event(f"{state}/{reason}")
    assert outcome.events[-1].get("reason") == reason
    if "aborted_at" in outcome.extra:
        # a sample may still fail after an abort was asked for (env.close raising, or an engine error racing the
        # abort); it then ends failed with the reason "error"
        allowed = {("aborted", "weight_update"), ("failed", "error")}
        assert (state, reason) in allowed
        assert len(server.requests) == outcome.extra["aborted_at"], "a request was sent after the abort"
    faulty = with_faults and scenario.persistent_fault
    if not faulty and scenario.env_raise is None and scenario.abort_at is None:
        assert state != "failed", outcome.sample.metadata.get("rollout_error")
    if state == "failed":
        assert outcome.error is not None
        assert outcome.events[-1]["trigger"] == "fail"
    elif state == "completed":
        assert reason == "env_done"
    trainable = [
        lp
        for lp, mask in zip(outcome.sample.rollout_log_probs or [], outcome.sample.loss_mask or [], strict=True)
        if mask
    ]
    assert all(lp < 0 for lp in trainable)  # model tokens carry the server's logprobs
    assert all(
        lp == 0.0
        for lp, mask in zip(outcome.sample.rollout_log_probs or [], outcome.sample.loss_mask or [], strict=True)
        if not mask
    )
    if outcome.sample.response_length and state != "failed":
        assert outcome.sample.response  # decoded text of the model's tokens (may be empty only if none)


def budget(examples: int) -> settings:
    """The test's example budget; which examples (the same every run, or new ones) is the profile's
    (``tests/conftest.py``)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@budget(600)
@given(scenario=scenarios())
def test_every_scenario_ends_terminal_on_a_legal_path(harness: LoopThread, tokenizer: Any, scenario: Scenario) -> None:
    outcome = harness.run(play(harness.server, harness.client, tokenizer, scenario))
    check_outcome(outcome, scenario, harness.server)


@budget(250)
@given(scenario=scenarios(aborts=False, env_errors=False).filter(lambda s: not s.persistent_fault))
def test_transient_faults_end_as_the_fault_free_run(harness: LoopThread, tokenizer: Any, scenario: Scenario) -> None:
    faulty = harness.run(play(harness.server, harness.client, tokenizer, scenario))
    clean = harness.run(play(harness.server, harness.client, tokenizer, scenario, with_faults=False))
    check_outcome(faulty, scenario, harness.server)
    check_outcome(clean, scenario, harness.server, with_faults=False)
    assert faulty.training_view() == clean.training_view()
    assert faulty.path == clean.path


@budget(150)
@given(scenario=scenarios())
def test_recorded_scenarios_replay_identically(
    harness: LoopThread, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory, scenario: Scenario
) -> None:
    directory = tmp_path_factory.mktemp("rec", numbered=True)
    outcome = harness.run(play(harness.server, harness.client, tokenizer, scenario, record_dir=directory))
    check_outcome(outcome, scenario, harness.server)
    (trace,) = [path for path in directory.glob("*.jsonl") if not path.name.endswith(".tape.jsonl")]
    report = replay(trace, tokenizer=tokenizer)
    assert report.identical, report.render(verbose=True)
    assert report.counts() == {"identical": 1}
    assert not illegal(outcome.events)
