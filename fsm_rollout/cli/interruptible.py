"""Internal: how the CLI's long-running commands run their event loop so that a Ctrl-C ends the process at once.

``asyncio.run`` joins its default executor's threads before it returns, and the interpreter joins a
``ThreadPoolExecutor``'s workers before it exits. A Ctrl-C while such a thread is in a long native call (loading
the engine's model, importing torch) would hold the exit until the call returns, 10-20 s on a loaded machine.
The commands run on a default executor of daemon threads instead, which a Ctrl-C abandons: what those threads do
while a command starts only reads (models, tokenizers); the model build, which writes the cache, stops its child
and removes what it staged by itself (``run_engine.build_embedded_model``). Only the CLI asks for this: the library
never changes a loop's executor.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["EXIT_INTERRUPTED", "DaemonExecutor", "run_interruptibly"]

EXIT_INTERRUPTED = 130
"""What a shell shows for a process that SIGINT ended."""

_T = TypeVar("_T")
_STOP = None


class DaemonExecutor(ThreadPoolExecutor):
    """A thread pool of daemon threads; :meth:`shutdown` waits for the calls still running unless :meth:`abandon`
    was called first.

    It subclasses ``ThreadPoolExecutor`` because ``loop.set_default_executor`` takes only those; none of the
    base class's workers is ever started (they would be joined at the interpreter's exit).
    """

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(max_workers=1)
        self._limit = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None]
        self._work = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._workers: list[threading.Thread] = []
        self._guard = threading.Lock()
        self._closed = False
        self._abandoned = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        with self._guard:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(timeout=0) and len(self._workers) < self._limit:
                worker = threading.Thread(target=self._serve, name=f"fsm-rollout-cli-{len(self._workers)}", daemon=True)
                self._workers.append(worker)
                worker.start()
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not _STOP:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # handed to the awaiting coroutine, as ThreadPoolExecutor does
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del item, future, fn, args, kwargs  # hold nothing of a finished call while idle
            self._idle.release()

    def abandon(self) -> None:
        """Let :meth:`shutdown` return without waiting for the calls still running (their threads are daemons)."""
        self._abandoned = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._guard:
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in workers:
            self._work.put(_STOP)
        if wait and not self._abandoned:
            for worker in workers:
                worker.join()
        super().shutdown(wait=False)


def run_interruptibly(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(main)`` on a :class:`DaemonExecutor`: when ``main`` ends by a cancellation (the commands cancel
    their own task on SIGINT while starting) or a ``KeyboardInterrupt``, the loop closes without waiting for the
    executor's threads, and the exception propagates."""
    executor = DaemonExecutor()

    async def on_daemon_threads() -> _T:
        asyncio.get_running_loop().set_default_executor(executor)
        try:
            return await main
        except (asyncio.CancelledError, KeyboardInterrupt):
            executor.abandon()
            raise

    return asyncio.run(on_daemon_threads())
