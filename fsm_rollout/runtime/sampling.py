"""Internal: over-sampling and dynamic sampling of groups (``run_batch``/``stream`` with ``target_groups``).

A batch's samples form groups (the members of one prompt share ``group_index``; a sample without one is a group of
its own). With ``target_groups=N`` and ``oversample=M`` the first N+M groups start; as each group completes (every
member ended) ``keep_group`` (default: every group) says whether it is kept. A group not kept is dropped and the next
group of the batch starts in its place, so that N+M groups are kept or running while prompts are left. Once N groups
are kept, the groups still running are the surplus: their samples end ``aborted`` with the typed reason
:data:`~fsm_rollout.machine.lifecycle.OVERSAMPLED` (the data so far kept, the environment closed), and the groups
never started stay as they were. When the prompts run out first, the batch ends with what it has: a warning, a
``groups_exhausted`` trace event and ``prompts_exhausted`` on the result say so.

Every member of a group whose fate is known carries ``metadata["group_kept"]``: True for the N kept groups, False
for dropped and surplus ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fsm_rollout.errors import ConfigError
from fsm_rollout.machine.lifecycle import OVERSAMPLED
from fsm_rollout.sample import Sample
from fsm_rollout.trace import Tracer

GROUP_KEPT = "group_kept"
"""``sample.metadata`` key: whether the sample's group is one of the ``target_groups`` kept."""

KeepGroup = Callable[[Sequence[Sample]], bool]
"""Whether a complete group carries signal (e.g. its rewards vary), given its members in member order."""

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupTarget:
    """``run_batch``/``stream``'s sampling arguments, checked."""

    groups: int
    oversample: int = 0
    keep_group: KeepGroup | None = None

    @classmethod
    def of(cls, target_groups: int | None, oversample: int, keep_group: KeepGroup | None) -> GroupTarget | None:
        if target_groups is None:
            if oversample or keep_group is not None:
                raise ConfigError("oversample and keep_group need target_groups (the number of groups wanted)")
            return None
        if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups < 1:
            raise ConfigError(f"target_groups must be a positive integer, got {target_groups!r}")
        if isinstance(oversample, bool) or not isinstance(oversample, int) or oversample < 0:
            raise ConfigError(f"oversample must be a non-negative integer, got {oversample!r}")
        if keep_group is not None and not callable(keep_group):
            raise ConfigError(f"keep_group must be callable (group samples) -> bool, got {keep_group!r}")
        return cls(target_groups, oversample, keep_group)


class SampledBatch(list[Sample]):
    """``run_batch``'s answer with ``target_groups``: the samples of every group it started, in input order (kept,
    dropped and surplus alike; ``metadata["group_kept"]`` tells them apart), and what happened to the groups."""

    kept_groups: int = 0
    dropped_groups: int = 0
    """Complete groups ``keep_group`` refused."""
    surplus_groups: int = 0
    """Groups ended (or finished) after the target was reached: their samples end ``aborted``/``oversampled``."""
    prompts_exhausted: bool = False
    """The batch ran out of groups before ``target_groups`` were kept: the result holds what there is."""

    @property
    def kept(self) -> list[Sample]:
        """The samples of the kept groups, in input order."""
        return [sample for sample in self if sample.metadata.get(GROUP_KEPT) is True]


def group_keys(samples: Sequence[Sample]) -> list[Hashable]:
    """Each sample's group: its ``group_index``, else a group of its own."""
    return [
        ("group", sample.group_index) if sample.group_index is not None else ("own", position)
        for position, sample in enumerate(samples)
    ]


def split_groups(items: Sequence[_T], keys: Sequence[Hashable]) -> list[list[_T]]:
    """``items`` grouped by ``keys``, groups in order of their first member."""
    groups: dict[Hashable, list[_T]] = {}
    for item, key in zip(items, keys, strict=True):
        groups.setdefault(key, []).append(item)
    return list(groups.values())


class GroupSampling(Generic[_T]):
    """Runs a batch's groups to a target (module docstring). ``start`` starts one group's members and returns what
    each one's finished sample is awaited on; ``end`` ends a running group's unfinished members with a reason;
    ``stopped`` says the run was aborted (no group starts after that)."""

    def __init__(
        self,
        groups: Sequence[list[_T]],
        target: GroupTarget,
        *,
        start: Callable[[list[_T]], Sequence[Awaitable[Sample]]],
        end: Callable[[list[_T], str], Awaitable[None]],
        stopped: Callable[[], bool],
        tracer: Tracer,
    ) -> None:
        self.target = target
        self._reserve = deque(groups)
        self._start, self._end, self._stopped, self._tracer = start, end, stopped, tracer
        self.kept = self.dropped = self.surplus = 0
        self.exhausted = False
        self.decided: asyncio.Queue[list[Sample] | None] = asyncio.Queue()
        """Each group's members once its fate is known (None once the run is over), for a stream."""
        self._running: dict[asyncio.Future[list[Sample]], list[_T]] = {}
        self._tasks: list[asyncio.Future[Sample]] = []

    def _start_next(self) -> None:
        group = self._reserve.popleft()
        members = [asyncio.ensure_future(awaited) for awaited in self._start(group)]
        self._tasks.extend(members)
        self._running[asyncio.ensure_future(_all_of(members))] = group

    async def run(self) -> None:
        target = self.target
        try:
            while self._reserve and len(self._running) < target.groups + target.oversample:
                self._start_next()
            while self._running:
                done, _ = await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
                for finished in sorted(done, key=list(self._running).index):  # in start order
                    del self._running[finished]
                    self._decide(finished.result())
                if self.kept >= target.groups and self._running:
                    surplus = [group for group in self._running.values()]
                    await asyncio.gather(*(self._end(group, OVERSAMPLED) for group in surplus))
        finally:
            for running in self._running:
                running.cancel()
            for task in self._tasks:
                task.cancel()
            self.decided.put_nowait(None)
        if self.kept < target.groups and not self._stopped():
            self.exhausted = True
            _log.warning("target_groups=%d: the prompts ran out with %d group(s) kept (%d dropped by keep_group); "
                         "returning what there is", target.groups, self.kept, self.dropped)  # fmt: skip
            self._tracer.other_event("groups_exhausted", {"target_groups": target.groups, "kept_groups": self.kept,
                                                          "dropped_groups": self.dropped})  # fmt: skip

    def _decide(self, members: list[Sample]) -> None:
        target = self.target
        if self.kept >= target.groups:
            keep, self.surplus = False, self.surplus + 1
        elif target.keep_group is None or target.keep_group(members):
            keep, self.kept = True, self.kept + 1
        else:
            keep, self.dropped = False, self.dropped + 1
            if self._reserve and not self._stopped():
                self._start_next()
        for sample in members:
            sample.metadata[GROUP_KEPT] = keep
        self.decided.put_nowait(members)

    def batch(self, samples: Sequence[Sample]) -> SampledBatch:
        """The result of ``run_batch``: ``samples`` (those started, in input order) with the counts."""
        result = SampledBatch(samples)
        result.kept_groups, result.dropped_groups, result.surplus_groups = self.kept, self.dropped, self.surplus
        result.prompts_exhausted = self.exhausted
        return result


async def _all_of(members: Sequence[asyncio.Future[Sample]]) -> list[Sample]:
    return list(await asyncio.gather(*members))


class GroupStream(AsyncIterator[Sample]):
    """``stream``'s answer with ``target_groups``: a group's members are yielded together once its fate is known
    (``metadata["group_kept"]``); :attr:`prompts_exhausted` is set once the prompts ran out before the target.
    Closing it early (``aclose``) cancels what still runs."""

    def __init__(self, sampling: GroupSampling[Any], on_close: Callable[[], None]) -> None:
        self._sampling = sampling
        self._on_close = on_close
        self._runner: asyncio.Future[None] = asyncio.ensure_future(sampling.run())
        self._pending: deque[Sample] = deque()
        self._over = False

    @property
    def prompts_exhausted(self) -> bool:
        return self._sampling.exhausted

    @property
    def sampling(self) -> GroupSampling[Any]:
        return self._sampling

    def __aiter__(self) -> GroupStream:
        return self

    async def __anext__(self) -> Sample:
        while not self._pending:
            if self._over:
                raise StopAsyncIteration
            members = await self._sampling.decided.get()
            if members is None:
                self._over = True
                await self._runner  # raises what the run raised (keep_group's error, say)
            else:
                self._pending.extend(members)
        return self._pending.popleft()

    async def aclose(self) -> None:
        self._over = True
        self._on_close()
        self._runner.cancel()
        await asyncio.gather(self._runner, return_exceptions=True)


__all__ = [
    "GROUP_KEPT",
    "GroupSampling",
    "GroupStream",
    "GroupTarget",
    "KeepGroup",
    "SampledBatch",
    "group_keys",
    "split_groups",
]
