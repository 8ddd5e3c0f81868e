"""The runner's start-up template probe against the fake server: the policy it resolves, what it traces, the refusal of
append where the boundary cannot be cut, and the thinking switches reaching the probe, the local template and the
engine's render alike."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from fsm_rollout import RolloutConfig, Sample, Status
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.chat_templates import tokenizer_with_chat_template
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.tokens.template_probe import PROBE_TOOLS, AppendRefused

SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
MODEL = "fake-model"


@functools.cache
def qwen3_6() -> Any:
    return tokenizer_with_chat_template("qwen3_6")


@pytest.fixture
async def server() -> AsyncIterator[FakeVLLMServer]:
    async with FakeVLLMServer(qwen3_6(), model=MODEL) as fake:
        yield fake


def config_for(url: str, *, policy: str | None = None, **overrides: Any) -> RolloutConfig:
    config = RolloutConfig(**{"engine_url": url, "model": MODEL, "max_turns": 2, **overrides})
    if policy is not None:  # set as RolloutConfig.history_policy would be (the field may not exist in this branch)
        object.__setattr__(config, "history_policy", policy)
    return config


def probe_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == "template_probe"]


async def test_auto_resolves_to_fork_at_start_up_on_a_template_that_strips_user_turn_thinking(
    server: FakeVLLMServer,
) -> None:
    with capture_logs() as events:
        async with RolloutRunner(
            config_for(server.url), sampling_params=SAMPLING, tokenizer=qwen3_6(), env_factory=ScriptedEnvFactory()
        ) as runner:
            assert runner.history_policy == "fork"
    (event,) = probe_events(events)
    assert event["requested"] == "auto" and event["policy"] == "fork"
    assert event["roles"]["user"]["cuttable"] is False and list(event["roles"]) == ["user"]


async def test_append_is_refused_once_at_start_up_where_the_boundary_cannot_be_cut(server: FakeVLLMServer) -> None:
    config = config_for(server.url, policy="append")
    runner = RolloutRunner(config, sampling_params=SAMPLING, tokenizer=qwen3_6(), env_factory=ScriptedEnvFactory())
    with pytest.raises(AppendRefused, match="boundary cannot be cut"):
        await runner.__aenter__()
    assert not server.requests_to(RENDER_PATH)  # nothing ran


async def test_append_proceeds_on_preserve_thinking_and_a_new_tool_set_is_probed_once(server: FakeVLLMServer) -> None:
    config = config_for(server.url, policy="append", apply_chat_template_kwargs={"preserve_thinking": True})
    factory = ScriptedEnvFactory(steps=[("Try again.", False)])
    samples = [Sample(prompt="q", index=index, metadata={"tools": list(PROBE_TOOLS)}) for index in range(2)]
    server.script([ScriptedTurn(text=f"{text}</think>\n\nIt is 41.") for text in ("a", "b", "c", "d")])
    with capture_logs() as events:
        async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=qwen3_6(), env_factory=factory) as runner:
            done = await runner.run_batch(samples, concurrency=1)
    assert [sample.status for sample in done] == [Status.TRUNCATED, Status.TRUNCATED]
    probes = probe_events(events)
    assert [list(event["roles"]) for event in probes] == [["user"], ["user", "tool"]]  # start-up, then the tools
    assert all(event["template_kwargs"] == {"preserve_thinking": True} for event in probes)


async def test_thinking_switches_reach_the_probe_the_local_template_and_the_engines_render() -> None:
    # Qwen3.8 without thinking writes history as the rollout holds it: auto appends, so the boundary is cut
    off = {"enable_thinking": False}
    tokenizer = tokenizer_with_chat_template("qwen3_8")
    async with FakeVLLMServer(tokenizer, model=MODEL) as server:
        sample, events = await run_one(server, tokenizer, config_for(server.url, apply_chat_template_kwargs=off))
        renders = server.requests_to(RENDER_PATH)
    assert sample.status == Status.TRUNCATED
    # the probe rendered with the switch: the generation prompt pre-fills a closed empty block
    (event,) = probe_events(events)
    assert event["generation_prompt"] == "closed_think" and event["policy"] == "append"
    # the engine's render got it
    (render,) = renders
    assert render.body["chat_template_kwargs"] == off
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    prompt_length = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt_length - len(closed) : prompt_length] == closed
    # and the local template the boundary is cut from: the observation's boundary opens the next turn the same way
    (observation,) = sample.metadata["observations"]
    boundary_end = prompt_length + observation["end"]
    assert sample.tokens[boundary_end - len(closed) : boundary_end] == closed


async def run_one(server: FakeVLLMServer, tokenizer: Any, config: RolloutConfig) -> tuple[Sample, list[Any]]:
    """One sample: a turn, a user observation, a turn."""
    factory = ScriptedEnvFactory(steps=[("Try again.", False)])
    server.script([ScriptedTurn(text="41"), ScriptedTurn(text="42")])
    with capture_logs() as events:
        async with RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=factory) as runner:
            sample = await runner.run(Sample(prompt="q", index=0))
    return sample, events
