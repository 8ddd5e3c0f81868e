"""Suspending rollouts for a weight update, losslessly: the gate rollouts consult, and the per-token versions.

A :class:`Suspender` is shared by the rollouts of one runner (or of :mod:`fsm_rollout.compat` in one event loop).
While it is closed, a rollout that reaches ``generating`` suspends before it sends anything, and a sample that has
not started waits. Closing it with the ``abort`` strategy aborts every generate request in flight with one
``abort_requests`` call per engine; the engines answer them with the tokens produced so far, which the rollouts
keep as their partial turns. With ``keep`` the engines freeze their requests themselves (``/pause?mode=keep``) and
nothing is aborted. Reopening it resumes every suspended rollout where it stopped.

The rollout sees the gate through :class:`SuspensionGate`; replay answers it from the tape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fsm_rollout.errors import ConfigError

if TYPE_CHECKING:
    from fsm_rollout.engine.client import VLLMClient

WEIGHT_UPDATE_STRATEGIES = ("abort", "keep")
"""How a weight update treats the generate requests in flight: abort them at the engine and continue each turn
from its partial tokens afterwards, or have the engine freeze them (``/pause?mode=keep``) until it resumes."""


class HandBack(Exception):
    """Raised by :meth:`SuspensionGate.wait_resumed`: the suspended rollout goes back to its caller
    (``partial_rollout``) instead of waiting; the driver takes the table's ``hand_back`` edge."""


class SuspensionGate(Protocol):
    """What a rollout asks of whoever may suspend it."""

    @property
    def weight_version(self) -> str | None:
        """The weight version current now, when known."""

    @property
    def weight_updates(self) -> int:
        """How many weight updates happened so far."""

    def version_at(self, updates: int) -> str | None:
        """The weight version current after ``updates`` weight updates, when known."""

    def saw_version(self, version: str) -> None:
        """An engine answer carried this weight version."""

    def should_suspend(self) -> bool:
        """Whether the rollout, about to send a generate request, must suspend instead."""

    def suspended_request(self, request_id: str) -> bool:
        """Whether the abort answer of ``request_id`` came from this gate's suspension (not from the server)."""

    def request_started(self, client: VLLMClient, request_id: str) -> None:
        """A generate request is about to be sent."""

    def request_ended(self, request_id: str) -> None:
        """The generate request ended (answered, failed or cancelled)."""

    async def wait_to_start(self) -> None:
        """Return once a rollout that has not started may start."""

    async def wait_resumed(self) -> None:
        """Return once a suspended rollout may go on; raises :class:`HandBack` when it goes back to its caller
        instead (the ``hand_back`` edge: status ``aborted``, reason ``handed_back``, ``metadata["resume_state"]``;
        :mod:`fsm_rollout.compat` with ``partial_rollout``)."""


@dataclass
class SuspendStats:
    """What the last suspension and resume cost (client side)."""

    reason: str | None = None
    strategy: str = "abort"
    requests_in_flight: int = 0
    """Generate requests in flight when the suspension was asked for."""
    abort_calls: int = 0
    """``abort_requests`` calls sent (one per engine per round; a request the engine did not know yet needs a
    second round)."""
    pause_calls: int = 0
    suspend_s: float = 0.0
    """From :meth:`Suspender.suspend` being called to nothing in flight (``abort``) or every engine paused
    (``keep``)."""
    resume_s: float = 0.0
    """From :meth:`Suspender.resume` being called to the gate open (and every engine resumed, ``keep``)."""
    errors: list[str] = field(default_factory=list)


class Suspender:
    """The gate of one set of rollouts (see the module docstring).

    ``clients`` gives the engine clients the rollouts send to (one per engine). ``servers``, when given, are the
    servers behind a router that those clients reach: pauses, resumes, weight versions and aborts go to each of
    them instead, every id to every server, since the router would forward each call to one server only.
    ``abort_retry_s``: while requests are still in flight after an abort round (the engine may not have registered
    a request yet, and ignores unknown ids), another round aborts them after this many seconds.
    """

    def __init__(
        self,
        clients: Callable[[], Iterable[VLLMClient]],
        *,
        strategy: str = "abort",
        abort_retry_s: float = 0.25,
        servers: Callable[[], Iterable[VLLMClient]] | None = None,
    ) -> None:
        if strategy not in WEIGHT_UPDATE_STRATEGIES:
            raise ConfigError(
                f"weight_update_strategy must be one of {', '.join(WEIGHT_UPDATE_STRATEGIES)}; got {strategy!r}"
            )
        self._clients = clients
        self._controlled = servers or clients
        """Where pauses, resumes and weight versions go."""
        self._servers = servers
        self.strategy = strategy
        self.abort_retry_s = abort_retry_s
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._in_flight: dict[str, VLLMClient] = {}
        self._aborted: set[str] = set()
        self._lock = asyncio.Lock()
        self._weight_version: str | None = None
        self._seen_version: str | None = None
        self._versions_before: list[str | None] = []
        """The version current before each weight update (None when it was never known)."""
        self.version_history: list[str] = []
        """Every weight version set through :meth:`weight_update`, oldest first."""
        self.reason: str | None = None
        self.stats = SuspendStats(strategy=strategy)
        self._engines_paused = False

    # ------------------------------------------------------------------ what rollouts ask

    @property
    def weight_version(self) -> str | None:
        """The weight version last set through :meth:`weight_update`; before any, the last one an engine answer
        carried (None before any answer)."""
        return self._weight_version if self._weight_version is not None else self._seen_version

    @property
    def weight_updates(self) -> int:
        """Weight updates so far (suspensions that set a version)."""
        return len(self.version_history)

    def version_at(self, updates: int) -> str | None:
        if updates >= len(self.version_history):
            return self.weight_version
        return self._versions_before[updates]

    def saw_version(self, version: str) -> None:
        if self._weight_version is None:
            self._seen_version = version

    @property
    def suspended(self) -> bool:
        """Whether the gate is closed."""
        return not self._open.is_set()

    @property
    def requests_in_flight(self) -> int:
        """Generate requests of these rollouts in flight now."""
        return len(self._in_flight)

    def should_suspend(self) -> bool:
        return not self._open.is_set()

    def suspended_request(self, request_id: str) -> bool:
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            return True
        return False

    def request_started(self, client: VLLMClient, request_id: str) -> None:
        self._in_flight[request_id] = client
        self._drained.clear()

    def request_ended(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)
        if not self._in_flight:
            self._drained.set()

    async def wait_to_start(self) -> None:
        if not self._open.is_set():
            await self._open.wait()

    async def wait_resumed(self) -> None:
        if not self._open.is_set():
            await self._open.wait()

    # ------------------------------------------------------------------ what the trainer does

    def request_suspend(self, reason: str = "weight_update") -> bool:
        """Close the gate now, without waiting (from synchronous code, e.g. inside an environment step): rollouts
        suspend before their next request. :meth:`suspend` then aborts or freezes what is in flight. True when this
        call closed it."""
        if not self._open.is_set():
            return False
        self._open.clear()
        self.reason = reason
        self.stats = SuspendStats(reason=reason, strategy=self.strategy, requests_in_flight=len(self._in_flight))
        self._engines_paused = False
        return True

    async def suspend(self, reason: str = "weight_update") -> None:
        """Close the gate; return once no generate request is in flight (``abort``) or every engine has frozen its
        requests (``keep``). Suspending a suspended gate only waits for that."""
        async with self._lock:
            started = time.perf_counter()
            self.request_suspend(reason)
            if not self._engines_paused:
                self._engines_paused = True
                if self.strategy == "keep":
                    clients = list(self._controlled())
                    await asyncio.gather(*(client.pause("keep") for client in clients))
                    self.stats.pause_calls = len(clients)
            if self.strategy == "abort":
                await self._abort_in_flight()
            self.stats.suspend_s = time.perf_counter() - started

    async def _abort_in_flight(self) -> None:
        # Grouped by engine, and sent through the gate's own clients: a rollout's client may be a per-sample wrapper
        # (a recording), and the abort call is the runner's, not one sample's exchange.
        while self._in_flight:
            by_engine = self._aborts_by_engine()
            for _, ids in by_engine.values():
                self._aborted.update(ids)
            results = await asyncio.gather(
                *(client.abort(ids) for client, ids in by_engine.values()), return_exceptions=True
            )
            self.stats.abort_calls += len(by_engine)
            self.stats.errors.extend(
                f"{type(error).__name__}: {error}" for error in results if isinstance(error, BaseException)
            )
            try:
                await asyncio.wait_for(self._drained.wait(), self.abort_retry_s)
            except TimeoutError:
                continue

    def _aborts_by_engine(self) -> dict[str, tuple[VLLMClient, list[str]]]:
        """The ids in flight to abort, grouped by the client to send them through."""
        if self._servers is not None:
            ids = list(self._in_flight)
            return {server.base_url: (server, ids) for server in self._servers()}
        own = {client.base_url: client for client in self._clients()}
        by_engine: dict[str, tuple[VLLMClient, list[str]]] = {}
        for request_id, client in self._in_flight.items():
            url = client.base_url
            by_engine.setdefault(url, (own.get(url, client), []))[1].append(request_id)
        return by_engine

    async def resume(self) -> None:
        """Open the gate (resuming the engines first, ``keep``); suspended rollouts continue where they stopped."""
        async with self._lock:
            started = time.perf_counter()
            if self._open.is_set():
                return
            if self.strategy == "keep":
                await asyncio.gather(*(client.resume() for client in self._controlled()))
            self._aborted.clear()
            self.reason = None
            self._open.set()
            self.stats.resume_s = time.perf_counter() - started

    async def set_weight_version(self, version: str) -> None:
        """Tell every engine the weight version of the tokens it samples from now on, and remember it."""
        await asyncio.gather(*(client.update_weight_version(version) for client in self._controlled()))
        self._versions_before.append(self.weight_version)
        self._weight_version = version
        self.version_history.append(version)

    @asynccontextmanager
    async def weight_update(self, version: str | None = None) -> AsyncIterator[None]:
        """Suspend, let the body push the weights, set the engines' weight version (when given), resume."""
        await self.suspend("weight_update")
        try:
            yield
            if version is not None:
                await self.set_weight_version(version)
        finally:
            await self.resume()


def weight_staleness(sample: Any, current_version: str, *, history: Sequence[str] | None = None) -> int:
    """How many weight versions the sample's oldest generated token is behind ``current_version``.

    Versions are ordered by ``history`` (oldest first, e.g. :attr:`Suspender.version_history` with the initial
    version in front) when given, else read as integers. A sample without generated tokens is 0 behind. What to do
    with a stale sample (mask it, drop it, keep it) is the trainer's choice.
    """
    metadata = sample.metadata if isinstance(getattr(sample, "metadata", None), Mapping) else {}
    spans = metadata.get("weight_version_spans") or []
    versions = [str(span["version"]) for span in spans]
    if not versions:
        return 0
    if history is not None:
        order = {version: index for index, version in enumerate(history)}
        unknown = sorted({*versions, current_version} - set(order))
        if unknown:
            raise ConfigError(f"weight versions not in the history: {unknown}")
        return order[current_version] - min(order[version] for version in versions)
    try:
        return int(current_version) - min(int(version) for version in versions)
    except ValueError:
        raise ConfigError(
            f"weight versions {sorted(set(versions))} and {current_version!r} are not integers: pass history= to "
            "order them"
        ) from None


__all__ = [
    "WEIGHT_UPDATE_STRATEGIES",
    "HandBack",
    "SuspendStats",
    "Suspender",
    "SuspensionGate",
    "weight_staleness",
]
