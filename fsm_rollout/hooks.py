"""Observers of a rollout: one hooks object passed to :class:`~fsm_rollout.rollout.Rollout`.

The rollout calls its hooks after every transition and when a caller asks it to abort; hooks observe, they never
change the rollout. They see it through a :class:`RolloutView`: its state, reason, turn, sample and ids, read-only.
The runner's metrics and the recorder (:mod:`fsm_rollout.recording`) are hooks; several are combined with
:func:`combine_hooks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fsm_rollout.sample import Sample
from fsm_rollout.types import GeneratedTurn


class RolloutView(Protocol):
    """What hooks see of a rollout (read-only)."""

    @property
    def state(self) -> str:
        """The lifecycle state (after the transition, in :meth:`RolloutHooks.transition`)."""

    @property
    def reason(self) -> str | None:
        """The terminal state's reason (None before the rollout ended)."""

    @property
    def turn_index(self) -> int:
        """The turn in progress, from 0."""

    @property
    def turn(self) -> GeneratedTurn | None:
        """The last turn generated."""

    @property
    def prompt_length(self) -> int | None:
        """The prompt's token count, once rendered."""

    @property
    def suspensions(self) -> int:
        """How often the rollout was suspended for a weight update."""

    @property
    def sample(self) -> Sample:
        """The sample (the rollout mutates it; hooks must not)."""

    @property
    def sample_id(self) -> str:
        """How traces, tapes and errors name the sample."""

    @property
    def rollout_uid(self) -> str:
        """Unique to this rollout."""

    @property
    def request_prefix(self) -> str:
        """Generate request ids are ``<request_prefix>-turn<N>``."""


class RolloutHooks:
    """Called by a rollout as it runs; every method does nothing unless overridden.

    ``wants_events``: whether :meth:`transition` needs the transition event's fields (the same fields the trace
    writes, built only when a tracer or a hook wants them); without it ``fields`` is None. ``records_io``:
    whether these hooks belong to a recording of the rollout's engine and environment I/O (a rollout whose config
    asks to ``record`` refuses to run without one).
    """

    wants_events: bool = False
    records_io: bool = False

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        """After the rollout moved from ``src`` by ``trigger`` (``rollout.state`` is the new state)."""

    def abort_requested(self, rollout: RolloutView, reason: str, *, running: bool, in_flight: bool) -> None:
        """A caller asked the rollout to abort (``in_flight``: an engine request was pending), before it acts."""


class _CombinedHooks(RolloutHooks):
    def __init__(self, hooks: tuple[RolloutHooks, ...]) -> None:
        self._hooks = hooks
        self.wants_events = any(hook.wants_events for hook in hooks)
        self.records_io = any(hook.records_io for hook in hooks)

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        for hook in self._hooks:
            hook.transition(rollout, trigger, src, dwell_ms, fields if hook.wants_events else None)

    def abort_requested(self, rollout: RolloutView, reason: str, *, running: bool, in_flight: bool) -> None:
        for hook in self._hooks:
            hook.abort_requested(rollout, reason, running=running, in_flight=in_flight)


def combine_hooks(*hooks: RolloutHooks | None) -> RolloutHooks | None:
    """One hooks object calling each given one in order (None entries are left out; None when none is left)."""
    present = tuple(hook for hook in hooks if hook is not None)
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return _CombinedHooks(present)


__all__ = ["RolloutHooks", "RolloutView", "combine_hooks"]
