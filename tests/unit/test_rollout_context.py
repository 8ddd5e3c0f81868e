"""The rollout's context (its JSON is the resume state), its guards and actions without a client, and the cancel
scope's two causes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import ResumeError
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout import steps
from fsm_rollout.rollout.cancel import CancelScope, Stopped
from fsm_rollout.rollout.context import RESUME_STATE_VERSION, Deps, RolloutContext, data_fields
from fsm_rollout.rollout.gating import GatePoint
from fsm_rollout.sample import Sample, Status
from fsm_rollout.types import GeneratedTurn, RenderedPrompt, TurnMeta


def a_turn(request_id: str = "r-turn0", tokens: tuple[int, ...] = (5, 6, 7)) -> GeneratedTurn:
    return GeneratedTurn(
        request_id=request_id,
        finish="stop",
        token_ids=list(tokens),
        logprobs=[-0.5] * len(tokens),
        meta=TurnMeta(
            finish_reason="stop", weight_version="3", prompt_tokens=4, weight_version_spans=(("3", 0, len(tokens)),)
        ),
    )


# A value unlike the default for each type a data field may have. A field of a new type fails the round-trip test
# until its JSON form exists (context.py) and a value of it is listed here.
NON_DEFAULT: dict[str, Any] = {
    "str": "x",
    "str | None": "x",
    "int": 7,
    "int | None": 7,
    "bool": True,
    "TokenIds": [1, 2, 3],
    "tuple[str, ...]": ("h1", "h2"),
    "RenderedPrompt | None": RenderedPrompt(token_ids=[1, 2], generate_body={"model": "m", "features": None}),
    "GeneratedTurn | None": a_turn(),
    "list[Span]": [("3", 0, 2), ("4", 2, 3)],
    "list[dict[str, Any]]": [{"role": "user", "content": "the tool says 42"}],
    "list[GeneratedTurn]": [a_turn("r-turn1"), a_turn("r-turn1-part1", (8,))],
    "Any": {"turns": 2, "scores": [0.5]},
    "dict[str, Any] | None": {"mm_placeholders": {"image": [{"offset": 3, "length": 2}]}, "kwargs_data": None},
}


def deps(**config: Any) -> Deps:
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)))
    return Deps(
        config=RolloutConfig(model="m", engine_url="http://engine.invalid", max_turns=3, **config),
        params={"max_tokens": 10},
        encoder=None,
        tokenizer=tokenizer,
        processor=None,
        gate=GatePoint(None),
    )


def fresh(**fields: Any) -> RolloutContext:
    return RolloutContext(sample=Sample(prompt="p", index=0, metadata={}), deps=deps(), **fields)


def every_field_set() -> RolloutContext:
    context = fresh()
    default = fresh()
    for item in data_fields():
        assert item.type in NON_DEFAULT, f"context field {item.name}: add a value of type {item.type} to NON_DEFAULT"
        value = NON_DEFAULT[item.type]
        if item.name == "state":
            value = "suspended"
        assert value != getattr(default, item.name), item.name
        setattr(context, item.name, value)
    return context


def test_every_data_field_survives_the_json_round_trip() -> None:
    context = every_field_set()
    state = json.loads(json.dumps(context.to_json()))  # plain JSON
    back = RolloutContext.from_json(state, sample=context.sample, deps=context.deps, sample_id="0")
    for item in data_fields():
        assert getattr(back, item.name) == getattr(context, item.name), item.name


def test_the_json_keys_are_the_data_fields() -> None:
    assert set(fresh().to_json()) == {item.name for item in data_fields()} | {"version"}


def test_only_process_objects_are_left_out_of_the_json() -> None:
    live = {item.name for item in dataclasses.fields(RolloutContext)} - {item.name for item in data_fields()}
    # ``streamed``: the request in flight's tokens, empty whenever a resume state can be taken (suspended)
    assert live == {"sample", "deps", "env", "step", "last_turn", "error", "closing", "streamed"}


def test_a_state_missing_a_field_is_damaged() -> None:
    state = fresh(state="suspended").to_json()
    del state["budget"]
    with pytest.raises(ResumeError, match=r"damaged.*budget"):
        RolloutContext.from_json(state, sample=Sample(prompt="p"), deps=deps(), sample_id="9")


def test_a_version_2_state_reads_with_the_later_fields_at_their_defaults() -> None:
    # what a handed-back sample carried before forks, image observations and gateway calls added fields
    later = {"branch_start", "call_max_tokens", "fork_prompt", "history", "observation_features",
             "observation_image_hashes"}  # fmt: skip
    context = every_field_set()
    state = {key: value for key, value in json.loads(json.dumps(context.to_json())).items() if key not in later}
    state["version"] = 2
    back = RolloutContext.from_json(state, sample=context.sample, deps=context.deps, sample_id="0")
    default = fresh()
    for item in data_fields():
        expected = getattr(default if item.name in later else context, item.name)
        assert getattr(back, item.name) == expected, item.name
    del state["budget"]  # a field version 2 had is still required
    with pytest.raises(ResumeError, match=r"damaged.*budget"):
        RolloutContext.from_json(state, sample=context.sample, deps=context.deps, sample_id="0")


def test_a_version_3_state_from_before_the_typed_step_still_reads() -> None:
    context = every_field_set()
    state = json.loads(json.dumps(context.to_json()))
    assert "env_done" not in state and "env_truncated" not in state  # the last step is live now, not resumed
    state.update(env_done=True, env_truncated=False)  # what a handed-back sample carried before the typed step
    back = RolloutContext.from_json(state, sample=context.sample, deps=context.deps, sample_id="0")
    assert back.step is None and back.state == context.state
    del state["budget"]  # a field it had is still required
    with pytest.raises(ResumeError, match=r"damaged.*budget"):
        RolloutContext.from_json(state, sample=context.sample, deps=context.deps, sample_id="0")


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ResumeError, match=f"version {RESUME_STATE_VERSION}"):
        RolloutContext.from_json({"version": 99}, sample=Sample(prompt="p"), deps=deps(), sample_id="9")


def test_a_version_1_resume_state_still_reads() -> None:
    old = {  # what a handed-back sample carried before the context existed
        "version": 1,
        "token": "abc",
        "state": "suspended",
        "reason": "weight_update",
        "sample_id": "4",
        "request_prefix": "s4",
        "status": "pending",
        "turn_index": 1,
        "turn_requests": 2,
        "suspensions": 1,
        "prompt_length": 3,
        "budget": 20,
        "rendered": {"token_ids": [1, 2, 3], "generate_body": {"model": "m"}},
        "image_hashes": [],
        "response_token_ids": [9, 9],
        "partial_turn": [],
        "env_snapshot": {"turns": 1},
        "env_snapshot_error": None,
    }
    back = RolloutContext.from_json(old, sample=Sample(prompt="p"), deps=deps(), sample_id="4")
    assert (back.suspend_reason, back.status_before_hand_back, back.turn_requests) == ("weight_update", "pending", 2)
    assert back.rendered == RenderedPrompt(token_ids=[1, 2, 3], generate_body={"model": "m"})
    assert back.env_snapshot == {"turns": 1}


# ------------------------------------------------------------------ guards and actions without a client


def test_guards_read_the_context() -> None:
    context = fresh(budget=5)
    context.sample.response_length = 5
    assert steps.budget_exhausted(context)
    context.budget = 6
    assert not steps.budget_exhausted(context)
    context.turn, context.eos_due = a_turn(tokens=(1,)), True
    assert steps.no_budget_for_stop_eos(context)
    context.turn_index = 0
    assert not steps.turn_limit_reached(context)
    context.turn_index = 2
    assert steps.turn_limit_reached(context)


def test_the_hand_back_action_writes_the_context_with_the_environment_snapshot() -> None:
    context = fresh(state="suspended", rendered=RenderedPrompt(token_ids=[1], generate_body={}), suspensions=1)
    context.env = SimpleNamespace(snapshot=lambda: {"turns": 3})
    steps.hand_back(context)
    state = context.sample.metadata["resume_state"]
    assert state == context.to_json()
    assert state["env_snapshot"] == {"turns": 3} and state["status_before_hand_back"] == "pending"
    context.env = object()  # without snapshot(): the resume will say so
    steps.hand_back(context)
    assert context.sample.metadata["resume_state"]["env_snapshot_error"] == "object has no snapshot()"


def test_record_outcome_takes_the_abort_reason_only_for_abort() -> None:
    context = fresh(stop_reason="shutdown")
    steps.record_outcome(context, dest="aborted", reason=None)
    assert (context.reason, context.sample.status) == ("shutdown", Status.ABORTED)
    steps.record_outcome(context, dest="truncated", reason="rollout_timeout")
    assert context.sample.metadata["rollout_reason"] == "rollout_timeout"


def test_the_machine_is_built_from_these_functions() -> None:
    assert set(steps.GUARDS) == lifecycle.guard_names()
    assert set(steps.ACTIONS) == lifecycle.action_names() | {"record_outcome"}


# ------------------------------------------------------------------ the cancel scope


async def test_a_timeout_is_not_an_abort() -> None:
    scope = CancelScope()
    hold = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(scope.run(hold, request_id="r-turn0"))
    await asyncio.sleep(0)
    assert scope.time_out("rollout_timeout")
    with pytest.raises(Stopped):
        await waiting
    assert (scope.trigger, scope.abort_reason, scope.take_cancelled_request()) == ("rollout_timeout", None, "r-turn0")
    assert not scope.abort("cancelled")  # the first cause wins
    assert (scope.trigger, scope.abort_reason) == ("rollout_timeout", None)


async def test_an_abort_is_not_a_timeout_and_nothing_starts_after_it() -> None:
    scope = CancelScope()
    assert scope.abort("weight_update")
    assert not scope.time_out("env_timeout")
    assert (scope.trigger, scope.timeout) == ("abort", None)

    async def never_sent() -> None:
        raise AssertionError("started after the abort")

    with pytest.raises(Stopped):
        await scope.run(never_sent())


def test_hooks_see_a_read_only_view_that_stands_for_its_rollout() -> None:
    from fsm_rollout.rollout.view import View

    context = fresh(state="generating", turn_index=2, suspensions=1, sample_id="7", request_prefix="s7")
    owner = object()
    view = View(context, rollout_uid="u", owner=owner)
    assert (view.state, view.turn_index, view.suspensions, view.sample_id, view.request_prefix, view.rollout_uid) == (
        "generating",
        2,
        1,
        "7",
        "s7",
        "u",
    )
    assert view.sample is context.sample
    with pytest.raises(AttributeError):
        view.state = "aborted"  # type: ignore[misc]
    rollouts = {owner}
    rollouts.discard(view)  # an observer keeping rollouts removes one by its view
    assert not rollouts
