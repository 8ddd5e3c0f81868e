"""The fake vLLM server's waiting generate requests: holds (a turn's ``hang`` or ``delay``), waits for resume,
what a pause mode does to them, aborts and releases, and the watchers a test waits on instead of sleeping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fsm_rollout.engine.schema import sent_request_id


@dataclass(eq=False)
class Waiter:
    """A generate request waiting at the server: ``held`` by its turn (hang or delay), or waiting for resume.

    ``frozen`` while a ``keep`` pause stops its clock; ``resumed_version`` is the weight version current when a
    ``keep`` pause last let it go on.
    """

    request_id: str
    held: bool
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    released: bool = False
    frozen: bool = False
    resumed_version: str | None = None

    def abort(self) -> None:
        """End the wait as aborted; a frozen request too."""
        self.aborted = True
        self.frozen = False
        self.wake.set()


class WaitingRoom:
    """The generate requests waiting at one fake server, the pause mode in force, and the watchers of both.

    ``on_disconnect`` is told the id of a waiting request whose client went away (its handler was cancelled)
    while the room is not stopping.
    """

    def __init__(self, on_disconnect: Callable[[str], None]) -> None:
        self.waiters: list[Waiter] = []
        """The waiting requests, in the order they began to wait."""
        self._on_disconnect = on_disconnect
        self._watchers: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._pause_mode: str | None = None
        self._stopping = False

    @property
    def pause_mode(self) -> str | None:
        """The mode of the pause in force (``abort``, ``wait`` or ``keep``), None when not paused."""
        return self._pause_mode

    @property
    def stopping(self) -> bool:
        """Whether the server is stopping: every wait ends, answered ``abort``."""
        return self._stopping

    def open(self) -> None:
        """Let requests wait again (the server started)."""
        self._stopping = False

    def stop(self) -> None:
        """End every wait (the server stops)."""
        self._stopping = True
        for waiter in self.waiters:
            waiter.wake.set()

    def release(self, request_id: str) -> int:
        """Let the held requests with this id (either id form) finish; returns how many were released."""
        names = {request_id, sent_request_id(request_id)}
        released = 0
        for waiter in self.waiters:
            if waiter.held and waiter.request_id in names:
                waiter.released = True
                waiter.wake.set()
                released += 1
        return released

    def abort(self, request_id: str) -> None:
        """Abort the held requests with this id, as sent or vLLM's prefixed form."""
        names = {request_id, sent_request_id(request_id)}
        for waiter in self.waiters:
            if waiter.held and waiter.request_id in names:
                waiter.abort()

    def abort_held(self) -> None:
        """Abort every held request (``/pause?mode=abort``)."""
        for waiter in self.waiters:
            if waiter.held:
                waiter.abort()

    def set_pause_mode(self, mode: str | None, weight_version: str) -> None:
        """Pause in ``mode`` (None: resume): ``keep`` freezes the held requests, any other change lets frozen ones go
        on under ``weight_version``, and resuming wakes the requests waiting for it."""
        # Synchronous with the handler, so a version set right after /resume cannot reach a frozen request.
        self._pause_mode = mode
        for waiter in self.waiters:
            if waiter.held:
                if mode == "keep":
                    waiter.frozen = True
                elif waiter.frozen:
                    waiter.frozen = False
                    waiter.resumed_version = weight_version
                waiter.wake.set()
            elif mode is None:
                waiter.wake.set()
        self.changed()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; it is checked now and after every :meth:`changed`."""
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watcher = (predicate, future)
        self._watchers.append(watcher)
        try:
            await future
        finally:
            self._watchers.remove(watcher)

    def changed(self) -> None:
        """Wake the :meth:`wait_until` callers whose condition holds now."""
        for predicate, future in self._watchers:
            if not future.done() and predicate():
                future.set_result(None)

    async def hold(self, waiter: Waiter, delay: float | None) -> bool:
        """Wait ``delay`` seconds (forever if None) or until released; True when the request was aborted first (or
        the server stops).

        A ``keep`` pause stops the delay's clock until the pause ends. A client that disconnects meanwhile
        cancels the handler (``handler_cancellation=True``): ``on_disconnect`` is told and the cancellation goes
        on.
        """
        loop = asyncio.get_running_loop()
        remaining = delay
        waiter.frozen = self._pause_mode == "keep"
        async with self._waiting(waiter):
            while not (waiter.aborted or self._stopping):
                waiter.wake.clear()
                if waiter.released and not waiter.frozen:
                    return False
                if waiter.frozen or remaining is None:
                    await waiter.wake.wait()
                    continue
                started = loop.time()
                try:
                    await asyncio.wait_for(waiter.wake.wait(), remaining)
                except TimeoutError:
                    return False
                remaining = max(0.0, remaining - (loop.time() - started))
            return True

    async def wait_for_resume(self, request_id: str) -> None:
        """Wait until the pause ends (or the server stops)."""
        waiter = Waiter(request_id, held=False)
        async with self._waiting(waiter):
            while self._pause_mode is not None and not self._stopping:
                waiter.wake.clear()
                await waiter.wake.wait()

    @contextlib.asynccontextmanager
    async def _waiting(self, waiter: Waiter) -> AsyncIterator[None]:
        self.waiters.append(waiter)
        self.changed()
        try:
            yield
        except asyncio.CancelledError:
            if not self._stopping:
                self._on_disconnect(waiter.request_id)
            raise
        finally:
            self.waiters.remove(waiter)
            self.changed()
