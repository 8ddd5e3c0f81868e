"""The embedded engine's scheduler: one worker thread runs every model and tokenizer call, off the event loop.

Generate jobs are admitted first come, first served, up to ``max_num_seqs`` at a time; the admitted ones take
turns one decode step each (round robin), each with its own KV cache and batch size 1, so a short request is not
stuck behind a long one and a request's tokens never depend on what else runs. Jobs beyond ``max_num_seqs`` wait
in a FIFO queue. Tokenizer and image tasks (render, and the check of a generate request's image features) run before
the next decode step.

An aborted or disconnected job is dropped between two decode steps: a waiting one before it starts, a running one
after the step in progress, and answered with ``finish_reason="abort"`` and the tokens it had so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fsm_rollout.engine.local.errors import LocalEngineError
from fsm_rollout.engine.local.protocol import SamplingSettings
from fsm_rollout.engine.schema import Finish

if TYPE_CHECKING:
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
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.settings = settings
        self.future: asyncio.Future[GenerationOutcome] = loop.create_future()
        self._loop = loop
        self._cancelled = threading.Event()
        self.generation: Generation | None = None

    @property
    def cancelled(self) -> bool:
        """Whether an abort or a disconnect asked for the job to stop."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the worker to stop the job at its next decode step boundary."""
        self._cancelled.set()

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


class Scheduler:
    """Runs generate jobs and tokenizer tasks on one worker thread; see the module docstring for the policy.

    ``torch_threads`` (when set) is applied with ``torch.set_num_threads`` as the worker starts; note that it is
    a process-wide setting.
    """

    def __init__(self, loaded: LoadedModel, *, max_num_seqs: int = 8, torch_threads: int | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self._loaded = loaded
        self._max_num_seqs = max_num_seqs
        self._torch_threads = torch_threads
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: deque[GenerateJob] = deque()
        self._running: deque[GenerateJob] = deque()
        self._live_lock = threading.Lock()
        self._live: list[str] = []
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

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
        with self._live_lock:
            self._live.append(job.request_id)
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
            return list(self._live)

    # ---------------------------------------------------------------- worker side

    def _work(self) -> None:
        import torch

        from fsm_rollout.engine.local.model import Generation

        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        try:
            with torch.inference_mode():
                while self._admit():
                    self._drop_cancelled_waiting()
                    while self._waiting and len(self._running) < self._max_num_seqs:
                        self._running.append(self._waiting.popleft())
                    if self._running:
                        self._advance(self._running.popleft(), Generation)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Answer everything still queued or running: jobs with "abort", tasks with an error."""
        self._closed.set()
        leftovers = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting.clear()
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

    def _admit(self) -> bool:
        """Take everything from the inbox (blocking while idle); False once stop was requested."""
        idle = not self._running and not self._waiting
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
            else:
                self._waiting.append(item)

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

    def _drop_cancelled_waiting(self) -> None:
        if any(job.cancelled for job in self._waiting):
            for job in [job for job in self._waiting if job.cancelled]:
                self._waiting.remove(job)
                self._finish(job, job.outcome("abort"))

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
        if finish is None:
            self._running.append(job)
        else:
            self._finish(job, job.outcome(finish))

    def _finish(self, job: GenerateJob, outcome: GenerationOutcome | BaseException) -> None:
        with self._live_lock:
            self._live.remove(job.request_id)
        job.resolve(outcome)
        job.generation = None  # frees the KV cache
