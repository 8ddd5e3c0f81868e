"""RayRolloutPool: the runner's surface over rollout workers that are Ray actors, each hosting one RolloutRunner.

Why this module is long: it is one class, the runner's whole surface (runs, batches, streams, groups with their
over-sampling, aborts, suspensions, weight updates, staleness reports, metrics) over workers that may die; what is
not the pool's own state lives beside it (:mod:`~fsm_rollout.distributed.worker`,
:mod:`~fsm_rollout.distributed.oversampling`, :mod:`~fsm_rollout.runtime.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fsm_rollout.config import RolloutConfig, build_inference_sampling_params
from fsm_rollout.distributed.oversampling import pool_sampling
from fsm_rollout.distributed.worker import RolloutWorker, config_to_data, worker_trace_path
from fsm_rollout.errors import ConfigError, PoolError, RolloutError
from fsm_rollout.runtime.metrics import MetricsSnapshot, PoolMetricsSnapshot, combine_metrics, combine_suspensions
from fsm_rollout.runtime.runner import group_members, group_seeds
from fsm_rollout.runtime.sampling import GroupSampling, GroupStream, GroupTarget, KeepGroup
from fsm_rollout.runtime.staleness import version_number
from fsm_rollout.sample import Sample, Status
from fsm_rollout.weights.suspension import SuspendStats

_LOG = logging.getLogger(__name__)

DEFAULT_WORKER_OPTIONS: Mapping[str, Any] = {"num_cpus": 1}
"""Ray actor options every worker gets unless ``worker_options`` says otherwise: one CPU, since a runner's client
work is CPU-bound on one event loop."""
LOCAL_CLUSTER_OPTIONS: Mapping[str, Any] = {"address": "local", "include_dashboard": False}
"""``ray.init`` options of the local cluster a pool starts when no cluster is connected (``ray_init`` adds to
them): always a new local instance, never one found on the machine."""
WORKER_LOST = "worker_lost"
"""The reason of a sample whose worker died while it ran."""
SHARE_END_WAIT_S = 10.0
"""How long closing a pool waits for its workers' streams to end once they are stopped, before cancelling them."""


@dataclass(frozen=True)
class WorkerStatus:
    """One worker of a pool: where it runs and whether it is still alive (a lost worker is never replaced)."""

    index: int
    pid: int | None
    alive: bool
    lost_because: str | None = None


@dataclass(eq=False)
class _Worker:
    index: int
    actor: Any
    pid: int | None = None
    lost_because: str | None = None

    @property
    def alive(self) -> bool:
        return self.lost_because is None


@dataclass(eq=False)
class _Batch:
    """One call's samples as sent (``Sample.to_dict()``), and where each one's result goes."""

    sent: list[dict[str, Any]]
    sample_ids: Sequence[str | None]
    seeds: Sequence[int | None]
    concurrency: int
    number: int
    results: asyncio.Queue[tuple[int, Sample]] = field(default_factory=asyncio.Queue)


class RayRolloutPool:
    """Rollout workers on Ray: ``num_workers`` actors, each hosting one
    :class:`~fsm_rollout.runtime.runner.RolloutRunner` with its own HTTP pool, tokenizer and environment module; use it
    as an async context manager::

        async with RayRolloutPool(config, sampling_params=sampling, num_workers=4) as pool:
            samples = await pool.run_batch(samples, concurrency=64)

    It has the runner's surface (:class:`~fsm_rollout.runtime.service.RolloutService`): :meth:`run`, :meth:`run_batch`
    (input order), :meth:`stream` (as they finish), :meth:`run_group`, with the runner's ``sample_ids``, ``seeds``
    and ``seed``; :meth:`abort`, :meth:`suspend`/:meth:`resume`/:meth:`weight_update` (on every worker; each
    returns once every worker has), :attr:`last_suspension`, :attr:`in_flight` and :meth:`metrics`, summed over
    the workers as they last reported: with every batch of finished samples, every abort, suspend and resume, and
    every ``metrics_interval_s`` (:meth:`refresh_metrics` asks them now). A call's samples are dealt over the
    live workers in turn, and ``concurrency`` bounds each worker's samples in flight, as it bounds one runner's.
    Samples travel as ``Sample.to_dict()`` data and come back as new ``Sample`` objects (the ones passed in are
    left as they were); the environment is loaded by each worker from ``config.env_path`` and the tokenizer from
    ``config.tokenizer_path`` (else from what the engine names, as a runner does), so the config must name the
    environment, and a ``reward_fn`` (a callable) is refused. A trace file gets one file per worker
    (``run.jsonl`` becomes ``run.worker0.jsonl``, ...).

    Placement: ``worker_options`` are Ray actor options (``num_cpus``, ``resources``, ``scheduling_strategy``,
    ``runtime_env``, ...), one mapping for every worker or a sequence of one per worker (a node affinity or a
    placement-group bundle each); :data:`DEFAULT_WORKER_OPTIONS` is underneath. A worker not started within
    ``start_timeout_s`` (the cluster lacks what it asks for) fails the start with :class:`~fsm_rollout.errors.
    PoolError`.

    The cluster is the caller's: with Ray already initialised the pool uses it and leaves it running. With none it
    starts a local one (:data:`LOCAL_CLUSTER_OPTIONS` plus ``ray_init``), logs a warning saying so, and shuts it
    down when the pool closes.

    A worker that dies ends its unfinished samples ``failed`` with reason ``worker_lost``
    (``metadata["rollout_reason"]``, ``metadata["rollout_error"]``), each holding the data the trainer had sent;
    the pool goes on with the others (:attr:`workers`) and raises :class:`~fsm_rollout.errors.PoolError` once
    none is left.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        sampling_params: Mapping[str, Any],
        num_workers: int = 2,
        engine_urls: Sequence[str] | None = None,
        worker_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        ray_init: Mapping[str, Any] | None = None,
        start_timeout_s: float = 300.0,
        metrics_interval_s: float = 1.0,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not isinstance(config, RolloutConfig):
            raise ConfigError(f"config must be a RolloutConfig, got {type(config).__name__}")
        if config.env_path is not None and not isinstance(config.env_path, str):
            raise ConfigError(f"config.env_path must be a module name or .py path (a str), got {config.env_path!r}")
        build_inference_sampling_params(sampling_params)  # refuse bad sampling parameters here, not in N workers
        self.config = config
        self.sampling_params = dict(sampling_params)
        self.num_workers = num_workers
        self.engine_urls = list(engine_urls) if engine_urls else None
        self._config_data = config_to_data(config)
        self._worker_options = _per_worker_options(worker_options, num_workers)
        self._ray_init = dict(ray_init or {})
        if not isinstance(start_timeout_s, int | float) or start_timeout_s <= 0:
            raise ConfigError(f"start_timeout_s must be a positive number of seconds, got {start_timeout_s!r}")
        self.start_timeout_s = float(start_timeout_s)
        if not isinstance(metrics_interval_s, int | float) or metrics_interval_s <= 0:
            raise ConfigError(f"metrics_interval_s must be a positive number of seconds, got {metrics_interval_s!r}")
        self.metrics_interval_s = float(metrics_interval_s)
        self._worker_metrics: dict[int, MetricsSnapshot] = {}
        """Each worker's latest report (by its ``elapsed_s``: reports of concurrent calls may cross)."""
        self._last_suspension = SuspendStats()
        self._poller: asyncio.Future[None] | None = None
        self._workers: list[_Worker] = []
        self._started_ray = False
        self._started_at = time.perf_counter()
        self._batches = 0
        self._aborts = 0
        self._next_worker = 0
        self._failed_here: Counter[str] = Counter()
        """Reasons of the samples the pool itself ended ``failed`` (their worker died, or its call failed)."""
        self._shares: set[asyncio.Future[None]] = set()
        self._ray: Any = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> RayRolloutPool:
        ray = self._ray = _import_ray()
        if ray.is_initialized() and self._ray_init:
            _LOG.warning("RayRolloutPool: Ray is already initialised; ray_init=%r is not used", self._ray_init)
        if not ray.is_initialized():
            options = {**LOCAL_CLUSTER_OPTIONS, **self._ray_init}
            _LOG.warning("RayRolloutPool: no Ray cluster is connected; starting a local one (%s), which the pool "
                         "shuts down when it closes. Call ray.init() first to use a cluster of your own.",
                         ", ".join(f"{key}={value!r}" for key, value in sorted(options.items())))  # fmt: skip
            ray.init(**options)
            self._started_ray = True
        actor_class = ray.remote(RolloutWorker)
        try:
            for index, options in enumerate(self._worker_options):
                data = {**self._config_data, "trace": worker_trace_path(self._config_data["trace"], index)}
                actor = actor_class.options(**options).remote(data, self.sampling_params, self.engine_urls)
                self._workers.append(_Worker(index, actor))
            await self._start_workers()
            await self.refresh_metrics()
        except BaseException:
            await self._close()
            raise
        self._started_at = time.perf_counter()
        self._poller = asyncio.ensure_future(self._poll_metrics())
        return self

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            with contextlib.suppress(Exception):  # no worker left, or one died: the calls that need them say so
                await self.refresh_metrics()

    async def _start_workers(self) -> None:
        starts = [worker.actor.start.remote() for worker in self._workers]
        try:
            infos = await asyncio.wait_for(asyncio.gather(*starts), self.start_timeout_s)
        except TimeoutError:
            raise PoolError(
                f"RayRolloutPool: {self.num_workers} worker(s) did not start within {self.start_timeout_s:g} s; "
                f"the cluster may lack what they ask for ({self._worker_options[0]!r} each; cluster: "
                f"{self._ray.cluster_resources()!r})"
            ) from None
        except Exception as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, RolloutError):  # a config, environment or tokenizer error: say it plainly
                raise cause from None
            raise
        for worker, info in zip(self._workers, infos, strict=True):
            worker.pid = info["pid"]

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        ray = self._ray
        live = [worker for worker in self._workers if worker.alive and worker.pid is not None]
        await asyncio.gather(*(worker.actor.stop.remote() for worker in live), return_exceptions=True)
        # a share still reading its worker's stream (its end, after the last sample) holds a Ray object generator:
        # left to asyncio.run's final cancellation, it would be torn down after ray.shutdown(), and Ray then ends
        # the process with exit 1 and no message. The stopped workers end their streams; what is left is cancelled.
        shares = list(self._shares)
        if shares:
            _, pending = await asyncio.wait(shares, timeout=SHARE_END_WAIT_S)
            for share in pending:
                share.cancel()
            await asyncio.gather(*shares, return_exceptions=True)
        for worker in self._workers:
            ray.kill(worker.actor)
        self._workers = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    @property
    def workers(self) -> list[WorkerStatus]:
        """Every worker the pool started, alive or lost."""
        return [WorkerStatus(w.index, w.pid, w.alive, w.lost_because) for w in self._workers]

    # ------------------------------------------------------------------ running samples

    async def run(self, sample: Sample) -> Sample:
        """Run one sample on a worker; returns the finished sample."""
        return (await self.run_batch([sample], concurrency=1))[0]

    async def run_batch(
        self,
        samples: Iterable[Sample],
        *,
        concurrency: int = 64,
        sample_ids: Sequence[str | None] = (),
        seeds: Sequence[int | None] = (),
        target_groups: int | None = None,
        oversample: int = 0,
        keep_group: KeepGroup | None = None,
    ) -> list[Sample]:
        """Run samples over the workers (at most ``concurrency`` in flight on each); returns them in input order.
        ``sample_ids`` and ``seeds`` name and seed them by position, and ``target_groups``, ``oversample`` and
        ``keep_group`` sample groups (``keep_group`` runs in this process; each group goes out as a batch of its
        own), as :meth:`RolloutRunner.run_batch <fsm_rollout.runtime.runner.RolloutRunner.run_batch>` does."""
        target = GroupTarget.of(target_groups, oversample, keep_group)
        if target is not None:
            sampling, finished = self._sampling(list(samples), sample_ids, seeds, concurrency, target)
            await sampling.run()
            return sampling.batch([finished[position] for position in sorted(finished)])
        batch = self._dispatch(list(samples), sample_ids, seeds, concurrency)
        return await _in_order(batch)

    def _sampling(
        self,
        samples: list[Sample],
        sample_ids: Sequence[str | None],
        seeds: Sequence[int | None],
        concurrency: int,
        target: GroupTarget,
    ) -> tuple[GroupSampling[int], dict[int, Sample]]:
        aborts = self._aborts

        async def end_batch(number: int, reason: str) -> None:
            for worker, metrics in await self._on_every_worker("abort_batch", number, reason):
                self._note_metrics(worker, metrics)

        return pool_sampling(samples, sample_ids, seeds, target, end_batch=end_batch,
                             dispatch=lambda group, ids, seeds_: self._dispatch(group, ids, seeds_, concurrency),
                             stopped=lambda: self._aborts != aborts)  # fmt: skip

    def stream(
        self,
        samples: Iterable[Sample],
        *,
        concurrency: int = 64,
        sample_ids: Sequence[str | None] = (),
        seeds: Sequence[int | None] = (),
        target_groups: int | None = None,
        oversample: int = 0,
        keep_group: KeepGroup | None = None,
    ) -> AsyncIterator[Sample]:
        """Yield samples as they finish (at most ``concurrency`` in flight on each worker). The samples are sent
        when this is called, so :meth:`abort` reaches them before the first is awaited. With ``target_groups`` a
        group's members come together once its fate is known, as from :meth:`RolloutRunner.stream
        <fsm_rollout.runtime.runner.RolloutRunner.stream>`."""
        target = GroupTarget.of(target_groups, oversample, keep_group)
        if target is not None:
            sampling, _ = self._sampling(list(samples), sample_ids, seeds, concurrency, target)
            return GroupStream(sampling, lambda: None)
        batch = self._dispatch(list(samples), sample_ids, seeds, concurrency)
        return _as_finished(batch)

    async def run_group(
        self, sample: Sample, n: int, *, concurrency: int | None = None, seed: int | None = None
    ) -> list[Sample]:
        """Run ``n`` copies of a sample (a GRPO group) over the workers, as :meth:`RolloutRunner.run_group
        <fsm_rollout.runtime.runner.RolloutRunner.run_group>` makes and seeds them; returns them in member order."""
        copies, ids = group_members(sample, n)
        seeds = group_seeds(seed, len(copies))
        return await _in_order(self._dispatch(copies, ids, seeds, concurrency or n))

    def _dispatch(
        self, samples: list[Sample], sample_ids: Sequence[str | None], seeds: Sequence[int | None], concurrency: int
    ) -> _Batch:
        if not self._workers:
            raise PoolError("use the RayRolloutPool as `async with RayRolloutPool(...) as pool:`")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"expected a positive integer concurrency, got {concurrency!r}")
        live = self._live()
        self._batches += 1
        batch = _Batch([sample.to_dict() for sample in samples], sample_ids, seeds, concurrency, self._batches)
        shares: dict[int, list[int]] = {}
        for position in range(len(samples)):
            worker = live[(self._next_worker + position) % len(live)]
            shares.setdefault(worker.index, []).append(position)
        self._next_worker = (self._next_worker + len(samples)) % len(live)
        for index, positions in shares.items():
            share = asyncio.ensure_future(self._run_share(self._workers[index], batch, positions))
            self._shares.add(share)  # the loop keeps only weak references to tasks
            share.add_done_callback(self._shares.discard)
        return batch

    async def _run_share(self, worker: _Worker, batch: _Batch, positions: list[int]) -> None:
        ids = [batch.sample_ids[p] if p < len(batch.sample_ids) else None for p in positions]
        seeds = [batch.seeds[p] if p < len(batch.seeds) else None for p in positions]
        finished: set[int] = set()
        try:
            call = worker.actor.run_batch.remote(batch.number, [batch.sent[p] for p in positions], ids, seeds,
                                                 batch.concurrency)  # fmt: skip
            async for ref in call:
                done, metrics = await ref
                self._note_metrics(worker, metrics)  # before the samples: a caller they wake sees them counted
                for local, data in done:
                    finished.add(local)
                    batch.results.put_nowait((positions[local], Sample.from_dict(data)))
        except Exception as error:
            lost = self._is_actor_death(error)
            if lost:
                self._lose(worker, error)
            for local, position in enumerate(positions):
                if local not in finished:
                    batch.results.put_nowait((position, self._unfinished(batch.sent[position], worker, error, lost)))

    def _unfinished(self, sent: dict[str, Any], worker: _Worker, error: BaseException, lost: bool) -> Sample:
        """A sample whose worker call ended without it, as the trainer had sent it, ended ``failed``."""
        sample = Sample.from_dict(sent)
        what = f"rollout worker {worker.index} (pid {worker.pid}) " + ("was lost" if lost else "failed the call")
        described = {"type": type(error).__name__, "message": f"{what}: {error}", "state": None, "trigger": None}
        sample.metadata = {**sample.metadata, "rollout_error": described,
                           "rollout_reason": WORKER_LOST if lost else "error"}  # fmt: skip
        sample.status = Status.FAILED
        self._failed_here[sample.metadata["rollout_reason"]] += 1
        return sample

    def _is_actor_death(self, error: BaseException) -> bool:
        return isinstance(error, self._ray.exceptions.RayActorError)

    def _lose(self, worker: _Worker, error: BaseException) -> None:
        if worker.alive:
            worker.lost_because = f"{type(error).__name__}: {error}".splitlines()[0]
            _LOG.warning("RayRolloutPool: rollout worker %d (pid %s) was lost: %s", worker.index, worker.pid,
                         worker.lost_because)  # fmt: skip

    def _live(self) -> list[_Worker]:
        live = [worker for worker in self._workers if worker.alive]
        if not live:
            reasons = "; ".join(f"worker {w.index}: {w.lost_because}" for w in self._workers)
            raise PoolError(f"RayRolloutPool: no rollout worker is alive ({reasons})")
        return live

    # ------------------------------------------------------------------ every worker at once

    async def _on_every_worker(self, method: str, *args: Any) -> list[tuple[_Worker, Any]]:
        """Call ``method`` on every live worker; returns once each has answered, with each live worker's answer
        (a worker that died meanwhile is marked lost and left out)."""
        live = self._live()
        answers = await asyncio.gather(*(getattr(w.actor, method).remote(*args) for w in live),
                                       return_exceptions=True)  # fmt: skip
        results = []
        for worker, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                if not self._is_actor_death(answer):
                    raise answer
                self._lose(worker, answer)
            else:
                results.append((worker, answer))
        return results

    async def abort(self, reason: str = "cancelled") -> None:
        """End every sample the pool has sent and not finished ``aborted`` with ``reason`` (samples not started
        end without sending anything, reason ``not_started``); when this returns, no request of those samples
        reaches a server."""
        self._aborts += 1  # no group of an over-sampled batch starts after this
        for worker, metrics in await self._on_every_worker("abort", reason, self._batches):
            self._note_metrics(worker, metrics)

    async def consumed(self, version: int | str) -> None:
        """The trainer has consumed weight version ``version``: every worker's staleness pacing
        (``config.max_staleness``) hears it, as :meth:`RolloutRunner.consumed
        <fsm_rollout.runtime.runner.RolloutRunner.consumed>` (awaited here: the workers are other processes)."""
        version_number(version, "consumed(version)")  # a bad version fails here, not in every worker
        await self._on_every_worker("consumed", version)

    async def suspend(self, reason: str = "weight_update") -> None:
        """Suspend every worker's rollouts (see :meth:`RolloutRunner.suspend
        <fsm_rollout.runtime.runner.RolloutRunner.suspend>`); returns once every worker has."""
        self._note_suspension(await self._on_every_worker("suspend", reason))

    async def resume(self) -> None:
        """Resume every worker's suspended rollouts; returns once every worker has."""
        self._note_suspension(await self._on_every_worker("resume"))

    def _note_suspension(self, answers: list[tuple[_Worker, Any]]) -> None:
        for worker, answer in answers:
            self._note_metrics(worker, answer["metrics"])
        self._last_suspension = combine_suspensions([SuspendStats(**answer["suspension"]) for _, answer in answers])

    @property
    def last_suspension(self) -> SuspendStats:
        """What the last suspension and resume cost, over the workers: requests in flight and abort or pause
        calls summed, times the slowest worker's."""
        return self._last_suspension

    def _note_metrics(self, worker: _Worker, data: Mapping[str, Any]) -> None:
        snapshot = MetricsSnapshot(**data)
        known = self._worker_metrics.get(worker.index)
        if known is None or snapshot.elapsed_s >= known.elapsed_s:
            self._worker_metrics[worker.index] = snapshot

    async def refresh_metrics(self) -> PoolMetricsSnapshot:
        """Ask every live worker for its metrics now; :meth:`metrics` with them."""
        for worker, metrics in await self._on_every_worker("metrics"):
            self._note_metrics(worker, metrics)
        return self.metrics()

    @property
    def in_flight(self) -> int:
        """Samples whose rollout has started on a worker and not ended, as the workers last reported."""
        return self.metrics().in_flight

    @asynccontextmanager
    async def weight_update(self, version: str | None = None) -> AsyncIterator[None]:
        """``async with pool.weight_update(version="7"):`` suspends every worker, runs the body (push the weights),
        sets the weight version through every worker (when given) and resumes them, also when the body raises."""
        await self.suspend("weight_update")
        try:
            yield
            if version is not None:
                await self._on_every_worker("set_weight_version", version)
        finally:
            await self.resume()

    def metrics(self) -> PoolMetricsSnapshot:
        """The live workers' metrics as they last reported them, summed (see :class:`PoolMetricsSnapshot`)."""
        known = self._worker_metrics
        snapshots = [known[worker.index] for worker in self._workers if worker.alive and worker.index in known]
        return combine_metrics(snapshots, elapsed_s=time.perf_counter() - self._started_at,
                               failed_in_pool=self._failed_here,
                               workers_lost=sum(not w.alive for w in self._workers))  # fmt: skip


async def _in_order(batch: _Batch) -> list[Sample]:
    results: list[Sample | None] = [None] * len(batch.sent)
    for _ in range(len(batch.sent)):
        position, sample = await batch.results.get()
        results[position] = sample
    return [sample for sample in results if sample is not None]


async def _as_finished(batch: _Batch) -> AsyncIterator[Sample]:
    for _ in range(len(batch.sent)):
        yield (await batch.results.get())[1]


def _per_worker_options(
    options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None, num_workers: int
) -> list[dict[str, Any]]:
    if options is None or isinstance(options, Mapping):
        return [{**DEFAULT_WORKER_OPTIONS, **(options or {})} for _ in range(num_workers)]
    listed = list(options)
    if len(listed) != num_workers or not all(isinstance(item, Mapping) for item in listed):
        raise ConfigError(
            f"worker_options must be one mapping of Ray actor options or a sequence of {num_workers} (one per "
            f"worker), got {options!r}"
        )
    return [{**DEFAULT_WORKER_OPTIONS, **item} for item in listed]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise PoolError("RayRolloutPool needs Ray: pip install 'fsm-rollout[ray]'") from error
    return ray


__all__ = [
    "DEFAULT_WORKER_OPTIONS",
    "LOCAL_CLUSTER_OPTIONS",
    "WORKER_LOST",
    "PoolMetricsSnapshot",
    "RayRolloutPool",
    "WorkerStatus",
    "combine_metrics",
    "combine_suspensions",
]
