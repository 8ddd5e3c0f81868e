"""A handle on a running rollout: what :meth:`fsm_rollout.RolloutRunner.start` returns.

The handle is the public face of one rollout in flight: its lifecycle ``state``, its ``sample`` (mutated in place
as the rollout runs), the last turn the model generated, a way to ask it to stop (:meth:`RolloutHandle.abort`),
and the finished sample (``await handle``; :meth:`RolloutHandle.add_done_callback`). It holds the runner's task,
so the rollout runs whether or not anyone awaits it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from fsm_rollout.envs.step import Turn
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout.driver import Rollout
from fsm_rollout.sample import Sample

__all__ = ["RolloutHandle"]


class RolloutHandle:
    """One rollout started by :meth:`fsm_rollout.RolloutRunner.start`."""

    def __init__(self, rollout: Rollout, task: asyncio.Future[Sample]) -> None:
        self._rollout = rollout
        self._task = task

    @property
    def state(self) -> str:
        """The lifecycle state (``pending`` ... ``completed``, ``truncated``, ``aborted``, ``failed``)."""
        state: str = self._rollout.state
        return state

    @property
    def sample(self) -> Sample:
        """The sample, as the rollout has it so far (its outcome once the rollout has ended)."""
        return self._rollout.sample

    @property
    def sample_id(self) -> str:
        """How traces, tapes and errors name the sample."""
        name: str = self._rollout.sample_id
        return name

    @property
    def terminal(self) -> bool:
        """Whether the rollout has reached a terminal state."""
        return self._rollout.state in lifecycle.TERMINAL

    @property
    def turn_index(self) -> int:
        """The index of the turn in progress (0 for the first)."""
        index: int = self._rollout.turn_index
        return index

    @property
    def last_turn(self) -> Turn | None:
        """The last turn generated, as an environment that accepts turns is given it (None before the first)."""
        return self._rollout.ctx.last_turn

    def abort(self, reason: str = "cancelled") -> None:
        """Ask the rollout to end ``aborted`` with ``reason`` (the engine request in flight is cancelled); ``await``
        the handle to wait until it has. A rollout that has ended is left as it is."""
        self._rollout.request_abort(reason)

    def done(self) -> bool:
        """Whether the rollout's task has finished (the sample is final)."""
        return self._task.done()

    def add_done_callback(self, callback: Callable[[RolloutHandle], Any]) -> None:
        """Call ``callback(handle)`` once the rollout's task has finished (at once, soon, when it has)."""
        self._task.add_done_callback(lambda _task: callback(self))

    def __await__(self) -> Generator[Any, None, Sample]:
        return self._task.__await__()
