"""Internal: adaptive admission (``RolloutConfig.admission = "adaptive"``): generate requests, not samples, are
admitted, from the engine's load as it publishes it (:mod:`fsm_rollout.engine.load`).

Fixed admission keeps ``concurrency`` samples in flight, and a sample waiting on its environment or agent holds its
slot while the engine has nothing to do for it. Here a slot is one generate request at one server: a rollout asks
for one on the edges into ``generating`` (the table's ``admit_request``, awaited on the way in) and gives it back
when the answer is in, so a sample stepping its environment holds none. A batch's sample not yet started asks for
one before its rollout is made, and keeps it through its environment's reset and render up to its first answer.

Each server has an :class:`AdmissionController` (a session stays on its server, so load is read per server). It
keeps a window of requests in flight and reads the server's ``/metrics`` while it has work:

* the engine's waiting queue above ``admission_max_waiting`` or its KV use at ``admission_kv_target`` or more:
  nothing is admitted, and the window shrinks to what is in flight;
* new preemptions: the window halves (vLLM is recomputing KV it dropped: it was flooded);
* else, when the window is what holds requests back, it grows by the room left in the waiting queue (less the
  requests admitted that the engine has not seen yet), so that the engine always has the next requests queued, and
  no more.

An engine in this process (registered with :func:`~fsm_rollout.engine.load.register_local`, as the embedded one
can be) is read in process, on every admission and every answer as well as on the timer, so the controller sees
the queue it just changed without an HTTP round trip through the engine's own process.

Waiters are served oldest request first: a started sample's turns go before any new sample, so turns already started
are never starved by new work, and among them the turn that has waited longest goes first (first come, first served,
as the engine serves its own queue). Ordering them by the sample's first admission instead kept the youngest samples
waiting turn after turn while the batch was full; they then ran their last turns and tool calls almost alone, and
the engine's under-full tail at the end of a batch was about twice as long. The time each wait took is on
the transition it delayed (``admission_ms``), apart from ``queued_ms``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.load import EngineLoad, LoadReader, local_source

POLL_S = 0.05
"""How often a server with work in flight has its load read (its ``/metrics`` over HTTP, or in process)."""

MIN_WINDOW = 1
"""A window never shrinks below this: a server always gets work."""

Priority = tuple[int, float, int]
"""``(0 started / 1 new, the order the request asked in, tie-break)``: lower goes first."""

_log = logging.getLogger(__name__)
_order = itertools.count()


@dataclass(order=True)
class _Waiter:
    priority: Priority
    future: asyncio.Future[None] = field(compare=False)


class AdmissionController:
    """Admits generate requests to one server while its load stays under the targets (module docstring)."""

    def __init__(
        self,
        url: str,
        reader: LoadReader,
        *,
        kv_target: float,
        max_waiting: int,
        load: EngineLoad | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.url = url
        self._reader = reader
        self.kv_target = kv_target
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self.window = max(MIN_WINDOW, max_waiting)
        """Generate requests this controller lets be in flight at the server (adapted)."""
        self.in_flight = 0
        self.active = 0
        """Rollouts of this server that took a slot and have not ended: its load is read while any is (one
        stepping its environment asks again soon, and must not be admitted on a stale reading)."""
        self.load: EngineLoad | None = None
        self.over_target = False
        self.waits = 0
        """How many admissions had to wait."""
        self.backoffs = 0
        """How often new preemptions halved the window."""
        self.read_errors = 0
        self._preemptions: int | None = None
        self._waiters: list[_Waiter] = []
        self._poller: asyncio.Task[None] | None = None
        self._local = local_source(url)
        if load is not None:
            self.observe(load)

    # ---------------------------------------------------------------- admitting

    def _may_admit(self) -> bool:
        return not self.over_target and self.in_flight < self.window

    def _refresh(self) -> None:
        """Read an in-process engine's load now (a no-op for one read over HTTP: its poller reads it)."""
        if self._local is not None:
            self.observe(self._local())

    async def acquire(self, priority: Priority) -> float:
        """Wait for a slot (in ``priority`` order); returns the milliseconds waited. Cancelled while waiting, the
        slot is not taken (or is given back, when it was granted as the cancellation came)."""
        self._refresh()
        if not self._waiters and self._may_admit():
            self.in_flight += 1
            self._ensure_polling()
            return 0.0
        started = time.perf_counter()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, _Waiter(priority, future))
        self.waits += 1
        self._ensure_polling()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just as it was cancelled: give it back
                self.release()
            raise
        return (time.perf_counter() - started) * 1000.0

    def release(self) -> None:
        """A slot is given back (its answer is in, or its rollout ended)."""
        self.in_flight = max(0, self.in_flight - 1)
        if self._local is not None:
            self._refresh()  # observes, then wakes
        else:
            self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and self._may_admit():
            waiter = heapq.heappop(waiters)
            if waiter.future.done():  # cancelled while waiting
                continue
            self.in_flight += 1
            waiter.future.set_result(None)

    @property
    def waiting(self) -> int:
        return sum(not waiter.future.done() for waiter in self._waiters)

    # ---------------------------------------------------------------- reading the load

    def observe(self, load: EngineLoad) -> None:
        """Adapt to one reading of the server's load, then admit what it allows."""
        previous, self._preemptions = self._preemptions, load.preemptions
        self.load = load
        self.over_target = load.waiting > self.max_waiting or load.kv_cache_usage >= self.kv_target
        if previous is not None and load.preemptions > previous:
            self.window = max(MIN_WINDOW, self.window // 2)
            self.backoffs += 1
        elif self.over_target:
            self.window = max(MIN_WINDOW, min(self.window, self.in_flight))
        elif self.in_flight >= self.window and self.waiting:
            # Requests admitted but not yet at the engine (rendering, in transit) will join its queue: count them,
            # or a reading taken just after a burst of admissions lets the window overshoot.
            unseen = max(0, self.in_flight - load.running - load.waiting)
            self.window += max(1, self.max_waiting - load.waiting - unseen)
        self._wake()

    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Read the load while requests are in flight or waiting; a failed read keeps the last one."""
        while self.in_flight or self._waiters or self.active:
            try:
                load = await self._reader.read(self.url)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a busy server may time out a read: the next one decides
                self.read_errors += 1
                _log.debug("reading %s/metrics failed: %s", self.url, error)
            else:
                if load is not None:
                    self.observe(load)
            self._waiters = [waiter for waiter in self._waiters if not waiter.future.done()]
            heapq.heapify(self._waiters)
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for waiter in self._waiters:
            waiter.future.cancel()
        self._waiters.clear()


class AdmissionPoint:
    """One rollout's side of its server's controller: whether it holds a slot, its priority, the waits it made."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller
        self.held = False
        self.active = False
        self.waited_ms: float | None = None
        """The last wait's milliseconds, until the transition it delayed takes it (:meth:`take_waited`)."""

    def hold(self, waited_ms: float) -> None:
        """Take over the slot a new sample was admitted with (after ``waited_ms``), up to its first answer."""
        self.held = self.active = True
        self.controller.active += 1
        self.waited_ms = round(waited_ms, 3)

    async def acquire(self) -> None:
        """Hold a slot for the next generate request (at once when the rollout holds one already)."""
        if self.held:
            return
        waited = await self.controller.acquire((0, float(next(_order)), 0))  # the turn that asked first goes first
        self.held = True
        if not self.active:
            self.active = True
            self.controller.active += 1
        self.waited_ms = round(waited, 3)

    def release(self) -> None:
        """The slot goes back (the answer is in)."""
        if self.held:
            self.held = False
            self.controller.release()

    def finish(self) -> None:
        """The rollout ended: its slot, if held, goes back, and its server's load need not be read for it."""
        self.release()
        if self.active:
            self.active = False
            self.controller.active -= 1

    def take_waited(self) -> float | None:
        waited, self.waited_ms = self.waited_ms, None
        return waited


class Admission:
    """A runner's adaptive admission: one controller per server, made on entering from a first read of each
    server's load; :attr:`fixed` when a server publishes none (the runner then admits by ``concurrency``)."""

    def __init__(self, *, kv_target: float, max_waiting: int, api_key: str | None = None) -> None:
        self.kv_target = kv_target
        self.max_waiting = max_waiting
        self.reader = LoadReader(api_key=api_key)
        self.controllers: dict[str, AdmissionController] = {}
        self.fixed = False
        """A server had no ``/metrics``: admission is fixed for this runner (one warning said so)."""

    async def start(self, urls: Iterable[str]) -> None:
        missing: list[str] = []
        for url in urls:
            try:
                load = await self.reader.read(url)
            except Exception as error:  # any failure to read counts as no load published
                _log.debug("reading %s/metrics failed: %s", url, error)
                load = None
            if load is None:
                missing.append(url)
                continue
            self.controllers[url] = AdmissionController(
                url, self.reader, kv_target=self.kv_target, max_waiting=self.max_waiting, load=load
            )
        if missing:
            self.fixed = True
            await self.close()
            _log.warning(
                "admission='adaptive' needs the engine's load on GET /metrics, which %s does not publish: "
                "admitting by concurrency (fixed) instead",
                ", ".join(missing),
            )

    def point(self, url: str) -> AdmissionPoint | None:
        """A rollout's side of ``url``'s controller."""
        controller = self.controllers.get(url)
        return None if controller is None else AdmissionPoint(controller)

    async def admit_new(self, url: str) -> float:
        """Wait for a slot for a sample not started yet (after every started sample's turns, in arrival order);
        returns the milliseconds waited."""
        return await self.controllers[url].acquire((1, float(next(_order)), 0))

    async def close(self) -> None:
        for controller in self.controllers.values():
            await controller.close()
        self.controllers.clear()
        await self.reader.close()


async def start_admission(config: RolloutConfig, urls: Iterable[str]) -> Admission | None:
    """The runner's adaptive admission (None: ``config.admission`` is fixed, or a server publishes no load)."""
    if config.admission != "adaptive":
        return None
    admission = Admission(
        kv_target=config.admission_kv_target, max_waiting=config.admission_max_waiting, api_key=config.api_key
    )
    await admission.start(urls)
    return None if admission.fixed else admission


__all__ = ["MIN_WINDOW", "POLL_S", "Admission", "AdmissionController", "AdmissionPoint", "start_admission"]
