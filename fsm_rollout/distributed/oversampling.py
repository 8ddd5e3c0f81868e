"""Internal: a :class:`~fsm_rollout.distributed.RayRolloutPool`'s over-sampling and dynamic sampling
(``target_groups``, ``oversample``, ``keep_group``), as a runner's (:mod:`fsm_rollout.runtime.sampling`).

The pool decides in the trainer's process: each group is sent as a batch of its own (dealt over the workers as any
batch), ``keep_group`` runs here, and a surplus group is ended on the workers holding it (``abort_batch``, reason
``oversampled``), so the typed reason and the data so far are the runner's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fsm_rollout.runtime.sampling import GroupSampling, GroupTarget, group_keys, split_groups
from fsm_rollout.sample import Sample
from fsm_rollout.trace import NULL_TRACER

Dispatch = Callable[[list[Sample], Sequence[str | None], Sequence[int | None]], Any]
"""Sends samples as one batch; returns the batch (``number``, and ``results``: a queue of (position, sample))."""


def pool_sampling(
    samples: list[Sample],
    sample_ids: Sequence[str | None],
    seeds: Sequence[int | None],
    target: GroupTarget,
    *,
    dispatch: Dispatch,
    end_batch: Callable[[int, str], Awaitable[None]],
    stopped: Callable[[], bool],
) -> tuple[GroupSampling[int], dict[int, Sample]]:
    """The group sampling of a pool's batch, and the finished samples by input position as they come back."""
    finished: dict[int, Sample] = {}
    numbers: dict[int, int] = {}
    """The batch number each started group's first position was sent as."""

    def start(positions: list[int]) -> list[asyncio.Future[Sample]]:
        batch = dispatch([samples[p] for p in positions], [sample_ids[p] if p < len(sample_ids) else None
                         for p in positions], [seeds[p] if p < len(seeds) else None for p in positions])  # fmt: skip
        numbers[positions[0]] = batch.number
        loop = asyncio.get_running_loop()
        members: list[asyncio.Future[Sample]] = [loop.create_future() for _ in positions]

        async def collect() -> None:
            for _ in positions:
                local, sample = await batch.results.get()
                finished[positions[local]] = sample
                if not members[local].done():
                    members[local].set_result(sample)

        collector = asyncio.ensure_future(collect())
        for member in members:  # the group's end (or its cancellation) ends the collector
            member.add_done_callback(lambda _: collector.cancel() if all(m.done() for m in members) else None)
        return members

    async def end(positions: list[int], reason: str) -> None:
        await end_batch(numbers[positions[0]], reason)

    groups = split_groups(list(range(len(samples))), group_keys(samples))
    sampling = GroupSampling(groups, target, start=start, end=end, stopped=stopped, tracer=NULL_TRACER)
    return sampling, finished


__all__ = ["pool_sampling"]
