"""One cancel scope for every await of a rollout: engine requests, environment calls and the weight-update gate.

A rollout stops for one of two causes, kept apart: an **abort** (a caller's ``request_abort(reason)``; the edge
``abort`` takes its reason) or a **timeout** (``env_timeout`` or ``rollout_timeout``; the edges of those names).
The first cause wins; a later one is ignored. Either cancels the await in flight, and :meth:`CancelScope.run`
then raises :class:`Stopped`; the driver fires :attr:`CancelScope.trigger`.

An environment call that runs past its own limit raises :class:`TimedOut` instead (the driver records the limit and
sets the timeout cause). A thread cannot be stopped: a cut-off call in the worker pool is waited for and its
result discarded.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

from fsm_rollout.runtime.pacing import LoopPacer

T = TypeVar("T")


class Stopped(Exception):
    """Internal: an abort or a timeout cut off the await (or came before it started)."""


class TimedOut(Exception):
    """Internal: one environment call ran past ``env_step_timeout_s``."""

    def __init__(self, what: str, limit_s: float) -> None:
        super().__init__(f"{what} ran past {limit_s} s")
        self.what = what
        self.limit_s = limit_s


class CancelScope:
    """The rollout's one await in flight and why it may be cut off."""

    def __init__(self) -> None:
        self.abort_reason: str | None = None
        """The caller's reason, once an abort was asked for (and no timeout came first)."""
        self.timeout: str | None = None
        """``env_timeout`` or ``rollout_timeout``, once a limit ran out (and no abort came first)."""
        self.inflight: asyncio.Future[Any] | None = None
        self.cancelled_request_id: str | None = None
        """The engine request an abort or timeout cut off: the driver names it to the server's abort endpoint."""
        self.pacer: LoopPacer | None = None

    @property
    def stopping(self) -> bool:
        return self.abort_reason is not None or self.timeout is not None

    @property
    def trigger(self) -> str | None:
        """The trigger the stop fires (None: no stop asked for)."""
        if self.timeout is not None:
            return self.timeout
        return "abort" if self.abort_reason is not None else None

    def abort(self, reason: str) -> bool:
        """Stop with ``reason``; False when a stop was already asked for."""
        if self.stopping:
            return False
        self.abort_reason = reason
        self._cut()
        return True

    def time_out(self, trigger: str) -> bool:
        """Stop by the timeout ``trigger``; False when a stop was already asked for."""
        if self.stopping:
            return False
        self.timeout = trigger
        self._cut()
        return True

    def _cut(self) -> None:
        if self.inflight is not None:
            self.inflight.cancel()

    async def paced(self) -> None:
        """Wait for this loop iteration's share of CPU work, when pacing is on (:mod:`fsm_rollout.runtime.pacing`)."""
        if self.pacer is not None:
            waiter = self.pacer.admit()
            if waiter is not None:
                await waiter

    async def run(
        self,
        awaitable: Awaitable[T],
        *,
        request_id: str | None = None,
        limit: float | None = None,
        what: str = "",
        thread: Any = None,
        discard_late: bool = True,
    ) -> T:
        """Await ``awaitable`` so that a stop cuts it off (raising :class:`Stopped`).

        ``request_id``: the engine request it sends (named to the server when cut off). ``limit``: seconds before
        :class:`TimedOut` (``what`` names the call). ``thread``: the worker-pool future behind it, waited for when it
        is cut off. ``discard_late``: a stop asked for while the answer is paced discards the answer (engine
        answers; an environment call's result stands, the driver stops before the next activity).
        A cancellation of the calling task itself propagates.
        """
        if self.stopping:  # never start anything once a stop was asked for
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise Stopped
        task: asyncio.Future[T] = asyncio.ensure_future(awaitable)
        self.inflight = task
        try:
            try:
                result = await (task if limit is None else asyncio.wait_for(task, limit))
            except TimeoutError:
                if limit is None:  # the call's own timeout (an engine client's), not this scope's
                    raise
                if thread is not None:  # a thread cannot be stopped: wait for it, then discard its result
                    await _thread_done(thread)
                if self.stopping:
                    raise Stopped from None
                raise TimedOut(what, limit or 0.0) from None
            except asyncio.CancelledError:
                if thread is not None:
                    await _thread_done(thread)
                if request_id is not None:
                    self.cancelled_request_id = request_id
                current = asyncio.current_task()
                if (current is not None and current.cancelling()) or not self.stopping:
                    raise
                raise Stopped from None
            # The answer is in; wait for this loop iteration's share of CPU work. The call still counts as in flight,
            # so a stop asked for meanwhile is one "just after its answer" (and replays as such).
            await self.paced()
        finally:
            self.inflight = None
        if discard_late and self.stopping:
            raise Stopped
        return result

    def take_cancelled_request(self) -> str | None:
        request_id, self.cancelled_request_id = self.cancelled_request_id, None
        return request_id


async def _thread_done(future: Any) -> None:
    """Wait for a worker-pool call to finish, whatever it returns or raises."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def settle(_: Any) -> None:
        loop.call_soon_threadsafe(finish)

    future.add_done_callback(settle)
    await asyncio.shield(done)


__all__ = ["CancelScope", "Stopped", "TimedOut"]
