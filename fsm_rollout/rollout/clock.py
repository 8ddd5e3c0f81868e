"""A rollout's wall-clock limit (``rollout_timeout_s``): it runs while the rollout runs, not while it is suspended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class RolloutClock:
    """Calls ``expired()`` once the rollout has run ``limit_s`` seconds in all (None: never)."""

    def __init__(self, limit_s: float | None, expired: Callable[[], None]) -> None:
        self._time_left = limit_s
        self._expired = expired
        self._deadline: asyncio.TimerHandle | None = None
        self._started: float | None = None

    def start(self) -> None:
        """Run the clock (from the running loop); starting a running clock does nothing."""
        if self._time_left is None or self._deadline is not None:
            return
        self._started = time.perf_counter()
        self._deadline = asyncio.get_running_loop().call_later(max(self._time_left, 0.0), self._expired)

    def stop(self) -> None:
        """Stop the clock, keeping the time left for the next start."""
        if self._deadline is None:
            return
        self._deadline.cancel()
        self._deadline = None
        if self._time_left is not None and self._started is not None:
            self._time_left -= time.perf_counter() - self._started


__all__ = ["RolloutClock"]
