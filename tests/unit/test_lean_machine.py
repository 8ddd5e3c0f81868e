"""The lean machine classes behave like ``transitions.Machine``: random walks through both, compared step by step."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from transitions import Machine, MachineError

from fsm_rollout import lifecycle


class Model:
    """A model whose guards answer from a per-step table and whose callbacks log their names."""

    def __init__(self) -> None:
        self.state = lifecycle.INITIAL
        self.answers: dict[str, bool] = {}
        self.log: list[str] = []
        self.fail_in: str | None = None


def _guard(name: str) -> Callable[[Model], bool]:
    def guard(model: Model) -> bool:
        model.log.append(f"?{name}")
        return model.answers.get(name, False)

    return guard


def _action(name: str) -> Callable[..., None]:
    def action(model: Model, **keywords: Any) -> None:
        model.log.append(name + (f"{sorted(keywords.items())}" if keywords else ""))
        if model.fail_in == name:
            raise RuntimeError(f"{name} failed")

    return action


def _lifecycle_pair() -> tuple[Machine, Machine]:
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _action(name) for name in lifecycle.action_names() | {"record_outcome"}}
    return (lifecycle.build_machine(guards, actions, machine_class=Machine),
            lifecycle.build_machine(guards, actions))


def _walk(machines: tuple[Machine, Machine], seed: int, steps: int = 12) -> None:
    rng = random.Random(seed)
    models = (Model(), Model())
    for _ in range(steps):
        trigger = rng.choice(lifecycle.TRIGGERS)
        answers = {name: rng.random() < 0.3 for name in lifecycle.guard_names()}
        fail_in = rng.choice([None] * 8 + sorted(lifecycle.action_names()) + ["finalize_event", "on_exception"])
        outcomes = []
        for machine, model in zip(machines, models, strict=True):
            model.answers, model.fail_in = answers, fail_in
            try:
                outcomes.append(("ok", machine.events[trigger].trigger(model, model)))
            except (MachineError, RuntimeError) as error:
                outcomes.append((type(error).__name__, str(error)))
        assert outcomes[0] == outcomes[1], (seed, trigger)
        assert models[0].state == models[1].state, (seed, trigger)
        assert models[0].log == models[1].log, (seed, trigger)


@pytest.mark.parametrize("seed", range(300))
def test_the_lifecycle_machine_walks_like_the_plain_one(seed: int) -> None:
    _walk(_lifecycle_pair(), seed)


def _general_pair(on_exception: bool) -> tuple[Machine, Machine]:
    """Both machines with every kind of callback the lean classes special-case, non-empty; with
    ``on_exception``, errors go to a callback instead of being raised."""

    def machine(cls: type[Machine]) -> Machine:
        names = ["before_state_change", "after_state_change", "prepare_event", "finalize_event", "on_final"]
        if on_exception:
            names.append("on_exception")
        hooks: dict[str, Any] = {name: [_action(name)] for name in names}
        states = [
            {"name": state.name, "on_enter": [_action(f"enter_{state.name}")],
             "on_exit": [_action(f"exit_{state.name}")], "final": state.terminal}
            for state in lifecycle.STATES
        ]
        transitions = [
            {"trigger": edge.trigger, "source": edge.source, "dest": edge.dest,
             "conditions": [_guard(edge.guard)] if edge.guard else [],
             "prepare": [_action("prepare")], "before": [_action(name) for name in edge.actions],
             "after": [_action("after")]}
            for edge in lifecycle.TRANSITIONS
        ]
        return cls(model=None, states=states, initial=lifecycle.INITIAL, transitions=transitions,
                   auto_transitions=False, send_event=False, **hooks)

    return machine(Machine), machine(lifecycle.LifecycleMachine)


@pytest.mark.parametrize("on_exception", [False, True])
@pytest.mark.parametrize("seed", range(100))
def test_every_callback_kind_runs_in_the_same_order(seed: int, on_exception: bool) -> None:
    _walk(_general_pair(on_exception), seed)


def test_the_lifecycle_is_built_on_the_lean_classes() -> None:
    from fsm_rollout.rollout import _MACHINE

    assert isinstance(_MACHINE, lifecycle.LifecycleMachine)
    assert all(isinstance(state, lifecycle.LeanState) for state in _MACHINE.states.values())
    assert all(isinstance(event, lifecycle.LeanEvent) for event in _MACHINE.events.values())
