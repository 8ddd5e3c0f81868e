"""Internal: pacing, how much rollout work one event-loop iteration may run, so thousands of samples share a
loop smoothly.

asyncio runs every callback that is ready in one loop iteration. When 10,000 samples' answers arrive together,
every one of them would process its turn (parse, decode, step the environment, encode the observation, send the
next request) in the same iteration: seconds during which no timer fires, no heartbeat is answered, and no new
request leaves. It also sends 10,000 requests at once, which overflows a server's accept backlog (the kernel drops
the SYNs, and TCP retries them a second or more later).

Pacing is off unless a rollout's config asks for it (``RolloutConfig.loop_slice_ms``; ``fsm-rollout run`` does).
A :class:`LoopPacer` (one per event loop and slice) admits rollouts to their next piece of CPU work a few at a time: a
rollout asks for admission before it starts and after each engine answer. When the iteration's allowance is used
up, the rollout waits its turn (first come, first served) and is admitted in a later iteration. The allowance
adapts: each iteration is timed, and the number of admissions per iteration shrinks (never below
:data:`MIN_LIMIT`) when an iteration runs longer than the target slice and grows while it stays under it. The work
is the same, only spread out; what changes is that the loop stays responsive and requests leave steadily.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque

DEFAULT_SLICE_MS = 5.0
"""Target duration of one loop iteration (milliseconds)."""

MIN_LIMIT = 4
"""Admissions per iteration the pacer always allows, however long iterations run: a loop kept busy by other work
slows the rollouts down but cannot stop them."""


class LoopPacer:
    """Admits rollouts to CPU work on one event loop: at most ``limit`` per loop iteration, with ``limit`` adapted so
    that an iteration takes about ``slice_s``.

    Waiters are admitted in batches: a tick wakes up to ``limit`` of them, and they run one after another early in
    the next iteration, followed by the next tick, which so times the whole iteration the batch ran in. The
    allowance shrinks (not below :data:`MIN_LIMIT`) when an iteration overran the slice, and grows when the
    allowance was used and the iteration stayed within it. The whole iteration is what counts, not only the admitted
    work: what a rollout does after its admitted step (sending its next request, reading the answer) runs in later
    callbacks the pacer does not see one by one, and the loop's responsiveness is the point.
    """

    __slots__ = (
        "__weakref__",
        "_batch",
        "_granted",
        "_last_tick",
        "_loop",
        "_tick_pending",
        "_waiters",
        "admitted",
        "limit",
        "slice_s",
        "waited",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, slice_ms: float = DEFAULT_SLICE_MS) -> None:
        self._loop = weakref.ref(loop)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._granted = 0
        self._batch = 0
        self._last_tick = 0.0
        self._tick_pending = False
        self.limit = 4
        """Admissions allowed per loop iteration (adapted)."""
        self.slice_s = slice_ms / 1000.0
        self.waited = 0
        """How many admissions had to wait for a later iteration."""
        self.admitted = 0
        """How many admissions were asked for in all."""

    def admit(self) -> asyncio.Future[None] | None:
        """``None`` when the caller may go on now, else a future to await (resolved in a later iteration)."""
        self.admitted += 1
        if self._granted < self.limit and not self._waiters:
            self._granted += 1
            self._arm()
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.waited += 1
        self._arm()
        return waiter

    def _arm(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """Runs once per iteration while there is work: adapt the allowance, then wake the next batch."""
        now = time.perf_counter()
        self._tick_pending = False
        if self._batch:  # the batch woken by the previous tick has run, and the iteration it ran in
            iteration = now - self._last_tick
            if iteration > self.slice_s:
                self.limit = max(MIN_LIMIT, self.limit * 3 // 4)
            elif self._batch >= self.limit:  # the allowance was used and the iteration stayed short: allow more
                self.limit += max(1, self.limit // 8)
        self._last_tick = now
        self._granted = self._batch = 0
        waiters = self._waiters
        if waiters:
            while waiters and self._batch < self.limit:
                waiter = waiters.popleft()
                if waiter.done():  # its rollout was cancelled while waiting
                    continue
                waiter.set_result(None)  # schedules the rollout's next step, before the next tick
                self._batch += 1
            self._granted = self._batch
        if self._granted or waiters:
            self._arm()  # the next tick runs just after the woken rollouts


_PACERS: weakref.WeakValueDictionary[tuple[int, float], LoopPacer] = weakref.WeakValueDictionary()
"""Pacers by ``(id(loop), slice_ms)``. Held weakly: the rollouts using a pacer (and, while it has waiters, its
scheduled tick on the loop) keep it alive, so a loop that is closed and dropped with rollouts still waiting is
collected with them (their ``finally`` blocks run), instead of a registry keeping the loop, its tasks and their
rollouts forever."""


def pacer_for(loop: asyncio.AbstractEventLoop, slice_ms: float = DEFAULT_SLICE_MS) -> LoopPacer:
    """The pacer of ``loop`` for ``slice_ms`` (created on first use).

    Rollouts that ask for the same slice on one loop share a pacer; a rollout asking for another slice gets a pacer
    of its own, so no rollout changes the pacing others asked for.
    """
    key = (id(loop), float(slice_ms))
    pacer = _PACERS.get(key)
    if pacer is None or pacer._loop() is not loop:
        pacer = LoopPacer(loop, slice_ms)
        _PACERS[key] = pacer
    return pacer
