"""The lean machine classes behave like ``transitions.Machine`` (random walks through both, compared step by step),
are used only on a ``transitions`` whose replaced methods were verified, and refuse configurations they drop."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import transitions
from transitions import Machine, MachineError
from transitions.core import Event

from fsm_rollout.machine import lean_machine, lifecycle


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
    return (lifecycle.build_machine(guards, actions, machine_class=Machine), lifecycle.build_machine(guards, actions))


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
    """Both machines with every kind of callback the lean classes special-case, non-empty (callables, as the lean
    machine requires); with ``on_exception``, errors go to a callback instead of being raised."""

    def machine(cls: type[Machine]) -> Machine:
        names = ["before_state_change", "after_state_change", "prepare_event", "finalize_event", "on_final"]
        if on_exception:
            names.append("on_exception")
        hooks: dict[str, Any] = {name: [_action(name)] for name in names}
        states = [
            {
                "name": state.name,
                "on_enter": [_action(f"enter_{state.name}")],
                "on_exit": [_action(f"exit_{state.name}")],
                "final": state.terminal,
            }
            for state in lifecycle.STATES
        ]
        transitions = [
            {
                "trigger": edge.trigger,
                "source": edge.source,
                "dest": edge.dest,
                "conditions": [_guard(edge.guard)] if edge.guard else [],
                "prepare": [_action("prepare")],
                "before": [_action(name) for name in edge.actions],
                "after": [_action("after")],
            }
            for edge in lifecycle.TRANSITIONS
        ]
        return cls(
            model=None,
            states=states,
            initial=lifecycle.INITIAL,
            transitions=transitions,
            auto_transitions=False,
            send_event=False,
            **hooks,
        )

    return machine(Machine), machine(lifecycle.LifecycleMachine)


@pytest.mark.parametrize("on_exception", [False, True])
@pytest.mark.parametrize("seed", range(100))
def test_every_callback_kind_runs_in_the_same_order(seed: int, on_exception: bool) -> None:
    _walk(_general_pair(on_exception), seed)


def test_the_lifecycle_is_built_on_the_lean_classes() -> None:
    from fsm_rollout.rollout.steps import MACHINE

    assert isinstance(MACHINE, lifecycle.LifecycleMachine)
    assert all(isinstance(state, lifecycle.LeanState) for state in MACHINE.states.values())
    assert all(isinstance(event, lifecycle.LeanEvent) for event in MACHINE.events.values())


def test_the_replaced_upstream_methods_are_the_verified_ones() -> None:
    """An upgrade of ``transitions`` (or any change to a copied method) fails here until the lean copies are
    reviewed against the new upstream code and ``VERIFIED_SOURCES`` gets an entry for it."""
    version = transitions.__version__
    assert version in lean_machine.VERIFIED_SOURCES, f"transitions {version} was never verified"
    recorded = lean_machine.VERIFIED_SOURCES[version]
    changed = sorted(
        name for name, digest in lean_machine.upstream_source_sha256().items() if recorded.get(name) != digest
    )
    assert not changed, f"transitions {version} changed methods the lean machine copies: {changed}"
    assert set(recorded) == set(lean_machine.upstream_source_sha256())
    assert lean_machine.is_verified()


def _delegating_process(self: Event, event_data: Any) -> bool:  # same behaviour, different source
    return bool(_ORIGINAL_PROCESS(self, event_data))


_ORIGINAL_PROCESS = Event._process


@pytest.mark.parametrize("change", ["hash_table", "version", "upstream_source"])
def test_an_unverified_transitions_gets_the_plain_machine_and_one_warning(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if change == "hash_table":
        altered = {name: "0" * 64 for name in lean_machine.VERIFIED_SOURCES[transitions.__version__]}
        monkeypatch.setattr(lean_machine, "VERIFIED_SOURCES", {transitions.__version__: altered})
    elif change == "version":
        monkeypatch.setattr(transitions, "__version__", "0.9.99")
    else:
        monkeypatch.setattr(Event, "_process", _delegating_process)
    monkeypatch.setattr(lean_machine, "_fallback_warned", False)
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _action(name) for name in lifecycle.action_names() | {"record_outcome"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        machines = [lifecycle.build_machine(guards, actions) for _ in range(3)]
    assert all(type(machine) is Machine for machine in machines)
    fallbacks = [w for w in caught if issubclass(w.category, lean_machine.LeanMachineFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "plain transitions.Machine" in str(fallbacks[0].message)
    model = Model()
    assert machines[0].events["render"].trigger(model, model) and model.state == "rendered"


def test_the_verified_install_gets_the_lean_machine_without_a_warning() -> None:
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _action(name) for name in lifecycle.action_names() | {"record_outcome"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(lifecycle.build_machine(guards, actions)) is lean_machine.LifecycleMachine


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"send_event": True}, ValueError, "send_event"),
        ({"queued": True}, ValueError, "queued"),
        ({"model": "self"}, ValueError, "no models"),
        (
            {"transitions": [{"trigger": "go", "source": "a", "dest": "b", "conditions": "is_ready"}]},
            TypeError,
            "'is_ready'",
        ),
        ({"transitions": [{"trigger": "go", "source": "a", "dest": "b", "after": ["done"]}]}, TypeError, "'done'"),
        ({"states": ["a", {"name": "b", "on_enter": "entered"}]}, TypeError, "state 'b'"),
        ({"before_state_change": "before"}, TypeError, "before_state_change"),
    ],
)
def test_the_lean_machine_refuses_what_it_does_not_implement(
    config: dict[str, Any], error: type[Exception], message: str
) -> None:
    kwargs: dict[str, Any] = {"states": ["a", "b"], "initial": "a", "auto_transitions": False, **config}
    with pytest.raises(error, match=message):
        lean_machine.LifecycleMachine(**kwargs)
    machine = lean_machine.LifecycleMachine(states=["a", "b"], initial="a", auto_transitions=False)
    with pytest.raises(TypeError, match="callables only"):
        machine.add_transition("go", "a", "b", before="named")
    with pytest.raises(ValueError, match="no models"):
        machine.add_model(Model())


def test_build_machine_refuses_guards_named_by_string() -> None:
    guards: dict[str, Any] = {name: name for name in lifecycle.guard_names()}
    actions = {name: _action(name) for name in lifecycle.action_names() | {"record_outcome"}}
    with pytest.raises(TypeError, match="callables, not names"):
        lifecycle.build_machine(guards, actions)
