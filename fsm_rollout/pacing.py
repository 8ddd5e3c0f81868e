"""Pacing: how much rollout work one event-loop iteration may run, so thousands of samples share a loop smoothly.

asyncio runs every callback that is ready in one loop iteration. When 10,000 samples' answers arrive together,
every one of them would process its turn (parse, decode, step the environment, encode the observation, send the
next request) in the same iteration: seconds during which no timer fires, no heartbeat is answered, and no new
request leaves. It also sends 10,000 requests at once, which overflows a server's accept backlog (the kernel drops
the SYNs, and TCP retries them a second or more later).

A :class:`LoopPacer` (one per event loop) admits rollouts to their next piece of CPU work a few at a time: a
rollout calls ``await pacer.admit(...)`` before each piece of work that follows I/O. When the iteration's allowance
is used up, the rollout waits its turn (first come, first served) and is admitted in a later iteration. The
allowance adapts: each iteration's duration is measured, and the number of admissions per iteration shrinks when
iterations run longer than the target slice and grows while they stay under it. Throughput is unchanged (the work
is the same, only spread out); what changes is that the loop stays responsive and requests leave steadily.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque

DEFAULT_SLICE_MS = 5.0
"""Target duration of one loop iteration's admitted work (milliseconds)."""


class LoopPacer:
    """Admits rollouts to CPU work on one event loop, at most ``limit`` per loop iteration (adapted to the slice)."""

    __slots__ = ("_granted", "_mark", "_tick_pending", "_waiters", "admitted", "limit", "slice_s", "waited")

    def __init__(self, slice_ms: float = DEFAULT_SLICE_MS) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._granted = 0
        self._tick_pending = False
        self._mark = 0.0
        self.limit = 4
        """Admissions allowed in the current loop iteration (adapted)."""
        self.slice_s = slice_ms / 1000.0
        self.waited = 0
        """How many admissions had to wait for a later iteration."""
        self.admitted = 0
        """How many admissions were granted in all."""

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
            self._mark = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """Runs once per iteration while there is work: adapt the allowance, then admit the next waiters."""
        self._tick_pending = False
        elapsed = time.perf_counter() - self._mark
        if elapsed > self.slice_s:
            self.limit = max(1, self.limit * 3 // 4)
        elif self._granted >= self.limit:  # the allowance was used and the iteration stayed short: allow more
            self.limit += max(1, self.limit // 8)
        self._granted = 0
        waiters = self._waiters
        while waiters and self._granted < self.limit:
            waiter = waiters.popleft()
            if waiter.done():  # its rollout was cancelled while waiting
                continue
            waiter.set_result(None)
            self._granted += 1
        if self._granted or waiters:
            self._arm()


_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPacer] = weakref.WeakKeyDictionary()


def pacer_for(loop: asyncio.AbstractEventLoop, slice_ms: float = DEFAULT_SLICE_MS) -> LoopPacer:
    """The pacer of ``loop`` (created on first use); ``slice_ms`` updates its target slice."""
    pacer = _PACERS.get(loop)
    if pacer is None:
        pacer = _PACERS[loop] = LoopPacer(slice_ms)
    else:
        pacer.slice_s = slice_ms / 1000.0
    return pacer
