"""The embedded engine's scheduler: one worker thread runs every model and tokenizer call, off the event loop.

Generate jobs are admitted first come, first served, up to ``max_num_seqs`` at a time; jobs beyond it wait in a FIFO
queue. Every decode step advances each admitted job by one token: a newly admitted job runs its prompt alone (its
prefill, into its own KV cache), then joins the others, and one forward pass over all of them
(:class:`~fsm_rollout.engine.local.batch.DecodeBatch`) samples each one's next token, each from its own generator.
A request's tokens do not depend on what else runs (see :mod:`fsm_rollout.engine.local.batch` for why).
A model whose KV cache is not a plain one (sliding-window or linear-attention layers) decodes one at a time, as
does ``batched=False`` (kept for comparison): the admitted jobs take turns, one decode step each, each with batch
size 1. Rendering and the check of a generate request's image features do not run here but on the engine's front-end
thread (:mod:`fsm_rollout.engine.local.frontend`), at the same time as the decode steps.

An aborted or disconnected job is dropped between two decode steps: a waiting one before it starts, a running one
after the step in progress, and answered with ``finish_reason="abort"`` and the tokens it had so far.

Pausing (vLLM's ``/pause``) also acts between two decode steps. Every mode holds the jobs that arrive while paused in
a separate queue until :meth:`Scheduler.resume`; they are admitted behind the jobs already waiting. The modes differ
in what they do to the jobs in flight (running or waiting) when the pause lands: ``abort`` answers them at once with
``finish_reason="abort"``, ``wait`` lets them run to their end (the pause call returns when they have), ``keep``
freezes them: no decode step runs until resume, when they carry on with their KV caches. Each pause call applies its
mode to what is in flight then, so ``abort`` after ``keep`` ends the frozen jobs. Tasks run while paused.

Weights: the weight version and new parameter values are set by tasks, so they land between two decode steps; every
sampled token is labelled with the version current at its step, and a job's KV cache made with the old weights is
kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fsm_rollout.engine.local.errors import LocalEngineError
from fsm_rollout.engine.local.protocol import SamplingSettings
from fsm_rollout.engine.schema import DEFAULT_WEIGHT_VERSION, Finish, PauseMode, WeightVersionSpan

if TYPE_CHECKING:
    from fsm_rollout.engine.local.batch import DecodeBatch
    from fsm_rollout.engine.local.model import Generation, LoadedModel, TokenLogprob

__all__ = ["GenerateJob", "GenerationOutcome", "Scheduler"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class GenerationOutcome:
    """What a finished (or aborted) generate job produced."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: Finish
    stop_reason: str | int | None
    prompt_len: int
    weight_versions: list[WeightVersionSpan]
    """The weight version of every output token, as consecutive half-open spans."""


class GenerateJob:
    """One generate request on its way through the scheduler.

    ``future`` (of the event loop that created the job) receives the :class:`GenerationOutcome`, or the exception
    the model raised. :meth:`cancel` may be called from the event loop at any time.
    """

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        settings: SamplingSettings,
        loop: asyncio.AbstractEventLoop,
        on_token: Callable[[int, TokenLogprob], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.on_token = on_token
        """Called on the job's event loop with each sampled token and its logprob, in order, before the outcome
        (a streamed request's chunks)."""
        self.prompt = prompt
        self.settings = settings
        self.future: asyncio.Future[GenerationOutcome] = loop.create_future()
        self._loop = loop
        self._cancelled = threading.Event()
        self._waker: Callable[[], None] | None = None
        self._spans: list[WeightVersionSpan] = []
        self._token_count = 0
        self.generation: Generation | None = None
        self.started = False
        """Set by the worker when the job joins the running batch (before: it waits)."""

    @property
    def cancelled(self) -> bool:
        """Whether an abort or a disconnect asked for the job to stop."""
        return self._cancelled.is_set()

    @property
    def token_count(self) -> int:
        """Output tokens sampled so far (readable from any thread)."""
        return self._token_count

    def set_waker(self, waker: Callable[[], None]) -> None:
        """Called by :meth:`cancel`: the scheduler's wake-up, so that a paused worker answers the abort at once."""
        self._waker = waker

    def cancel(self) -> None:
        """Ask the worker to stop the job at its next decode step boundary."""
        self._cancelled.set()
        if self._waker is not None:
            self._waker()

    def record_token(self, version: str) -> None:
        """Count one more sampled token, made with weights of ``version`` (called from the worker thread)."""
        spans = self._spans
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] += 1
        else:
            spans.append({"version": version, "start": self._token_count, "end": self._token_count + 1})
        self._token_count += 1
        generation = self.generation
        if self.on_token is not None and generation is not None and generation.token_ids:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                self._loop.call_soon_threadsafe(self.on_token, generation.token_ids[-1], generation.logprobs[-1])

    def resolve(self, outcome: GenerationOutcome | BaseException) -> None:
        """Hand the result to the job's event loop (called from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(_settle, self.future, outcome)

    def outcome(self, finish: Finish) -> GenerationOutcome:
        """The outcome with the tokens generated so far."""
        generation = self.generation
        return GenerationOutcome(
            token_ids=list(generation.token_ids) if generation else [],
            logprobs=list(generation.logprobs) if generation else [],
            finish_reason=finish,
            stop_reason=generation.stop_reason if generation and finish == "stop" else None,
            prompt_len=len(self.prompt),
            weight_versions=[span.copy() for span in self._spans],
        )


def _settle(future: asyncio.Future[GenerationOutcome], outcome: GenerationOutcome | BaseException) -> None:
    if future.done():  # the handler was cancelled (client disconnect)
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass
class _Task:
    """A tokenizer or image-processing call to run on the worker thread."""

    call: Callable[[], Any]
    future: ThreadFuture[Any]


_STOP = object()
_WAKE = object()  # only wakes a worker blocked on its inbox, to look at cancelled jobs


class Scheduler:
    """Runs generate jobs, and the tasks that must land between two decode steps, on one worker thread; see the
    module docstring for the policy.

    ``torch_threads`` (when set) is applied with ``torch.set_num_threads`` as the worker starts; note that it is
    a process-wide setting.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_num_seqs: int = 16,
        torch_threads: int | None = None,
        batched: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self._loaded = loaded
        self._max_num_seqs = max_num_seqs
        self._torch_threads = torch_threads
        self._batched = batched
        self._batch: DecodeBatch | None = None  # made on the worker thread (it imports torch)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: deque[GenerateJob] = deque()
        self._running: deque[GenerateJob] = deque()
        self._held: deque[GenerateJob] = deque()  # arrived while paused
        self._live_lock = threading.Lock()
        self._live: list[GenerateJob] = []
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        # Written only by the worker thread; other threads read them (a single attribute read is atomic).
        self._paused = False
        self._frozen = False
        self._weight_version: str = DEFAULT_WEIGHT_VERSION
        self._drain_waiters: list[ThreadFuture[None]] = []

    # ---------------------------------------------------------------- event-loop side

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is already running")
        self._thread = threading.Thread(target=self._work, name="fsm-rollout-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every job, then end the worker thread (blocks up to ``timeout`` seconds for the current step)."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._shut_down()  # anything submitted while the worker was shutting down
        self._thread = None

    def submit(self, job: GenerateJob) -> None:
        """Queue a generate job (FIFO)."""
        if self._closed.is_set():
            raise LocalEngineError("the embedded engine is stopped")
        job.set_waker(self._wake)
        with self._live_lock:
            self._live.append(job)
        self._inbox.put(job)

    async def run_task(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` on the worker thread (before the next decode step) and return its result."""
        if self._closed.is_set():
            raise LocalEngineError("the embedded engine is stopped")
        future: ThreadFuture[_T] = ThreadFuture()
        self._inbox.put(_Task(call, future))
        return await asyncio.wrap_future(future)

    def live_request_ids(self) -> list[str]:
        """Request ids of the jobs submitted and not yet finished or dropped by the worker, in arrival order."""
        with self._live_lock:
            return [job.request_id for job in self._live]

    def live_token_counts(self) -> dict[str, int]:
        """Output tokens so far of each live job (0 while queued), by request id in arrival order; of jobs sharing
        an id, the earliest."""
        counts: dict[str, int] = {}
        with self._live_lock:
            for job in self._live:
                counts.setdefault(job.request_id, job.token_count)
        return counts

    def load(self) -> tuple[int, int, int]:
        """``(running, waiting, tokens)``: live jobs in the running batch and not yet (queued, or held by a pause),
        and the prompt and output tokens the running ones hold (their KV cache)."""
        with self._live_lock:
            running = [job for job in self._live if job.started]
            waiting = len(self._live) - len(running)
        return len(running), waiting, sum(len(job.prompt) + job.token_count for job in running)

    @property
    def paused(self) -> bool:
        """Whether a pause is in effect (from the moment the worker applied it until resume)."""
        return self._paused

    @property
    def weight_version(self) -> str:
        """The version the worker labels the tokens it samples with."""
        return self._weight_version

    async def pause(self, mode: PauseMode) -> None:
        """Pause between two decode steps (see the module docstring); with ``wait``, return once the jobs in flight
        have finished (or on resume)."""
        drained = await self.run_task(lambda: self._pause_now(mode))
        if drained is not None:
            await asyncio.wrap_future(drained)

    async def resume(self) -> None:
        """End a pause: frozen jobs carry on, held jobs queue up behind the waiting ones. Fine when not paused."""
        await self.run_task(self._resume_now)

    async def set_weight_version(self, version: str) -> None:
        """Label the tokens sampled from the next decode step on with ``version``."""
        await self.run_task(lambda: self._set_version_now(version))

    async def load_weights(self, read: Callable[[], Mapping[str, Any]], version: str | None = None) -> None:
        """Between two decode steps, call ``read`` for the new parameter values and copy them into the model (see
        :func:`~fsm_rollout.engine.local.model.load_weights`); then set ``version``, when given."""
        await self.run_task(lambda: self._load_weights_now(read, version))

    # ---------------------------------------------------------------- worker side

    def _work(self) -> None:
        import torch

        from fsm_rollout.engine.local.batch import DecodeBatch
        from fsm_rollout.engine.local.model import Generation

        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        try:
            with torch.inference_mode():
                if self._batched and DecodeBatch.supports(self._loaded):
                    self._batch = DecodeBatch(self._loaded)
                while self._admit():
                    self._drop_cancelled()
                    if not self._frozen:
                        while self._waiting and len(self._running) < self._max_num_seqs:
                            self._running.append(self._waiting.popleft())
                            self._running[-1].started = True
                        if self._batch is not None:
                            self._step_all(self._batch, Generation)
                        elif self._running:
                            self._advance(self._running.popleft(), Generation)
                    self._release_drain_waiters()
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Answer everything still queued or running: jobs with "abort", tasks with an error."""
        self._closed.set()
        leftovers = [*self._running, *self._waiting, *self._held]
        self._running.clear()
        self._waiting.clear()
        self._held.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Task):
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(LocalEngineError("the embedded engine stopped"))
            elif isinstance(item, GenerateJob):
                leftovers.append(item)
        for job in leftovers:
            self._finish(job, job.outcome("abort"))
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if waiter.set_running_or_notify_cancel():
                waiter.set_exception(LocalEngineError("the embedded engine stopped"))

    def _wake(self) -> None:
        self._inbox.put(_WAKE)

    def _admit(self) -> bool:
        """Take everything from the inbox (blocking while there is no decode step to run); False once stop was
        requested."""
        idle = self._frozen or (not self._running and not self._waiting)
        while True:
            try:
                item = self._inbox.get(block=idle)
            except queue.Empty:
                return True
            idle = False
            if item is _STOP:
                return False
            if isinstance(item, _Task):
                self._run_task(item)
            elif isinstance(item, GenerateJob):
                (self._held if self._paused else self._waiting).append(item)

    @staticmethod
    def _run_task(task: _Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            result = task.call()
        except BaseException as error:
            task.future.set_exception(error)
        else:
            task.future.set_result(result)

    def _drop_cancelled(self) -> None:
        """Answer cancelled jobs that will not reach :meth:`_advance` soon: waiting, held, and frozen ones."""
        lines = (self._waiting, self._held, self._running) if self._frozen else (self._waiting, self._held)
        for line in lines:
            if any(job.cancelled for job in line):
                for job in [job for job in line if job.cancelled]:
                    line.remove(job)
                    self._finish(job, job.outcome("abort"))

    def _pause_now(self, mode: PauseMode) -> ThreadFuture[None] | None:
        """Apply a pause (a task: runs between two decode steps); for ``wait``, the future that settles once
        nothing is in flight."""
        self._paused = True
        if mode == "abort":
            self._frozen = False
            in_flight = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
            for job in in_flight:
                self._finish(job, job.outcome("abort"))
            return None
        if mode == "keep":
            self._frozen = True
            return None
        self._frozen = False
        drained: ThreadFuture[None] = ThreadFuture()
        self._drain_waiters.append(drained)
        self._release_drain_waiters()
        return drained

    def _resume_now(self) -> None:
        self._paused = False
        self._frozen = False
        self._waiting.extend(self._held)
        self._held.clear()
        self._release_drain_waiters(force=True)  # no longer paused: a "wait" pause has nothing left to wait for

    def _release_drain_waiters(self, *, force: bool = False) -> None:
        if not self._drain_waiters or not (force or (not self._running and not self._waiting)):
            return
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if waiter.set_running_or_notify_cancel():  # False: the pause call was cancelled
                waiter.set_result(None)

    def _set_version_now(self, version: str) -> None:
        self._weight_version = version

    def _load_weights_now(self, read: Callable[[], Mapping[str, Any]], version: str | None) -> None:
        from fsm_rollout.engine.local.model import load_weights

        load_weights(self._loaded, read())
        if version is not None:
            self._weight_version = version

    def _advance(self, job: GenerateJob, generation_class: type[Generation]) -> None:
        """One decode step of ``job``; it goes to the back of the line unless it finished."""
        if job.cancelled:
            self._finish(job, job.outcome("abort"))
            return
        try:
            if job.generation is None:
                job.generation = generation_class(self._loaded, job.prompt, job.settings)
            finish = job.generation.step()
        except Exception as error:
            self._finish(job, error)
            return
        job.record_token(self._weight_version)
        if finish is None:
            self._running.append(job)
        else:
            self._finish(job, job.outcome(finish))

    def _step_all(self, batch: DecodeBatch, generation_class: type[Generation]) -> None:
        """One decode step of every running job: the batch's jobs sample their next token from one forward pass,
        then the newly admitted ones run their prefill and join the batch (for the next step)."""
        members = [job for job in self._running if job.generation is not None]
        newcomers = [job for job in self._running if job.generation is None]
        for job in [job for job in members if job.cancelled]:
            members.remove(job)
            self._end(job, job.outcome("abort"))
        if members:
            try:
                finishes = batch.step()
            except Exception as error:
                for job in members:
                    self._end(job, error)
                members = []
            else:
                by_generation = {id(job.generation): job for job in members}
                for generation, finish in zip(list(batch.generations), finishes, strict=True):
                    job = by_generation[id(generation)]
                    job.record_token(self._weight_version)
                    if finish is not None:
                        self._end(job, job.outcome(finish))
        for job in newcomers:
            if job.cancelled:
                self._end(job, job.outcome("abort"))
                continue
            try:
                generation = job.generation = generation_class(self._loaded, job.prompt, job.settings)
                finish = generation.step()
            except Exception as error:
                self._end(job, error)
                continue
            job.record_token(self._weight_version)
            if finish is None:
                batch.add(generation)
            else:
                self._end(job, job.outcome(finish))

    def _end(self, job: GenerateJob, outcome: GenerationOutcome | BaseException) -> None:
        """Answer a running job of the batched engine (it leaves the running line)."""
        self._running.remove(job)
        self._finish(job, outcome)

    def _finish(self, job: GenerateJob, outcome: GenerationOutcome | BaseException) -> None:
        with self._live_lock:
            self._live.remove(job)
        job.resolve(outcome)
        if self._batch is not None and job.generation is not None:
            self._batch.discard(job.generation)
        job.generation = None  # frees the KV cache
