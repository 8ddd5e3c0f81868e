"""Internal: a runner's samples waiting for a concurrency slot: :class:`Waiting` holds one until its rollout is
made, and :class:`QueueNotingTracer` puts the wait on the rollout's first transition event (``queued_ms``, and
``staleness_ms`` when staleness pacing held it back)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from fsm_rollout.sample import Sample
from fsm_rollout.trace import Tracer


@dataclass(eq=False)
class Waiting:
    """A sample of a batch waiting for a concurrency slot; its rollout is made when it gets one, so that the
    ``pending`` dwell is the rollout's own work, not the wait."""

    sample: Sample
    sample_id: str | None
    seed: int | None
    since: float
    ended: Sample | None = None
    """The sample, once it ended without a slot (an abort)."""
    cancel_wait: Callable[[], object] | None = None
    """Ends its wait for adaptive admission or staleness pacing (it was ended meanwhile)."""
    group: Hashable = None
    """Its group in its batch (staleness pacing starts groups, not samples)."""
    opened: set[Hashable] | None = None
    """The groups of its batch that have started (shared by the batch's samples)."""
    staleness_ms: float | None = None
    """How long staleness pacing held it back (``staleness_ms`` on its first transition, apart from the queue)."""

    def waited_ms(self) -> float:
        return (time.perf_counter() - self.since) * 1000.0


class QueueNotingTracer(Tracer):
    """The runner's tracer as one rollout that waited for a slot sees it: the rollout's first transition event
    (the one leaving ``pending``) carries ``queued_ms``, the wait before the rollout was made."""

    def __init__(self, inner: Tracer, queued_ms: float, staleness_ms: float | None = None) -> None:
        super().__init__(None)
        self._inner = inner
        self._queued_ms: float | None = round(queued_ms, 3)
        self._staleness_ms = staleness_ms

    @property
    def enabled(self) -> bool:
        return self._inner.enabled

    def emit(self, fields: dict[str, Any]) -> None:
        if self._queued_ms is not None:
            fields["queued_ms"], self._queued_ms = self._queued_ms, None
            if self._staleness_ms is not None:  # the wait for staleness pacing, before the queue's
                fields["staleness_ms"] = self._staleness_ms
        self._inner.emit(fields)

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.flush()  # the runner's tracer is shared: closing it is the runner's business


__all__ = ["QueueNotingTracer", "Waiting"]
