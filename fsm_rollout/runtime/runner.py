"""RolloutRunner: many samples through the lifecycle with shared resources, bounded concurrency, abort and metrics.

One runner owns what samples share: the HTTP client(s), the tokenizer, the loaded environment module, the trace
sink and the machine definition (module-level, shared by every rollout). Use it as an async context manager::

    async with RolloutRunner(config, sampling_params=sampling) as runner:
        samples = await runner.run_batch(samples, concurrency=64)

Several engine URLs are spread over with session-sticky consistent hashing: a sample's requests always go to the
same server, and adding a server moves only about 1/N of the sessions.

Why this module is long: it is one class whose methods share the run's state (the tokenizer and encoder, the
suspension gate, the trace and tape it holds, the rollouts in flight); what is not that state lives beside it: the
engine clients (:mod:`~fsm_rollout.runtime.clients`), the samples waiting for a slot and the group sampling of a
batch (:mod:`~fsm_rollout.runtime.scheduling`, :mod:`~fsm_rollout.runtime.sampling`), staleness pacing
(:mod:`~fsm_rollout.runtime.staleness`), :mod:`~fsm_rollout.runtime.queueing`, :mod:`~fsm_rollout.runtime.metrics`,
:mod:`~fsm_rollout.runtime.groups` and :mod:`~fsm_rollout.runtime.engine_check`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import replace
from types import TracebackType
from typing import Any

from fsm_rollout.config import DEFAULT_ENV_MODULE, RolloutConfig, build_inference_sampling_params
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.envs.protocol import EnvFactory, load_env_factory
from fsm_rollout.errors import RolloutError
from fsm_rollout.hooks import RolloutHooks, combine_hooks
from fsm_rollout.machine import lifecycle
from fsm_rollout.recording import SampleRecorder, TapeWriter, recorded_rollout, release_tape_writer, tape_writer_for
from fsm_rollout.rollout import Rollout
from fsm_rollout.rollout.handle import RolloutHandle
from fsm_rollout.rollout.unbuilt import UnbuiltRollout
from fsm_rollout.runtime import gc_policy, start_up
from fsm_rollout.runtime.admission import Admission, start_admission
from fsm_rollout.runtime.clients import EngineClients
from fsm_rollout.runtime.engine_check import check_engines
from fsm_rollout.runtime.groups import group_members as group_members
from fsm_rollout.runtime.groups import group_seeds as group_seeds
from fsm_rollout.runtime.groups import positive_count
from fsm_rollout.runtime.metrics import MetricsSnapshot, RunnerMetrics
from fsm_rollout.runtime.queueing import QueueNotingTracer, Waiting
from fsm_rollout.runtime.sampling import GroupStream, GroupTarget, KeepGroup
from fsm_rollout.runtime.scheduling import NOT_STARTED, SampleQueue, as_finished
from fsm_rollout.runtime.staleness import StalenessGate
from fsm_rollout.sample import Sample, Status
from fsm_rollout.tokens.chat import ObservationEncoder
from fsm_rollout.tokens.template_probe import HistoryPolicyChooser
from fsm_rollout.tokens.tokenizers import TokenizerSource, listed_tokenizer_source, load_tokenizer
from fsm_rollout.trace import NULL_TRACER, Tracer, hold_tracer, release_tracer
from fsm_rollout.types import RenderedPrompt, ServedModel
from fsm_rollout.weights.suspension import Suspender, SuspendStats


class RolloutRunner:
    """Runs samples through the lifecycle with shared resources (see the module docstring).

    ``engine_urls`` defaults to ``[config.engine_url]``; with several URLs each sample gets a session id and is
    pinned to one URL by consistent hashing. With ``raise_on_error=False`` (the default) a sample whose rollout
    raises ends ``failed`` with the error in ``metadata["rollout_error"]`` and the batch goes on; with True the
    error propagates. ``tape`` (default: beside the trace when ``config.record`` is on) records every sample's
    engine and environment exchanges for ``fsm-rollout replay``. ``hooks`` observe every rollout of the runner
    (after the runner's own metrics). It implements :class:`~fsm_rollout.runtime.service.RolloutService`.

    Entering it loads the tokenizer unless ``tokenizer`` is given: from ``config.tokenizer_path``, else from what
    the first engine names in ``GET /v1/models``, from local files only (:mod:`fsm_rollout.tokens.tokenizers`; a
    :class:`~fsm_rollout.errors.TokenizerNotFoundError` naming ``tokenizer_path`` otherwise). That load and the
    chat template's probe run in a thread of their own, but building a fast tokenizer holds the GIL for its whole
    load, so the loop's other tasks wait for it. Call :meth:`prepare` before the loop starts to do that work
    there: entering a prepared runner then only checks the engines. A
    tokenizer loaded from a local directory is shared by the process's runners on the same unchanged files
    (:func:`~fsm_rollout.tokens.tokenizers.shared_tokenizer`), so only the first load costs.

    A batch, group or stream queues its samples and makes each one's rollout when it gets a concurrency slot: the
    wait is ``queued_ms`` on its first transition and in :meth:`metrics`, apart from the ``pending`` dwell. An
    abort ends the samples still queued ``aborted`` with reason :data:`NOT_STARTED`.

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
        build_inference_sampling_params(self.sampling_params)  # bad values fail here, not at the first rollout
        self.tokenizer = tokenizer
        self.processor = processor
        self.env_factory = env_factory
        self.engine_urls = list(engine_urls or [config.engine_url])
        self.raise_on_error = raise_on_error
        # The trace file and tape this runner opened itself are let go when it exits (closed, and the tape's thread
        # ended, unless another owner still holds them); the ones passed in stay their owner's.
        self._owns_sinks, self._holding_sinks = (tracer is None, tape is None), False
        self.tracer, self.tape = tracer or NULL_TRACER, tape
        self._hold_sinks()
        self._engines = EngineClients(config, self.engine_urls)
        self._clients = self._engines.clients
        self._metrics = RunnerMetrics()
        self._active = self._metrics.active
        self._waiting = self._metrics.waiting
        self._encoder: ObservationEncoder | None = None
        self._history = HistoryPolicyChooser(config.history_policy, config.apply_chat_template_kwargs)
        self.history_policy: str | None = None
        self._configs: dict[str, RolloutConfig] = {}
        """The history policy of samples without tools, resolved from the template probe on entering."""
        self.served_models: list[ServedModel] | None = None
        """The first engine's model list as it answered when the runner was entered (None: no list, or not yet)."""
        self._hooks = combine_hooks(self._metrics, hooks)
        self._entered = False
        self._prepared = False
        self._admission: Admission | None = None
        """Adaptive admission, once entered with ``config.admission="adaptive"`` and every server's load read."""
        self.suspender = Suspender(
            lambda: self._engines.clients.values(),
            strategy=config.weight_update_strategy,
            servers=(lambda: self._engines.servers.values()) if config.servers_behind_router else None,
        )
        """The gate every rollout of this runner consults (:mod:`fsm_rollout.weights.suspension`)."""
        self._staleness = StalenessGate(
            config.max_staleness,
            lambda: next(reversed(self.suspender.version_history), None),  # set by weight updates, not an engine's own
            lambda: self.tracer,
        )
        self._queue = SampleQueue(
            metrics=self._metrics,
            staleness=self._staleness,
            make=self._rollout,
            drive=self._drive,
            unbuildable=self._unbuildable,
            url_for=self._engines.url_for,
            admission=lambda: self._admission,
            entered=lambda: self._entered,
            raising=lambda: self.raise_on_error,
            tracer=lambda: self.tracer,
        )

    def _hold_sinks(self) -> None:
        owns_tracer, owns_tape = self._owns_sinks
        if not self._holding_sinks:
            self.tracer = hold_tracer(self.config.trace) if owns_tracer else self.tracer
            self.tape = tape_writer_for(self.config, hold=True) if owns_tape else self.tape
            self._holding_sinks = True

    async def _release_sinks(self) -> None:
        owns_tracer, owns_tape = self._owns_sinks
        if self._holding_sinks:
            self._holding_sinks = False
            release_tracer(self.tracer) if owns_tracer else self.tracer.flush()
            if self.tape is not None:
                await asyncio.to_thread(release_tape_writer if owns_tape else TapeWriter.flush, self.tape)

    def prepare(self) -> RolloutRunner:
        """Do entering's blocking work now, before the event loop runs: load the environment module, the tokenizer
        (asking the first engine which, without ``config.tokenizer_path``) and probe the chat template. Entering
        the runner afterwards only checks the engines, so it keeps the loop's other tasks running. Blocking: it
        refuses to run on a thread whose event loop is running; returns the runner."""
        start_up.refuse_on_running_loop("RolloutRunner.prepare()")
        if self.env_factory is None:
            self.env_factory = load_env_factory(self.config.env_path or DEFAULT_ENV_MODULE)
        source = None if self.tokenizer is not None else start_up.tokenizer_source_now(self.config, self.engine_urls)
        self.tokenizer, self._encoder = self._tokenizer_and_encoder(source)
        self._prepared = True
        return self

    async def __aenter__(self) -> RolloutRunner:
        self._hold_sinks()  # again, when entered after an exit
        self._engines.open()
        try:
            if self.env_factory is None:  # a configuration error, found before anything is asked of an engine
                self.env_factory = load_env_factory(self.config.env_path or DEFAULT_ENV_MODULE)
            # an engine that does not answer fails the start, as the CLI's does, not every sample afterwards
            served = await check_engines(self.engine_urls, self.config)
            self.served_models = served if isinstance(served, list) else None
            if not self._prepared:
                source = None if self.tokenizer is not None else listed_tokenizer_source(
                    self.config, self.engine_urls[0], served)  # fmt: skip
                # a thread of its own lets the loop run the Python parts (the template probe); a tokenizer build
                # still holds the GIL throughout (see the class docstring: prepare() takes it off the loop)
                self.tokenizer, self._encoder = await start_up.in_own_thread(
                    lambda: self._tokenizer_and_encoder(source)
                )
            self._admission = await start_admission(self.config, self.engine_urls)
        except BaseException:
            await self._close_clients()
            await self._release_sinks()
            raise
        self._entered = True
        return self

    def _tokenizer_and_encoder(self, source: TokenizerSource | None) -> tuple[Any, ObservationEncoder]:
        """The tokenizer (loaded from ``source`` unless given) and its observation encoder with the template probe
        of samples without tools done. Blocking: runs in a worker thread."""
        tokenizer = self.tokenizer
        if source is not None:
            tokenizer = source.load(model=self.config.model, trust_remote_code=self.config.trust_remote_code)
        encoder = ObservationEncoder(tokenizer)
        # the template probe and the history policy of samples without tools (AppendRefused ends the start-up)
        self.history_policy = self._history.resolve(tokenizer)
        return tokenizer, encoder

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._active or self._waiting:
            await self.abort("shutdown")
        await self._close_clients()
        try:
            await self._release_sinks()
        finally:
            self._entered = False

    async def _close_clients(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            await admission.close()
        await self._engines.close()

    # ------------------------------------------------------------------ building rollouts

    def _config_under(self, policy: str) -> RolloutConfig:
        """The config with ``history_policy`` resolved to ``policy``, made once per policy."""
        config = self._configs.get(policy)
        if config is None:
            config = self._configs[policy] = replace(self.config, history_policy=policy)
        return config

    def engine_client(self, url: str) -> VLLMClient:
        """The client this runner sends the engine at ``url`` through (while entered), e.g. to wrap its transport."""
        return self._clients[url]

    @property
    def streams_tokens(self) -> bool:
        """Whether generate requests can stream from every engine (:attr:`VLLMClient.streams`): a gateway's streamed
        answers then go out as they are generated, else whole."""
        return bool(self._clients) and all(client.streams for client in self._clients.values())

    async def render(self, payload: Mapping[str, Any], *, session_id: str | None = None) -> RenderedPrompt:
        """The engine's render of a chat request outside any rollout (not on the tape), on the engine a sample of
        ``session_id`` is pinned to: what a rollout's first render of the same payload answers."""
        if not self._entered:
            raise RolloutError("use the RolloutRunner as `async with RolloutRunner(...) as runner:`")
        headers = {"x-session-id": session_id} if session_id else None
        return await self._engines.at(session_id).render(payload, headers=headers)

    def _rollout(
        self,
        sample: Sample,
        *,
        sample_id: str | None = None,
        seed: int | None = None,
        queued_ms: float | None = None,
        admitted_ms: float | None = None,
        staleness_ms: float | None = None,
    ) -> Rollout:
        if not self._entered:
            raise RolloutError("use the RolloutRunner as `async with RolloutRunner(...) as runner:`")
        url = self._engines.url_for(sample)
        tools = sample.metadata.get("tools") if isinstance(sample.metadata, Mapping) else None
        # a tool set not seen yet is probed once (AppendRefused fails the sample); the rollout runs the policy chosen
        policy = self._history.resolve(self.tokenizer, tools) if tools else self.history_policy
        options: dict[str, Any] = {
            "config": self._config_under(policy or self.config.history_policy),
            "sampling_params": self.sampling_params if seed is None else {**self.sampling_params, "seed": seed},
            "client": self._clients[url],
            "tokenizer": self.tokenizer,
            "encoder": self._encoder,
            "env_factory": self.env_factory,
            "processor": self.processor,
            "tracer": self.tracer if queued_ms is None else QueueNotingTracer(self.tracer, queued_ms, staleness_ms),
            "sample_id": sample_id,
            "suspender": self.suspender,
        }
        point = options["admission"] = None if self._admission is None else self._admission.point(url)
        if self.tape is not None:
            rollout = recorded_rollout(sample, tape=self.tape, hooks=self._hooks, **options)
        else:
            rollout = Rollout(sample, hooks=self._hooks, **options)
        if point is not None and admitted_ms is not None:  # a new sample's slot, held up to its first answer
            point.hold(admitted_ms)
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

    def start(self, sample: Sample, *, sample_id: str | None = None) -> RolloutHandle:
        """Start one sample's rollout as a task, now, and return its :class:`RolloutHandle` (``await handle`` gives
        the finished sample; ``handle.abort(reason)`` ends it). Runs outside :meth:`run_batch`'s concurrency slots."""
        rollout = self._rollout(sample, sample_id=sample_id)
        return RolloutHandle(rollout, asyncio.ensure_future(self._drive(rollout)))

    @property
    def encoder(self) -> ObservationEncoder | None:
        """The observation encoder the runner's rollouts share (None before ``async with``)."""
        return self._encoder

    @property
    def counters(self) -> RunnerMetrics:
        """The runner's live counters, which :meth:`metrics` snapshots (a gateway counts its sessions there)."""
        return self._metrics

    def _unbuildable(self, waiting: Waiting, error: Exception) -> Sample:
        """A pending sample whose rollout could not be built leaves ``pending`` by the table's ``fail`` edge
        (:class:`~fsm_rollout.rollout.unbuilt.UnbuiltRollout`): the error recorded, its data kept, the transition
        traced, recorded on the tape and counted in the metrics.

        A sample that was not pending (already run, say) is not this batch's to end: its status and reason stay as
        they were and it is not counted; the error is noted under ``metadata["rollout_error"]``.
        """
        sample = waiting.sample
        if sample.status != Status.PENDING:
            described = {"type": type(error).__name__, "message": str(error), "state": None, "trigger": None}
            metadata = dict(sample.metadata) if isinstance(sample.metadata, Mapping) else {}
            sample.metadata = {**metadata, "rollout_error": described}
            return sample
        recorder = None
        if self.tape is not None:
            recorder = SampleRecorder(self.tape, config=self.config, sampling_params=self.sampling_params)
        unbuilt = UnbuiltRollout(
            sample,
            error,
            config=self.config,
            tokenizer=self.tokenizer,
            tracer=self.tracer,
            hooks=combine_hooks(recorder, self._hooks),
            sample_id=waiting.sample_id,
        )
        if recorder is not None:
            recorder.begin(unbuilt)
        self._metrics.occupancy[lifecycle.INITIAL] += 1  # as a built rollout is counted, until its transition
        return unbuilt.fail()

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
        """Run samples with at most ``concurrency`` in flight; returns them in input order.

        ``sample_ids`` name the samples in traces and tapes and ``seeds`` set each one's sampling seed, by position
        (as :meth:`run_group` names and seeds its members; :func:`group_members` makes such copies for many groups
        under one concurrency limit). A sample's rollout is made when it gets a slot: the time it waited is its
        first transition's ``queued_ms`` and :attr:`MetricsSnapshot.queued_ms_mean`, not ``pending`` dwell.

        Over-sampling and dynamic sampling (:mod:`fsm_rollout.runtime.sampling`): with ``target_groups=N`` the
        samples are groups (by ``group_index``), the first N + ``oversample`` start, and the batch ends once N are
        complete and kept by ``keep_group`` (default: all); the surplus ends ``aborted`` with reason
        ``oversampled``. The answer is then a :class:`~fsm_rollout.runtime.sampling.SampledBatch`: the samples of
        the groups started (``metadata["group_kept"]``), with ``prompts_exhausted`` set when the groups ran out.
        """
        target = GroupTarget.of(target_groups, oversample, keep_group)
        semaphore = asyncio.Semaphore(positive_count(concurrency))
        with self._gc_tuned():  # from before the samples' tasks are made, not from the first start
            if target is not None:
                sampling, started = self._queue.sampling(samples, sample_ids, seeds, target, semaphore)
                await sampling.run()
                return sampling.batch([item.sample for item in sorted(started, key=started.__getitem__)])
            prepared = self._queue.prepare(samples, sample_ids, seeds)
            return list(await asyncio.gather(*(self._queue.bounded(item, semaphore) for item in prepared)))

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
        """Yield samples as they finish (at most ``concurrency`` in flight), for asynchronous RL trainers.

        The samples are queued, and the first ``concurrency`` start, when this is called, so :meth:`abort` reaches
        every one of them from then on, also before the first is awaited. ``sample_ids`` and ``seeds`` name and
        seed the samples by position (as in :meth:`run_batch`). Closing the iterator early cancels the samples
        still running and ends those still queued (reason :data:`NOT_STARTED`).

        ``target_groups``, ``oversample`` and ``keep_group`` sample groups as in :meth:`run_batch`; a group's
        members are then yielded together once its fate is known, and the iterator (a
        :class:`~fsm_rollout.runtime.sampling.GroupStream`) has ``prompts_exhausted``.
        """
        target = GroupTarget.of(target_groups, oversample, keep_group)
        semaphore = asyncio.Semaphore(positive_count(concurrency))
        if target is not None:
            sampling, started = self._queue.sampling(samples, sample_ids, seeds, target, semaphore)
            return GroupStream(sampling, lambda: self._queue.end_all_unstarted(started))
        with self._gc_tuned():
            prepared = self._queue.prepare(samples, sample_ids, seeds)
            tasks = [asyncio.ensure_future(self._queue.bounded(item, semaphore)) for item in prepared]
            if self.config.tune_gc:  # held on until the last task is done: tied to the tasks, not to the iterator,
                gc_policy.rollout_started()  # which its consumer may never finish
                asyncio.gather(*tasks, return_exceptions=True).add_done_callback(lambda _: gc_policy.rollout_ended())
        # closed early: the samples still queued end at once (not when their cancelled tasks next run)
        return as_finished(tasks, lambda: self._queue.end_all_unstarted(prepared))

    async def run_group(
        self, sample: Sample, n: int, *, concurrency: int | None = None, seed: int | None = None
    ) -> list[Sample]:
        """Run ``n`` copies of a sample (a GRPO group): one group index, each copy with its own session id.

        With ``seed``, member ``m`` sends sampling seed ``seed + m`` (over the sampling parameters' own): the group
        is reproducible and its members still differ.
        """
        copies, ids = group_members(sample, n)
        semaphore = asyncio.Semaphore(positive_count(concurrency or n))
        seeds = group_seeds(seed, len(copies))
        with self._gc_tuned():
            prepared = self._queue.prepare(copies, ids, seeds)
            return list(await asyncio.gather(*(self._queue.bounded(item, semaphore) for item in prepared)))

    async def abort(self, reason: str = "cancelled") -> None:
        """End every sample this runner has not finished ``aborted`` with ``reason``.

        Samples in flight have their request cancelled and named to the server. Samples still waiting for a
        concurrency slot end without sending anything, with reason :data:`NOT_STARTED` (they hold nothing but
        their input). When this returns, no request of those samples reaches a server any more.
        """
        self._queue.aborts += 1  # no group of an over-sampled batch starts after this
        self._queue.end_all_unstarted(self._waiting)
        waiting = []
        for rollout in list(self._active):
            if rollout.terminal:
                continue
            waiting.append(rollout.abort(reason))
        await asyncio.gather(*waiting)

    async def abort_samples(self, samples: Iterable[Sample], reason: str) -> None:
        """End these samples of the runner's batches, groups or streams ``aborted`` with ``reason`` (queued ones
        without sending anything); the others go on. A Ray pool's over-sampling ends its surplus this way."""
        await self._queue.end_samples(samples, reason)

    def consumed(self, version: int | str) -> None:
        """The trainer has consumed the samples of weight version ``version`` (and older): under
        ``config.max_staleness`` new groups start while the weights are at most that many versions ahead of it
        (:mod:`fsm_rollout.runtime.staleness`); the groups held back start now if they may."""
        self._staleness.consumed(version)

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
    def pacing(self) -> StalenessGate:
        """Staleness pacing (``config.max_staleness``): the version consumed, the groups that waited, those waiting."""
        return self._staleness

    @property
    def admission(self) -> Admission | None:
        """Adaptive admission, when ``config.admission`` asks for it and every server publishes its load."""
        return self._admission

    @property
    def in_flight(self) -> int:
        """Samples whose rollout has started (or is made and about to) and not ended; those still waiting for a
        concurrency slot are :attr:`queued`."""
        return len(self._active)

    @property
    def queued(self) -> int:
        """Samples of a batch, group or stream waiting for a concurrency slot."""
        return len(self._waiting)


__all__ = [
    "NOT_STARTED",
    "MetricsSnapshot",
    "RolloutRunner",
    "group_members",
    "group_seeds",
    "load_tokenizer",
]
