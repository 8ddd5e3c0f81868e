"""The ``machine`` workload: one transition of the lifecycle machine against plain alternatives."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

from fsm_rollout.cli.bench.params import SCALE_TURNS
from fsm_rollout.machine import lifecycle


def _best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


class _Model:
    """A stand-in rollout whose guards answer from fixed flags, for timing the machine alone."""

    def __init__(self) -> None:
        self.state = lifecycle.INITIAL
        self.flags: dict[str, bool] = {}

    def noop(self, *_: Any, **__: Any) -> None:
        return None


def _guard(name: str) -> Callable[[_Model], bool]:
    return lambda model: model.flags.get(name, False)


def _shared_machine(machine_class: Any = None) -> Any:
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _Model.noop for name in lifecycle.action_names() | {"record_outcome"}}
    if machine_class is None:
        return lifecycle.build_machine(guards, actions)
    return lifecycle.build_machine(guards, actions, machine_class=machine_class)


_TURN_PATH = ("render", "generate", "step", "observe", "generate", "step", "observe", "generate", "step", "observe")
"""A three-turn rollout's triggers (render, then generate/step/observe per turn, the last one ends it)."""


def _dict_table() -> dict[tuple[str, str], list[tuple[str | None, str]]]:
    table: dict[tuple[str, str], list[tuple[str | None, str]]] = {}
    for edge in lifecycle.TRANSITIONS:
        table.setdefault((edge.source, edge.trigger), []).append((edge.guard, edge.dest))
    return table


def _shared_transition_us(samples: int, machine_class: Any = None) -> float:
    """Microseconds per transition of ``samples`` three-turn paths through the shared machine."""
    events = _shared_machine(machine_class).events
    models = [_Model() for _ in range(samples)]
    enter = events[lifecycle.ENTER]
    start = time.perf_counter()
    for model in models:
        for trigger in _TURN_PATH:
            events[trigger].trigger(model, model)
            if getattr(model, "entering", None) is not None:  # an edge into a state with activities: the driver's ENTER
                enter.trigger(model, model)
    return (time.perf_counter() - start) / (samples * len(_TURN_PATH)) * 1e6


def machine_turn_cost(samples: int = 2_000) -> dict[str, float]:
    """The machine's cost per turn (for interleaving with the HTTP workloads, so both see the same machine)."""
    per_transition = _shared_transition_us(samples)
    return {"transition_us": per_transition, "cpu_us_per_turn": per_transition * len(_TURN_PATH) / SCALE_TURNS}


def bench_machine(samples: int = 2_000, repeats: int = 5) -> dict[str, float]:
    """Per-transition and per-sample costs of the machine variants (microseconds)."""
    from transitions import Machine
    from transitions.extensions.asyncio import AsyncMachine

    table = _dict_table()
    transitions_per_sample = len(_TURN_PATH)

    def run_shared(machine_class: Any = None) -> float:
        return _shared_transition_us(samples, machine_class)

    def run_dict() -> float:
        models = [_Model() for _ in range(samples)]
        start = time.perf_counter()
        for model in models:
            for trigger in _TURN_PATH:
                for guard, dest in table[(model.state, trigger)]:
                    if guard is None or model.flags.get(guard, False):
                        model.noop(model)
                        model.state = dest
                        break
        return (time.perf_counter() - start) / (samples * transitions_per_sample) * 1e6

    specs = [
        {"trigger": e.trigger, "source": e.source, "dest": e.dest, "conditions": [e.guard] if e.guard else []}
        for e in lifecycle.TRANSITIONS
    ]

    class Flagged(_Model):
        def __getattr__(self, name: str) -> Any:
            if name in lifecycle.guard_names():
                return lambda *_: self.flags.get(name, False)
            raise AttributeError(name)

    states = [state.name for state in lifecycle.STATES]

    def per_sample_machine() -> float:
        start = time.perf_counter()
        for _ in range(samples // 4):
            Machine(model=Flagged(), states=states, transitions=specs, initial="pending", auto_transitions=False)
        return (time.perf_counter() - start) / (samples // 4) * 1e6

    def shared_add_model() -> float:
        shared = Machine(model=None, states=states, transitions=specs, initial="pending", auto_transitions=False)
        models = [Flagged() for _ in range(samples)]
        start = time.perf_counter()
        for model in models:
            shared.add_model(model)
        return (time.perf_counter() - start) / samples * 1e6

    async_machine = AsyncMachine(
        model=None, states=states, transitions=specs, initial="pending", auto_transitions=False
    )

    async def async_transitions() -> float:
        models = [Flagged() for _ in range(samples // 10)]
        for model in models:
            async_machine.add_model(model)
        start = time.perf_counter()
        for model in models:
            for trigger in _TURN_PATH:
                await model.trigger(trigger)
        elapsed = time.perf_counter() - start
        for model in models:
            async_machine.remove_model(model)
        return elapsed / (len(models) * transitions_per_sample) * 1e6

    gc.collect()
    return {
        "shared_machine_transition_us": _best_of(repeats, run_shared),
        "plain_transitions_machine_transition_us": _best_of(repeats, lambda: run_shared(Machine)),
        "dict_table_transition_us": _best_of(repeats, run_dict),
        "async_machine_transition_us": _best_of(repeats, lambda: asyncio.run(async_transitions())),
        "per_sample_machine_setup_us": _best_of(repeats, per_sample_machine),
        "shared_add_model_setup_us_at_n": _best_of(1, shared_add_model),
        "shared_machine_setup_us": 0.0,
    }
