"""Internal: a lean ``transitions.Machine`` for the lifecycle, fenced to the ``transitions`` versions it was
checked against.

The classes here replace a few methods of ``transitions.core`` with copies that skip the library's per-step debug
and info logging, the calls for empty callback lists and the name resolution of callbacks. Being copies of private
internals, they are only right for the upstream code they were copied from: :data:`VERIFIED_SOURCES` records, per
``transitions`` version, a sha256 of ``inspect.getsource`` of every upstream method they replace or inline.
:func:`machine_class` hands out :class:`LifecycleMachine` only when the installed ``transitions`` matches a recorded
entry, and otherwise the plain ``transitions.Machine`` (with one warning per process), so an upgrade can make the
machine slower but never wrong. ``tests/unit/test_lean_machine.py`` fails on any mismatch, so an upgrade forces a
review of the copies (and a new entry here).

The lean machine supports only the configuration :func:`fsm_rollout.machine.lifecycle.build_machine` uses: no models
attached (each trigger is called as ``machine.events[name].trigger(model, *args)``), ``send_event=False``, no
queue, and callables (never names) for every guard and callback. Anything else is refused when the machine is
built or a state or transition is added.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import transitions
from transitions import Machine, State, Transition
from transitions.core import Condition, Event, EventData

_LOGGER = logging.getLogger("transitions.core")


def _upstream_methods() -> dict[str, Callable[..., Any]]:
    """The upstream methods the lean classes replace, and the ones whose steps they inline."""
    return {
        "State.enter": State.enter,
        "State.exit": State.exit,
        "Condition.check": Condition.check,
        "Transition.execute": Transition.execute,
        "Transition._eval_conditions": Transition._eval_conditions,
        "Transition._change_state": Transition._change_state,
        "EventData.__init__": EventData.__init__,
        "EventData.update": EventData.update,
        "Event.trigger": Event.trigger,
        "Event._trigger": Event._trigger,
        "Event._process": Event._process,
        "Machine.callbacks": Machine.callbacks,
        "Machine.callback": Machine.callback,
        "Machine.resolve_callable": Machine.resolve_callable,
        "Machine.set_state": Machine.set_state,
        "Machine._process": Machine._process,
    }


VERIFIED_SOURCES: Mapping[str, Mapping[str, str]] = {
    "0.9.3": {
        "State.enter": "f958fc2a58903fea2b63dcf62f3dcda00e74b146e1f545074577b95f48b22f5c",
        "State.exit": "7108c280f25ef0cdfcc685b17ec541f3aac1f5a9080f5c05076d8e2ae84dc518",
        "Condition.check": "d4836e7dc51368cdeafa304189feb6e473b7eaace6762fd8ddf48c87a83c088b",
        "Transition.execute": "2225f965ea3ebc159b6fd5f380781d4a0feafbc06319ae4a42d5ce3477b5708d",
        "Transition._eval_conditions": "a080bc100badac03e73001dcf6ff218f29128faf1cc0ee39de09ee4ef24439e7",
        "Transition._change_state": "0b6bc5ccb4f7fe9db6d357a802feb44917965cb816c3a94a290593e4950a054c",
        "EventData.__init__": "465efa466f3326d985e166f132f887bd934103ce92a4561c75d314c6f11972e3",
        "EventData.update": "ab53968b127382f50905c1d591543a52e5fe2543d64a84f2b5fd13bc5ae72c8e",
        "Event.trigger": "b911622c72e692aa6a8f61883c76b897c47d988550db070017a4c15340ff5c0b",
        "Event._trigger": "cf5b1392cd80d8ef27a8d62ce227a902cd5fb10f1de586758b5061b24c6d2410",
        "Event._process": "a5f7d766fbff30bae47d4e79b848b6fb693b09db9d9f875223688463035c171f",
        "Machine.callbacks": "412ca812ca6137dfd695f18fb8758bdafc47dc1f147dd17531927e0856cf4461",
        "Machine.callback": "7118b3a089661502a7f72f16e8e98c10785589841295c683b7ef9d27641f0bb9",
        "Machine.resolve_callable": "ff0aec35de9eb44f0a16a310e7275be854d4204cdf532431d7d13550f953c0c2",
        "Machine.set_state": "6733f950cb5be767d491876cb9bed309e7dd539684f82901e416d8620d667389",
        "Machine._process": "3770446a0eec0643f913b096d86bacedc3aa02635cf2d0e711b59192395a1f33",
    },
}
"""``transitions`` version -> upstream method -> sha256 of its source, for the versions the lean copies match."""


def upstream_source_sha256() -> dict[str, str]:
    """sha256 of the source of each replaced or inlined upstream method, as installed now."""
    return {name: _source_sha256(method) for name, method in _upstream_methods().items()}


@functools.lru_cache(maxsize=64)  # keyed by the function object, so a replaced method is hashed anew
def _source_sha256(method: Callable[..., Any]) -> str:
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):  # no source shipped: nothing can be verified
        source = ""
    return hashlib.sha256(source.encode()).hexdigest()


def is_verified() -> bool:
    """Whether the installed ``transitions`` is a recorded version whose replaced methods are unchanged."""
    recorded = VERIFIED_SOURCES.get(transitions.__version__)
    return recorded is not None and dict(recorded) == upstream_source_sha256()


class LeanMachineFallbackWarning(RuntimeWarning):
    """The installed ``transitions`` is not one the lean machine was verified against; the plain one is used."""


_fallback_warned = False


def machine_class() -> type[Machine]:
    """:class:`LifecycleMachine` when :func:`is_verified`, else ``transitions.Machine`` (warning once)."""
    global _fallback_warned
    if is_verified():
        return LifecycleMachine
    if not _fallback_warned:
        _fallback_warned = True
        verified = ", ".join(sorted(VERIFIED_SOURCES)) or "none"
        warnings.warn(
            f"transitions {transitions.__version__} is not a version the lean lifecycle machine was verified "
            f"against (verified: {verified}); using the plain transitions.Machine, which behaves the same but "
            "costs more per transition. Update fsm_rollout.machine.lean_machine.VERIFIED_SOURCES after reviewing the "
            "copied methods against the new release.",
            LeanMachineFallbackWarning,
            stacklevel=2,
        )
    return Machine


def _require_callables(where: str, funcs: Iterable[Any]) -> None:
    for func in funcs:
        if not callable(func):
            raise TypeError(
                f"LifecycleMachine takes callables only, got {func!r} in {where} "
                "(use transitions.Machine for callbacks named by string)"
            )


class LeanState(State):
    """A state whose enter/exit run its callbacks without the library's logging, and nothing when it has none."""

    def enter(self, event_data: EventData) -> None:
        if self.on_enter:
            event_data.machine.callbacks(self.on_enter, event_data)

    def exit(self, event_data: EventData) -> None:
        if self.on_exit:
            event_data.machine.callbacks(self.on_exit, event_data)


class LeanCondition(Condition):
    """A condition that calls its guard with the trigger's arguments (guards are callables here)."""

    func: Callable[..., Any]  # never a name here (the machine refuses names)

    def check(self, event_data: EventData) -> bool:
        return bool(self.func(*event_data.args, **event_data.kwargs) == self.target)


class LeanTransition(Transition):
    """A transition with the library's steps, minus its per-step debug logging and the calls for empty lists.

    ``execute``: prepare callbacks, conditions in order (the first that fails ends the attempt), the machine's
    and then the transition's ``before`` callbacks, the state change, the transition's and then the machine's
    ``after`` callbacks. ``_change_state``: exit the source, set the model's state, enter the destination, and the
    machine's ``on_final`` callbacks when the destination is final.
    """

    condition_cls = LeanCondition

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        if self.prepare:
            machine.callbacks(self.prepare, event_data)
        for condition in self.conditions:
            if not condition.check(event_data):
                return False
        if machine.before_state_change:
            machine.callbacks(machine.before_state_change, event_data)
        machine.callbacks(self.before, event_data)
        if self.dest:
            self._change_state(event_data)
        machine.callbacks(self.after, event_data)
        if machine.after_state_change:
            machine.callbacks(machine.after_state_change, event_data)
        return True

    def _change_state(self, event_data: EventData) -> None:
        machine = event_data.machine
        machine.get_state(self.source).exit(event_data)
        assert self.dest is not None  # called only for transitions that change state
        dest = machine.get_state(self.dest)
        setattr(event_data.model, machine.model_attribute, dest.value)  # Machine.set_state for one model
        event_data.state = dest
        dest.enter(event_data)
        if dest.final and machine.on_final:
            machine.callbacks(machine.on_final, event_data)


class LeanEvent(Event):
    """An event that runs its transitions directly (the machine has no queue, so ``Machine._process`` would only
    call them) and skips empty ``prepare_event``/``finalize_event`` lists."""

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        return self._trigger(EventData(None, self, self.machine, model, args=args, kwargs=kwargs))

    def _trigger(self, event_data: EventData) -> bool:
        machine = self.machine
        event_data.state = machine.get_model_state(event_data.model)
        try:
            if self._is_valid_source(event_data.state):
                self._process(event_data)
        except BaseException as error:
            event_data.error = error  # type: ignore[assignment]  # transitions stores any BaseException
            if not machine.on_exception:
                raise
            machine.callbacks(machine.on_exception, event_data)
        finally:
            if machine.finalize_event:
                try:
                    machine.callbacks(machine.finalize_event, event_data)
                except BaseException as error:  # like transitions: logged, not raised
                    _LOGGER.error(
                        "%sWhile executing finalize callbacks a %s occurred: %s.",
                        machine.name,
                        type(error).__name__,
                        error,
                    )
        return bool(event_data.result)

    def _process(self, event_data: EventData) -> bool:
        machine = self.machine
        if machine.prepare_event:
            machine.callbacks(machine.prepare_event, event_data)
        for transition in self.transitions[event_data.state.name]:
            event_data.transition = transition
            if transition.execute(event_data):
                event_data.result = True
                break
        return bool(event_data.result)


_HOOKS = ("prepare_event", "before_state_change", "after_state_change", "finalize_event", "on_exception", "on_final")


class LifecycleMachine(Machine):
    """``transitions.Machine`` with the lean state, transition, condition and event classes above.

    Behaves like the library's (a test walks both at random side by side and compares every state, callback,
    result and error, with every kind of machine-, state- and transition-level callback); what is gone is
    ``transitions``' own logging of each step (the structlog trace records every transition instead), the calls
    for empty callback lists and callback name resolution. Built with keywords only; ``model``, ``send_event`` and
    ``queued`` accept only their defaults here. Hooks assigned after construction are not checked: a name there
    fails with ``TypeError`` when it would be called.
    """

    state_cls = LeanState
    transition_cls = LeanTransition
    event_cls = LeanEvent

    def __init__(self, *, model: Any = None, send_event: bool = False, queued: bool = False, **kwargs: Any) -> None:
        if model is not None:
            raise ValueError("LifecycleMachine holds no models: pass the model to machine.events[name].trigger")
        if send_event:
            raise ValueError(
                "LifecycleMachine calls guards and callbacks with the trigger's arguments: "
                "send_event=True needs transitions.Machine"
            )
        if queued:
            raise ValueError("LifecycleMachine runs each trigger directly: queued=True needs transitions.Machine")
        super().__init__(model=None, send_event=False, queued=False, **kwargs)
        for hook in _HOOKS:
            _require_callables(hook, getattr(self, hook))

    def add_model(self, model: Any, initial: Any = None) -> None:
        raise ValueError("LifecycleMachine holds no models: pass the model to machine.events[name].trigger")

    def add_states(
        self,
        states: Any,
        on_enter: Any = None,
        on_exit: Any = None,
        ignore_invalid_triggers: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().add_states(
            states, on_enter=on_enter, on_exit=on_exit, ignore_invalid_triggers=ignore_invalid_triggers, **kwargs
        )
        for state in self.states.values():
            _require_callables(f"state {state.name!r}", [*state.on_enter, *state.on_exit])

    @classmethod
    def _create_transition(cls, *args: Any, **kwargs: Any) -> Transition:
        transition = super()._create_transition(*args, **kwargs)
        where = f"transition {transition.source!r} -> {transition.dest!r}"
        _require_callables(where, [*transition.prepare, *transition.before, *transition.after])
        _require_callables(where, [condition.func for condition in transition.conditions])
        return transition

    def callbacks(self, funcs: Iterable[Any], event_data: EventData) -> None:
        args, kwargs = event_data.args, event_data.kwargs
        for func in funcs:
            func(*args, **kwargs)
