"""RolloutService: the surface a trainer programs against, so that one process and many are interchangeable.

:class:`~fsm_rollout.runtime.runner.RolloutRunner` (rollouts on this event loop) and
:class:`~fsm_rollout.distributed.RayRolloutPool` (rollouts on Ray workers, each hosting a runner) both have it, with
the same signatures and meanings; a trainer written against it swaps one for the other::

    async def collect(service: RolloutService, prompts: list[Sample]) -> list[Sample]:
        async with service:
            return await service.run_batch(prompts, concurrency=64, seeds=list(range(len(prompts))))
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

from fsm_rollout.runtime.metrics import MetricsSnapshot
from fsm_rollout.sample import Sample
from fsm_rollout.weights.suspension import SuspendStats


@runtime_checkable
class RolloutService(Protocol):
    """Runs samples through the lifecycle; see :class:`~fsm_rollout.runtime.runner.RolloutRunner` for each method's
    meaning (the pool's differ only where its docstrings say)."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def run(self, sample: Sample) -> Sample:
        """Run one sample to a terminal state and return it."""
        ...

    async def run_batch(
        self,
        samples: Iterable[Sample],
        *,
        concurrency: int = 64,
        sample_ids: Sequence[str | None] = (),
        seeds: Sequence[int | None] = (),
    ) -> list[Sample]:
        """Run samples, at most ``concurrency`` in flight (per worker for a pool); returns them in input order,
        named by ``sample_ids`` and seeded by ``seeds``, by position."""
        ...

    def stream(
        self,
        samples: Iterable[Sample],
        *,
        concurrency: int = 64,
        sample_ids: Sequence[str | None] = (),
        seeds: Sequence[int | None] = (),
    ) -> AsyncIterator[Sample]:
        """Yield samples as they finish; they are queued when this is called."""
        ...

    async def run_group(
        self, sample: Sample, n: int, *, concurrency: int | None = None, seed: int | None = None
    ) -> list[Sample]:
        """Run ``n`` copies of a sample (a GRPO group), member ``m`` seeded ``seed + m``."""
        ...

    async def abort(self, reason: str = "cancelled") -> None:
        """End every unfinished sample ``aborted``: ``reason`` for those in flight, ``not_started`` for those
        still queued."""
        ...

    async def suspend(self, reason: str = "weight_update") -> None:
        """Suspend every rollout (a weight update's first half)."""
        ...

    async def resume(self) -> None:
        """Resume every suspended rollout (its second half)."""
        ...

    def weight_update(self, version: str | None = None) -> AbstractAsyncContextManager[None]:
        """``async with service.weight_update(version="7"):`` around pushing the weights."""
        ...

    def metrics(self) -> MetricsSnapshot:
        """Occupancy, queue, dwell times, outcomes and throughput."""
        ...

    @property
    def in_flight(self) -> int:
        """Samples whose rollout has started and not ended."""
        ...

    @property
    def last_suspension(self) -> SuspendStats:
        """What the last suspension and resume cost."""
        ...


if TYPE_CHECKING:  # mypy checks here that both implementations have the surface, with the same signatures
    from fsm_rollout.distributed.pool import RayRolloutPool
    from fsm_rollout.runtime.runner import RolloutRunner

    def _both_are_services(runner: RolloutRunner, pool: RayRolloutPool) -> tuple[RolloutService, RolloutService]:
        return runner, pool


__all__ = ["RolloutService"]
