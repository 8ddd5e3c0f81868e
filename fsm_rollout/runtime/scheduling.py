"""Internal: a runner's batches, groups and streams: the samples waiting for a slot (from staleness pacing through
the concurrency limit or adaptive admission to the rollout being made), their ends without a start, and the group
sampling of an over-sampled batch (:mod:`fsm_rollout.runtime.sampling`).

:class:`SampleQueue` is the runner's; what it needs of the runner (making and driving a rollout, ending a sample
whose rollout cannot be made, the server a sample is pinned to) it is handed as callables.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Sequence

from fsm_rollout.errors import RolloutError
from fsm_rollout.rollout import Rollout
from fsm_rollout.runtime.admission import Admission
from fsm_rollout.runtime.metrics import RunnerMetrics
from fsm_rollout.runtime.queueing import Waiting
from fsm_rollout.runtime.sampling import GroupSampling, GroupTarget, group_keys, split_groups
from fsm_rollout.runtime.staleness import StalenessGate
from fsm_rollout.sample import Sample
from fsm_rollout.trace import Tracer

NOT_STARTED = "not_started"
"""The reason of a sample that an abort (or a cancelled batch) ended while it waited for a concurrency slot: it
never started, so it holds nothing but its input."""


class SampleQueue:
    """A runner's samples between being handed to a batch, group or stream and their rollouts being made (module
    docstring). ``aborts`` counts the runner's aborts: a group sampling started before one starts no group after."""

    def __init__(
        self,
        *,
        metrics: RunnerMetrics,
        staleness: StalenessGate,
        make: Callable[..., Rollout],
        drive: Callable[[Rollout], Awaitable[Sample]],
        unbuildable: Callable[[Waiting, Exception], Sample],
        url_for: Callable[[Sample], str],
        admission: Callable[[], Admission | None],
        entered: Callable[[], bool],
        raising: Callable[[], bool],
        tracer: Callable[[], Tracer],
    ) -> None:
        self._metrics = metrics
        self._waiting = metrics.waiting
        self._active = metrics.active
        self._staleness = staleness
        self._make, self._drive, self._unbuildable = make, drive, unbuildable
        self._url_for, self._admission, self._entered = url_for, admission, entered
        self._raising, self._tracer = raising, tracer
        self.aborts = 0

    def prepare(
        self, samples: Iterable[Sample], sample_ids: Sequence[str | None] = (), seeds: Sequence[int | None] = ()
    ) -> list[Waiting]:
        """The samples as waiting for a slot (from now on :meth:`abort` reaches them); their rollouts are made
        when they get one. Staleness pacing starts them by group (:func:`group_keys`)."""
        if not self._entered():
            raise RolloutError("use the RolloutRunner as `async with RolloutRunner(...) as runner:`")
        listed = list(samples)
        opened: set[Hashable] = set()
        prepared: list[Waiting] = []
        for position, (sample, group) in enumerate(zip(listed, group_keys(listed), strict=True)):
            sample_id = sample_ids[position] if position < len(sample_ids) else None
            seed = seeds[position] if position < len(seeds) else None
            prepared.append(Waiting(sample, sample_id, seed, time.perf_counter(), group=group, opened=opened))
        self._waiting.update(prepared)
        return prepared

    def build(self, waiting: Waiting, *, raising: bool, admitted_ms: float | None = None) -> Rollout | Sample:
        """The rollout of a sample that leaves the queue, or the sample ended ``failed`` when none can be built."""
        self._waiting.discard(waiting)
        # queued: the wait after staleness pacing's and before admission's
        waited_ms = max(0.0, waiting.waited_ms() - (admitted_ms or 0.0) - (waiting.staleness_ms or 0.0))
        self._metrics.queue_left(waited_ms)
        try:
            return self._make(
                waiting.sample,
                sample_id=waiting.sample_id,
                seed=waiting.seed,
                queued_ms=waited_ms,
                admitted_ms=admitted_ms,
                staleness_ms=waiting.staleness_ms,
            )
        except Exception as error:
            if raising:
                raise
            return self._unbuildable(waiting, error)

    def end_unstarted(self, waiting: Waiting, reason: str = NOT_STARTED) -> None:
        """End a sample that never got a slot ``aborted`` with ``reason`` (:data:`NOT_STARTED`): its rollout is
        made and aborted before it starts (traced and recorded as any abort before a start; nothing is sent)."""
        if waiting.ended is not None or waiting not in self._waiting:
            return
        built = self.build(waiting, raising=False)
        if isinstance(built, Rollout):
            built.request_abort(reason)
            built = built.sample
        waiting.ended = built
        if waiting.cancel_wait is not None:
            waiting.cancel_wait()

    def end_all_unstarted(self, waiting: Iterable[Waiting]) -> None:
        for queued in list(waiting):
            self.end_unstarted(queued)

    async def bounded(self, waiting: Waiting, semaphore: asyncio.Semaphore) -> Sample:
        if self._staleness.limited and waiting.opened is not None:
            ended = await self._paced(waiting, waiting.opened)
            if ended is not None:
                return ended
        admission = self._admission()
        if admission is not None:
            return await self._admitted(waiting, admission)
        try:
            async with semaphore:
                if waiting.ended is not None:
                    return waiting.ended
                built = self.build(waiting, raising=self._raising())
                if isinstance(built, Sample):
                    return built
                return await self._drive(built)
        except asyncio.CancelledError:
            self.end_unstarted(waiting)  # cancelled while waiting for its slot (a no-op once it had one)
            raise

    async def _paced(self, waiting: Waiting, opened: set[Hashable]) -> Sample | None:
        """Wait for staleness pacing to let the sample's group start; the sample, when it was ended meanwhile."""
        wait = asyncio.ensure_future(self._staleness.admit(opened, waiting.group))
        waiting.cancel_wait = wait.cancel  # an abort that ends the sample unstarted ends the wait too
        try:
            waiting.staleness_ms = await wait
        except asyncio.CancelledError:
            if waiting.ended is not None:
                return waiting.ended
            self.end_unstarted(waiting)
            raise
        finally:
            waiting.cancel_wait = None
        return waiting.ended

    async def _admitted(self, waiting: Waiting, admission: Admission) -> Sample:
        """:meth:`_bounded` under adaptive admission: the sample starts when its server admits a new sample."""
        wait = asyncio.ensure_future(admission.admit_new(self._url_for(waiting.sample)))
        waiting.cancel_wait = wait.cancel  # an abort that ends the sample unstarted ends the wait too
        try:
            admitted_ms = await wait
        except asyncio.CancelledError:
            if waiting.ended is not None:
                return waiting.ended
            self.end_unstarted(waiting)
            raise
        if waiting.ended is not None:  # ended as it was admitted: the slot goes back
            admission.controllers[self._url_for(waiting.sample)].release()
            return waiting.ended
        built = self.build(waiting, raising=self._raising(), admitted_ms=admitted_ms)
        if isinstance(built, Sample):
            admission.controllers[self._url_for(waiting.sample)].release()
            return built
        return await self._drive(built)

    async def end_samples(self, samples: Iterable[Sample], reason: str) -> None:
        """End these samples ``aborted`` with ``reason``: those still queued without sending anything, those in
        flight with their request cancelled; finished ones stay as they are."""
        members = {id(sample) for sample in samples}
        for item in [item for item in self._waiting if id(item.sample) in members]:
            self.end_unstarted(item, reason)
        await asyncio.gather(*(rollout.abort(reason) for rollout in list(self._active)
                               if id(rollout.sample) in members and not rollout.terminal))  # fmt: skip

    def sampling(
        self,
        samples: Iterable[Sample],
        sample_ids: Sequence[str | None],
        seeds: Sequence[int | None],
        target: GroupTarget,
        semaphore: asyncio.Semaphore,
    ) -> tuple[GroupSampling[int], dict[Waiting, int]]:
        """The group sampling of a batch (its groups by input position), and the samples it started by position."""
        listed = list(samples)
        started: dict[Waiting, int] = {}
        opened: set[Hashable] = set()
        aborts = self.aborts
        keys = group_keys(listed)

        def start(positions: list[int]) -> list[Awaitable[Sample]]:
            ids = [sample_ids[p] if p < len(sample_ids) else None for p in positions]
            group_seeds_ = [seeds[p] if p < len(seeds) else None for p in positions]
            prepared = self.prepare([listed[p] for p in positions], ids, group_seeds_)
            for item, position in zip(prepared, positions, strict=True):
                item.group, item.opened, started[item] = keys[position], opened, position
            return [self.bounded(item, semaphore) for item in prepared]

        async def end(positions: list[int], reason: str) -> None:
            await self.end_samples([listed[p] for p in positions], reason)

        groups = split_groups(list(range(len(listed))), keys)
        sampling = GroupSampling(groups, target, start=start, end=end, stopped=lambda: self.aborts != aborts,
                                 tracer=self._tracer())  # fmt: skip
        return sampling, started


async def as_finished(
    tasks: Sequence[asyncio.Future[Sample]], on_close: Callable[[], None] | None = None
) -> AsyncIterator[Sample]:
    try:
        for finished in asyncio.as_completed(tasks):
            yield await finished
    finally:
        if on_close is not None:
            on_close()
        for task in tasks:
            task.cancel()


__all__ = ["NOT_STARTED", "SampleQueue", "as_finished"]
