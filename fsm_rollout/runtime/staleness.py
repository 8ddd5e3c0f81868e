"""Internal: staleness pacing (``RolloutConfig.max_staleness``): no group of a runner's batch, group or stream
starts more than ``max_staleness`` weight versions ahead of what the trainer has consumed.

The trainer reports what it has consumed with :meth:`RolloutRunner.consumed(version)
<fsm_rollout.runtime.runner.RolloutRunner.consumed>`: the newest weight version whose samples it has taken into
training. A group starts under the runner's current weight version (the one ``weight_update(version=...)`` last
set; 0 before any); it may start while ``current - consumed <= max_staleness``, and waits
otherwise, until ``consumed`` advances. Versions are read as integers. Before the first report, the version current
when the first group asked counts as consumed. Nothing finished is ever dropped for staleness, and a group that has
started is never held up again: its other members start with it.

Every wait is traced: a ``staleness_wait`` event (the group, the versions, the milliseconds), and ``staleness_ms``
on the first transition of each sample it held up (apart from ``queued_ms``), which ``inspect`` and the report show.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable

from fsm_rollout.errors import ConfigError
from fsm_rollout.trace import Tracer

STALENESS_WAIT_EVENT = "staleness_wait"


def version_number(version: object, what: str) -> int:
    """A weight version as the integer staleness is counted in."""
    if isinstance(version, bool):
        raise ConfigError(f"{what} must be an integer weight version, got {version!r}")
    try:
        return int(str(version))
    except ValueError:
        raise ConfigError(
            f"{what} must be an integer weight version (max_staleness counts versions), got {version!r}"
        ) from None


class StalenessGate:
    """Holds new groups back while the weights are more than ``max_staleness`` versions ahead of what the trainer
    has consumed (module docstring); ``max_staleness=None`` holds nothing back."""

    def __init__(
        self, max_staleness: int | None, current: Callable[[], str | None], tracer: Callable[[], Tracer]
    ) -> None:
        self.max_staleness = max_staleness
        self._current = current
        self._tracer = tracer
        self.consumed_version: int | None = None
        self._advanced = asyncio.Event()
        self.waits = 0
        """How many groups had to wait."""
        self.waiting = 0
        """Samples waiting now."""
        self.held = asyncio.Event()
        """Set once a group has had to wait (a test or a dashboard waits on it instead of polling)."""

    @property
    def limited(self) -> bool:
        return self.max_staleness is not None

    def current_version(self) -> int:
        version = self._current()
        return 0 if version is None else version_number(version, "the runner's weight version")

    def consumed(self, version: int | str) -> None:
        """The trainer has consumed the samples of weight version ``version`` (and older): groups held back wake."""
        number = version_number(version, "consumed(version)")
        if self.consumed_version is None or number > self.consumed_version:
            self.consumed_version = number
            self._advanced.set()
            self._advanced = asyncio.Event()

    def ahead(self) -> int:
        """How many weight versions the current one is ahead of what was consumed."""
        current = self.current_version()
        if self.consumed_version is None:
            self.consumed_version = current
        return current - self.consumed_version

    async def admit(self, opened: set[Hashable], group: Hashable) -> float | None:
        """Wait until ``group`` may start (at once when it has, or nothing is held back); the milliseconds waited,
        None when it did not wait."""
        limit = self.max_staleness
        if limit is None or group in opened or self.ahead() <= limit:
            opened.add(group)
            return None
        started = time.perf_counter()
        ahead_at_start = self.ahead()
        self.waits += 1
        self.waiting += 1
        self.held.set()
        try:
            while group not in opened and self.ahead() > limit:
                await self._advanced.wait()
        finally:
            self.waiting -= 1
        waited = round((time.perf_counter() - started) * 1000.0, 3)
        if group not in opened:  # the first member to pass traces the group's wait
            opened.add(group)
            self._tracer().other_event(
                STALENESS_WAIT_EVENT,
                {"group": str(group), "waited_ms": waited, "weight_version": self.current_version(),
                 "consumed_version": self.consumed_version, "ahead": ahead_at_start, "max_staleness": limit},
            )  # fmt: skip
        return waited


__all__ = ["STALENESS_WAIT_EVENT", "StalenessGate", "version_number"]
