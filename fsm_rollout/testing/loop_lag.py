"""Internal: what holds an event loop up, measured two ways, for tests and ``tools/loop_lag.py``.

* :class:`LoopTicker` ticks every 5 ms on the loop (as a trainer's heartbeat would) and notes each gap: its wall
  time (what the loop's other tasks feel; on a loaded machine it also holds the time the process was not
  scheduled) and the CPU time the loop's thread spent in it (only work done on the loop, whatever the load).
* :class:`NativeCallWatch` notes every native (C or Rust) call made while it is on, on the thread that installs it
  and on threads started meanwhile, whose *exclusive* CPU time (the Python code it called back subtracted) reaches a
  bound. A native call holds the GIL unless it lets it go, so a long one stalls every thread's Python, the loop's
  included, even when it runs in a worker thread (``tokenizers.Tokenizer.from_file`` does). Thread CPU time is not
  lengthened by other processes, so neither count depends on how loaded the machine is.

The watch installs profile functions (``sys.setprofile`` and ``threading.setprofile``) and puts back the ones it
found when it ends: only tests and tools use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

TICK_S = 0.005
"""The ticker's interval, as in the issue that measured the stall."""


@dataclass(frozen=True)
class LagSummary:
    """The gaps between ticks beyond the interval, in ms: ``p50``, ``p99``, ``max``; ``ticks`` counted over
    ``window_ms``; ``loop_cpu_max_ms``: the most CPU the loop's thread spent in one gap."""

    ticks: int
    window_ms: float
    p50: float
    p99: float
    max: float
    loop_cpu_max_ms: float

    def line(self) -> str:
        return (f"lag p50 {self.p50:.1f} ms, p99 {self.p99:.1f} ms, max {self.max:.1f} ms "
                f"({self.ticks} ticks in {self.window_ms:.0f} ms; loop thread CPU per gap at most "
                f"{self.loop_cpu_max_ms:.1f} ms)")  # fmt: skip


class LoopTicker:
    """``async with LoopTicker() as ticker:`` ticks every :data:`TICK_S` on the running loop until the block ends;
    then :meth:`summary` (the first tick happens on entering, so a block that holds the loop at once is seen)."""

    def __init__(self, interval_s: float = TICK_S) -> None:
        self.interval_s = interval_s
        self.gaps_s: list[float] = []
        """Wall time between consecutive ticks."""
        self.loop_cpu_s: list[float] = []
        """CPU time of the loop's thread between consecutive ticks."""
        self._task: asyncio.Task[None] | None = None
        self._window = (0.0, 0.0)

    async def __aenter__(self) -> LoopTicker:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)  # the first tick is taken before the block runs
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.sleep(self.interval_s)  # one more tick closes the gap the block's last step opened
        await asyncio.sleep(0)
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _tick(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self._window = (wall, wall)
        while True:
            await asyncio.sleep(self.interval_s)
            now, now_cpu = time.perf_counter(), time.thread_time()
            self.gaps_s.append(now - wall)
            self.loop_cpu_s.append(now_cpu - cpu)
            wall, cpu = now, now_cpu
            self._window = (self._window[0], now)

    def summary(self) -> LagSummary:
        lags = sorted(max(0.0, gap - self.interval_s) * 1000 for gap in self.gaps_s) or [0.0]
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        return LagSummary(
            ticks=len(self.gaps_s),
            window_ms=(self._window[1] - self._window[0]) * 1000,
            p50=statistics.median(lags),
            p99=p99,
            max=lags[-1],
            loop_cpu_max_ms=max(self.loop_cpu_s, default=0.0) * 1000,
        )


@dataclass(frozen=True)
class NativeCall:
    """A native call whose exclusive CPU time reached the watch's bound."""

    name: str
    thread: str
    cpu_ms: float

    def __str__(self) -> str:
        return f"{self.name} on {self.thread}: {self.cpu_ms:.0f} ms CPU"


@dataclass
class _Frame:
    native: str | None
    started: float
    children: float = 0.0


@dataclass
class NativeCallWatch:
    """``with NativeCallWatch(bound_ms=50) as watch:`` notes in ``watch.calls`` every native call whose exclusive
    CPU time reaches ``bound_ms``, on this thread and on threads started inside the block (see the module
    docstring)."""

    bound_ms: float = 50.0
    calls: list[NativeCall] = field(default_factory=list)
    native_calls: int = 0
    """Native calls seen, long or not: a watch that saw none was not installed where the work ran."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stacks: dict[int, list[_Frame]] = field(default_factory=dict)
    _previous: tuple[Any, Any] = (None, None)

    def __enter__(self) -> NativeCallWatch:
        self._previous = (sys.getprofile(), threading.getprofile())
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.setprofile(self._previous[0])
        threading.setprofile(self._previous[1])

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        now = time.thread_time()
        stack = self._stacks.setdefault(threading.get_ident(), [])
        if event == "call":
            stack.append(_Frame(None, now))
        elif event == "c_call":
            stack.append(_Frame(f"{getattr(arg, '__module__', None) or ''}.{getattr(arg, '__qualname__', arg)}", now))
        elif stack:  # a return: of a frame entered before the watch began, when the stack is empty
            done = stack.pop()
            spent = now - done.started
            if stack:
                stack[-1].children += spent
            if done.native is not None:
                self._ended(done.native, (spent - done.children) * 1000)

    def _ended(self, name: str, exclusive_ms: float) -> None:
        with self._lock:
            self.native_calls += 1
            if exclusive_ms >= self.bound_ms:
                self.calls.append(NativeCall(name.lstrip("."), threading.current_thread().name, exclusive_ms))


__all__ = ["TICK_S", "LagSummary", "LoopTicker", "NativeCall", "NativeCallWatch"]
