"""RolloutRunner: many samples through the lifecycle with shared resources, bounded concurrency, abort and metrics.

One runner owns what samples share: the HTTP client(s), the tokenizer, the loaded environment module, the trace
sink and the machine definition (module-level, shared by every rollout). Use it as an async context manager::

    async with RolloutRunner(config, sampling_params=sampling) as runner:
        samples = await runner.run_batch(samples, concurrency=64)

Several engine URLs are spread over with session-sticky consistent hashing: a sample's requests always go to the
same server, and adding a server moves only about 1/N of the sessions.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import hashlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fsm_rollout import gc_policy, lifecycle
from fsm_rollout.config import DEFAULT_ENV_MODULE, RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.env import EnvFactory, load_env_factory
from fsm_rollout.errors import ConfigError, RolloutError
from fsm_rollout.hooks import RolloutHooks, RolloutView, combine_hooks
from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_writer_for
from fsm_rollout.rollout import Rollout
from fsm_rollout.sample import Sample, Status
from fsm_rollout.suspension import Suspender, SuspendStats
from fsm_rollout.trace import Tracer, get_tracer


class ConsistentHashRing:
    """Maps keys (session ids) to one of several engine URLs; stable when URLs are added or removed."""

    def __init__(self, urls: Sequence[str], *, replicas: int = 64) -> None:
        if not urls:
            raise ConfigError("at least one engine URL is needed")
        self._points: list[int] = []
        self._owners: list[str] = []
        for url in sorted(set(urls)):
            for replica in range(replicas):
                self._points.append(self._hash(f"{url}#{replica}"))
                self._owners.append(url)
        order = sorted(range(len(self._points)), key=self._points.__getitem__)
        self._points = [self._points[i] for i in order]
        self._owners = [self._owners[i] for i in order]

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def url_for(self, key: str) -> str:
        """The engine URL that owns ``key``."""
        index = bisect.bisect(self._points, self._hash(key)) % len(self._points)
        return self._owners[index]


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the runner's samples are doing right now and have done since the runner started."""

    occupancy: dict[str, int]
    """Samples per non-terminal state right now; sums to ``in_flight``."""
    in_flight: int
    dwell_ms_mean: dict[str, float]
    """Mean time samples spent in each state they left."""
    statuses: dict[str, int]
    reasons: dict[str, int]
    samples_done: int
    turns: int
    tokens_generated: int
    elapsed_s: float
    samples_per_s: float
    turns_per_s: float
    tokens_per_s: float
    suspended: int = 0
    """Samples in ``suspended`` right now (waiting out a weight update)."""
    suspensions: int = 0
    """Suspensions since the runner started (a sample suspended twice counts twice)."""
    dwell_counts: dict[str, int] = field(default_factory=dict)
    """How often samples left each state: the weights of ``dwell_ms_mean`` when snapshots are combined."""


@dataclass(eq=False)
class _Metrics(RolloutHooks):
    started: float = field(default_factory=time.perf_counter)
    occupancy: Counter[str] = field(default_factory=Counter)
    dwell_sum: Counter[str] = field(default_factory=Counter)
    dwell_count: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    turns: int = 0
    tokens_generated: int = 0
    done: int = 0
    suspensions: int = 0

    active: set[Rollout] = field(default_factory=set)
    """The runner's rollouts that have not ended (each leaves the set at its terminal transition)."""

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        dst = rollout.state
        self.occupancy[src] -= 1
        self.dwell_sum[src] += dwell_ms  # type: ignore[assignment]
        self.dwell_count[src] += 1
        if trigger == "suspend":
            self.suspensions += 1
        if trigger == "step" and rollout.turn is not None:
            self.turns += 1
            self.tokens_generated += len(rollout.turn.token_ids)
        if dst in lifecycle.TERMINAL:
            self.statuses[dst] += 1
            self.reasons[rollout.reason or "unknown"] += 1
            self.done += 1
            self.active.discard(rollout)
        else:
            self.occupancy[dst] += 1

    def snapshot(self) -> MetricsSnapshot:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        occupancy = {state: count for state, count in self.occupancy.items() if count}
        return MetricsSnapshot(
            occupancy=occupancy,
            in_flight=sum(occupancy.values()),
            dwell_ms_mean={state: self.dwell_sum[state] / n for state, n in self.dwell_count.items() if n},
            statuses=dict(self.statuses),
            reasons=dict(self.reasons),
            samples_done=self.done,
            turns=self.turns,
            tokens_generated=self.tokens_generated,
            elapsed_s=elapsed,
            samples_per_s=self.done / elapsed,
            turns_per_s=self.turns / elapsed,
            tokens_per_s=self.tokens_generated / elapsed,
            suspended=occupancy.get("suspended", 0),
            suspensions=self.suspensions,
            dwell_counts={state: n for state, n in self.dwell_count.items() if n},
        )


def load_tokenizer(path: str) -> Any:
    """Load a Hugging Face tokenizer from a local directory or model name (imports transformers lazily)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


class RolloutRunner:
    """Runs samples through the lifecycle with shared resources (see the module docstring).

    ``engine_urls`` defaults to ``[config.engine_url]``; with several URLs each sample gets a session id and is
    pinned to one URL by consistent hashing. With ``raise_on_error=False`` (the default) a sample whose rollout
    raises ends ``failed`` with the error in ``metadata["rollout_error"]`` and the batch goes on; with True the
    error propagates. ``tape`` (default: beside the trace when ``config.record`` is on) records every sample's
    engine and environment exchanges for ``fsm-rollout replay``. ``hooks`` observe every rollout of the runner
    (after the runner's own metrics).

    Weight updates: ``async with runner.weight_update(version="7"):`` around the trainer's weight push suspends the
    runner's rollouts (none is lost: each turn in flight continues from the tokens it had), sets the engines'
    weight version and resumes them; :meth:`suspend` and :meth:`resume` are the two halves.
    ``config.weight_update_strategy`` picks how requests in flight are treated (see
    :class:`~fsm_rollout.config.RolloutConfig`). Every generated token's weight version ends up in
    ``sample.metadata["weight_version_spans"]``.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        sampling_params: Mapping[str, Any],
        tokenizer: Any = None,
        processor: Any = None,
        env_factory: EnvFactory | None = None,
        engine_urls: Sequence[str] | None = None,
        raise_on_error: bool = False,
        tracer: Tracer | None = None,
        tape: TapeWriter | None = None,
        hooks: RolloutHooks | None = None,
    ) -> None:
        self.config = config
        self.sampling_params = dict(sampling_params)
        self.tokenizer = tokenizer
        self.processor = processor
        self.env_factory = env_factory
        self.engine_urls = list(engine_urls or [config.engine_url])
        self.raise_on_error = raise_on_error
        self.tracer = tracer if tracer is not None else get_tracer(config.trace)
        self.tape = tape if tape is not None else tape_writer_for(config)
        self._ring = ConsistentHashRing(self.engine_urls)
        self._clients: dict[str, VLLMClient] = {}
        self._server_clients: dict[str, VLLMClient] = {}
        """The servers behind a router (``config.servers_behind_router``), which weight updates reach directly."""
        self._metrics = _Metrics()
        self._active = self._metrics.active
        self._hooks = combine_hooks(self._metrics, hooks)
        self._entered = False
        self.suspender = Suspender(
            lambda: self._clients.values(),
            strategy=config.weight_update_strategy,
            servers=(lambda: self._server_clients.values()) if config.servers_behind_router else None,
        )
        """The gate every rollout of this runner consults (:mod:`fsm_rollout.suspension`)."""

    async def __aenter__(self) -> RolloutRunner:
        for url in self.engine_urls:
            self._clients[url] = VLLMClient.from_config(self.config, base_url=url)
        for url in self.config.servers_behind_router:
            self._server_clients[url] = VLLMClient.from_config(self.config, base_url=url)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer_path or self.config.model)
        if self.env_factory is None:
            self.env_factory = load_env_factory(self.config.env_path or DEFAULT_ENV_MODULE)
        self._entered = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._active:
            await self.abort("shutdown")
        for client in [*self._clients.values(), *self._server_clients.values()]:
            await client.close()
        self._clients.clear()
        self._server_clients.clear()
        self.tracer.flush()
        if self.tape is not None:
            await asyncio.to_thread(self.tape.flush)
        self._entered = False

    # ------------------------------------------------------------------ building rollouts

    def _client_for(self, sample: Sample) -> VLLMClient:
        if len(self._clients) == 1:
            return next(iter(self._clients.values()))
        return self._clients[self._ring.url_for(sample.session_id or "")]

    def _rollout(self, sample: Sample, *, sample_id: str | None = None, seed: int | None = None) -> Rollout:
        if not self._entered:
            raise RolloutError("use the RolloutRunner as `async with RolloutRunner(...) as runner:`")
        if len(self._clients) > 1 and not sample.session_id:
            sample.session_id = str(uuid.uuid4())
        options: dict[str, Any] = {
            "config": self.config,
            "sampling_params": self.sampling_params if seed is None else {**self.sampling_params, "seed": seed},
            "client": self._client_for(sample),
            "tokenizer": self.tokenizer,
            "env_factory": self.env_factory,
            "processor": self.processor,
            "tracer": self.tracer,
            "sample_id": sample_id,
            "suspender": self.suspender,
        }
        if self.tape is not None:
            rollout = recorded_rollout(sample, tape=self.tape, hooks=self._hooks, **options)
        else:
            rollout = Rollout(sample, hooks=self._hooks, **options)
        self._active.add(rollout)
        self._metrics.occupancy[rollout.state] += 1
        return rollout

    async def _drive(self, rollout: Rollout) -> Sample:
        try:
            return await rollout.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            if self.raise_on_error:
                raise
            return rollout.sample

    def _gc_tuned(self) -> AbstractContextManager[None]:
        return gc_policy.rollouts_in_flight() if self.config.tune_gc else nullcontext()

    # ------------------------------------------------------------------ public API

    async def run(self, sample: Sample) -> Sample:
        """Run one sample to a terminal state and return it."""
        return await self._drive(self._rollout(sample))

    def _prepare(
        self, samples: Iterable[Sample], sample_ids: Sequence[str | None] = (), seeds: Sequence[int | None] = ()
    ) -> list[Rollout | Sample]:
        prepared: list[Rollout | Sample] = []
        for position, sample in enumerate(samples):
            try:
                sample_id = sample_ids[position] if position < len(sample_ids) else None
                seed = seeds[position] if position < len(seeds) else None
                prepared.append(self._rollout(sample, sample_id=sample_id, seed=seed))
            except Exception as error:
                if self.raise_on_error:
                    raise
                prepared.append(self._unbuildable(sample, error))
        return prepared

    def _unbuildable(self, sample: Sample, error: Exception) -> Sample:
        """A pending sample whose rollout could not be built ends ``failed`` with the error recorded (its data is
        left as it was), and counts as failed in the metrics.

        A sample that was not pending (already run, say) is not this batch's to end: its status and reason stay as
        they were and it is not counted; the error is noted under ``metadata["rollout_error"]``.
        """
        described = {"type": type(error).__name__, "message": str(error), "state": None, "trigger": None}
        metadata = dict(sample.metadata) if isinstance(sample.metadata, Mapping) else {}
        if sample.status != Status.PENDING:
            sample.metadata = {**metadata, "rollout_error": described}
            return sample
        sample.metadata = {**metadata, "rollout_error": described, "rollout_reason": "error"}
        sample.status = Status.FAILED
        self._metrics.statuses["failed"] += 1
        self._metrics.reasons["error"] += 1
        self._metrics.done += 1
        return sample

    async def _bounded(self, item: Rollout | Sample, semaphore: asyncio.Semaphore) -> Sample:
        if isinstance(item, Sample):
            return item
        async with semaphore:
            return await self._drive(item)

    async def run_batch(
        self, samples: Iterable[Sample], *, concurrency: int = 64, sample_ids: Sequence[str | None] = (),
        seeds: Sequence[int | None] = (),
    ) -> list[Sample]:
        """Run samples with at most ``concurrency`` in flight; returns them in input order.

        ``sample_ids`` name the samples in traces and tapes and ``seeds`` set each one's sampling seed, by position
        (as :meth:`run_group` names and seeds its members; :func:`group_members` makes such copies for many groups
        under one concurrency limit).
        """
        semaphore = asyncio.Semaphore(_positive(concurrency))
        with self._gc_tuned():  # from before the rollouts and their tasks are made, not from the first start
            prepared = self._prepare(samples, sample_ids, seeds)
            return list(await asyncio.gather(*(self._bounded(item, semaphore) for item in prepared)))

    def stream(
        self, samples: Iterable[Sample], *, concurrency: int = 64, sample_ids: Sequence[str | None] = ()
    ) -> AsyncIterator[Sample]:
        """Yield samples as they finish (at most ``concurrency`` in flight), for asynchronous RL trainers.

        The rollouts are made, and start, when this is called, so :meth:`abort` reaches every one of them from
        then on, also before the first is awaited. ``sample_ids`` name the samples in traces and tapes, by position
        (as :meth:`run_group` names its members). Closing the iterator early cancels the samples still running.
        """
        semaphore = asyncio.Semaphore(_positive(concurrency))
        with self._gc_tuned():
            prepared = self._prepare(samples, sample_ids)
            tasks = [asyncio.ensure_future(self._bounded(item, semaphore)) for item in prepared]
            if self.config.tune_gc:  # held on until the last task is done: tied to the tasks, not to the iterator,
                gc_policy.rollout_started()  # which its consumer may never finish
                asyncio.gather(*tasks, return_exceptions=True).add_done_callback(lambda _: gc_policy.rollout_ended())
        return _as_finished(tasks)

    async def run_group(
        self, sample: Sample, n: int, *, concurrency: int | None = None, seed: int | None = None
    ) -> list[Sample]:
        """Run ``n`` copies of a sample (a GRPO group): one group index, each copy with its own session id.

        With ``seed``, member ``m`` sends sampling seed ``seed + m`` (over the sampling parameters' own): the group
        is reproducible and its members still differ.
        """
        copies, ids = group_members(sample, n)
        semaphore = asyncio.Semaphore(_positive(concurrency or n))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {seed!r}")
        seeds = [] if seed is None else [seed + member for member in range(len(copies))]
        with self._gc_tuned():
            prepared = self._prepare(copies, ids, seeds)
            return list(await asyncio.gather(*(self._bounded(item, semaphore) for item in prepared)))

    async def abort(self, reason: str = "cancelled") -> None:
        """End every sample this runner has not finished ``aborted`` with ``reason``.

        Samples in flight have their request cancelled and named to the server; samples not started yet end
        without sending anything. When this returns, no request of those samples reaches a server any more.
        """
        waiting = []
        for rollout in list(self._active):
            if rollout.terminal:
                continue
            waiting.append(rollout.abort(reason))
        await asyncio.gather(*waiting)

    async def suspend(self, reason: str = "weight_update") -> None:
        """Suspend every rollout of this runner; returns once no generate request of the runner is in flight at any
        engine (``abort`` strategy) or every engine has frozen its requests (``keep``).

        Rollouts stepping their environment or encoding an observation carry on and suspend when they next reach
        ``generating``, before sending anything; samples that have not started, and new ``run`` calls, wait.
        """
        await self.suspender.suspend(reason)

    async def resume(self) -> None:
        """Resume every suspended rollout where it stopped, and let waiting samples start."""
        await self.suspender.resume()

    def weight_update(self, version: str | None = None) -> AbstractAsyncContextManager[None]:
        """``async with runner.weight_update(version="7"):`` suspends, runs the body (push the weights), sets every
        engine's weight version to ``version`` (when given) and resumes, also when the body raises."""
        return self.suspender.weight_update(version)

    @property
    def last_suspension(self) -> SuspendStats:
        """What the last suspension and resume cost: requests in flight, abort or pause calls, client time."""
        return self.suspender.stats

    def metrics(self) -> MetricsSnapshot:
        """A consistent snapshot of occupancy, dwell times, outcomes and throughput."""
        return self._metrics.snapshot()

    @property
    def in_flight(self) -> int:
        """Samples created by this runner that have not reached a terminal state."""
        return len(self._active)


def group_members(sample: Sample, n: int) -> tuple[list[Sample], list[str | None]]:
    """The ``n`` copies :meth:`RolloutRunner.run_group` runs for ``sample`` and the ids that name them: one group
    index (the sample's, else its index), a fresh session id each, ``metadata["group_member"]`` their position."""
    group_index = sample.group_index if sample.group_index is not None else sample.index
    copies: list[Sample] = []
    for member in range(_positive(n)):
        duplicate = copy.deepcopy(sample)
        duplicate.group_index = group_index
        duplicate.session_id = str(uuid.uuid4())
        duplicate.metadata = {**(duplicate.metadata or {}), "group_member": member}
        copies.append(duplicate)
    ids = [f"{sample.index}.{member}" if sample.index is not None else None for member in range(n)]
    return copies, ids


async def _as_finished(tasks: Sequence[asyncio.Future[Sample]]) -> AsyncIterator[Sample]:
    try:
        for finished in asyncio.as_completed(tasks):
            yield await finished
    finally:
        for task in tasks:
            task.cancel()


def _positive(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"expected a positive integer, got {value!r}")
    return value


__all__ = ["ConsistentHashRing", "MetricsSnapshot", "RolloutRunner", "group_members"]
