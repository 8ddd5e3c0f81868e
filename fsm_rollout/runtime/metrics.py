"""What a runner's (or a pool's) samples are doing and have done: :class:`MetricsSnapshot`, the hook that counts
it, and how workers' snapshots add up."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_rollout.hooks import RolloutHooks, RolloutView
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout import Rollout
from fsm_rollout.weights.suspension import SuspendStats


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the runner's samples are doing right now and have done since the runner started."""

    occupancy: dict[str, int]
    """Samples per non-terminal state right now; sums to ``in_flight``."""
    in_flight: int
    dwell_ms_mean: dict[str, float]
    """Mean time samples spent in each state they left."""
    statuses: dict[str, int]
    """Samples per terminal status, counted since the runner started (not per batch)."""
    reasons: dict[str, int]
    """Samples per terminal reason (``env_done``, ``cancelled``, ``not_started``, ...), since the runner started."""
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
    queued: int = 0
    """Samples of a batch, group or stream waiting for a concurrency slot right now. Their rollout has not started:
    they are in neither ``occupancy`` nor ``in_flight``."""
    queued_ms_mean: float = 0.0
    """Mean time samples waited for a concurrency slot; the ``pending`` dwell starts once they have one."""
    queue_waits: int = 0
    """How many waits ``queued_ms_mean`` averages (its weight when snapshots are combined)."""
    forks: int = 0
    """``fork`` edges taken since the runner started: training sequences closed because the history was rewritten."""
    sequences: int = 0
    """Training sequences of the samples done (a rollout that forked n times has n + 1)."""

    @property
    def forks_per_rollout(self) -> float:
        """Mean forks of the samples done (0.0 before any is)."""
        return (self.sequences - self.samples_done) / self.samples_done if self.samples_done else 0.0

    @property
    def sequences_per_rollout(self) -> float:
        """Mean training sequences of the samples done (1.0 without forks; 0.0 before any is done)."""
        return self.sequences / self.samples_done if self.samples_done else 0.0

    sessions_open: int = 0
    """Agent gateway sessions open right now (:mod:`fsm_rollout.gateway`)."""
    sessions_total: int = 0
    """Agent gateway sessions opened since the runner started."""


@dataclass(eq=False)
class RunnerMetrics(RolloutHooks):
    """The runner's own hook: counts every transition of its rollouts into a :class:`MetricsSnapshot`."""

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
    forks: int = 0
    sequences: int = 0

    queue_wait_sum: float = 0.0
    queue_waits: int = 0

    active: set[Rollout] = field(default_factory=set)
    """The runner's rollouts that have not ended (each leaves the set at its terminal transition)."""
    waiting: set[Any] = field(default_factory=set)
    """The runner's samples waiting for a concurrency slot (each leaves the set when it gets one or is ended)."""

    sessions_open: int = 0
    sessions_total: int = 0

    def session_opened(self) -> None:
        """An agent gateway session was opened."""
        self.sessions_open += 1
        self.sessions_total += 1

    def session_closed(self) -> None:
        self.sessions_open -= 1

    def queue_left(self, waited_ms: float) -> None:
        self.queue_wait_sum += waited_ms
        self.queue_waits += 1

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        dst = rollout.state
        self.occupancy[src] -= 1
        self.dwell_sum[src] += dwell_ms  # type: ignore[assignment]
        self.dwell_count[src] += 1
        if trigger == "suspend":
            self.suspensions += 1
        elif trigger == "fork" and dst == "rendered":
            self.forks += 1
        if trigger == "step" and rollout.turn is not None:
            self.turns += 1
            self.tokens_generated += len(rollout.turn.token_ids)
        if dst in lifecycle.TERMINAL:
            self.statuses[dst] += 1
            self.reasons[rollout.reason or "unknown"] += 1
            self.done += 1
            self.sequences += 1 + len(rollout.sample.branches)
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
            queued=len(self.waiting),
            queued_ms_mean=self.queue_wait_sum / self.queue_waits if self.queue_waits else 0.0,
            queue_waits=self.queue_waits,
            forks=self.forks,
            sequences=self.sequences,
            sessions_open=self.sessions_open,
            sessions_total=self.sessions_total,
        )


@dataclass(frozen=True)
class PoolMetricsSnapshot(MetricsSnapshot):
    """:class:`~fsm_rollout.runtime.runner.MetricsSnapshot` summed over the live workers (rates over the pool's
    lifetime), with the samples lost with dead workers counted ``failed``/``worker_lost``. A dead worker's other counts
    leave the totals with it."""

    workers_alive: int = 0
    workers_lost: int = 0
    per_worker: tuple[MetricsSnapshot, ...] = ()


def combine_metrics(
    snapshots: Sequence[MetricsSnapshot],
    *,
    elapsed_s: float,
    failed_in_pool: Mapping[str, int] | None = None,
    workers_lost: int = 0,
) -> PoolMetricsSnapshot:
    """Workers' snapshots as one: counts summed, mean dwell times weighted by how often each state was left,
    rates over ``elapsed_s``; ``failed_in_pool`` (reason → samples) are the samples the pool ended ``failed``
    itself."""
    occupancy: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    dwell_total: Counter[str] = Counter()
    dwell_counts: Counter[str] = Counter()
    for snapshot in snapshots:
        occupancy.update(snapshot.occupancy)
        statuses.update(snapshot.statuses)
        reasons.update(snapshot.reasons)
        dwell_counts.update(snapshot.dwell_counts)
        for state, mean in snapshot.dwell_ms_mean.items():
            dwell_total[state] += mean * snapshot.dwell_counts.get(state, 0)  # type: ignore[assignment]
    failed_here = sum((failed_in_pool or {}).values())
    if failed_here:
        statuses["failed"] += failed_here
        reasons.update(failed_in_pool or {})
    elapsed = max(elapsed_s, 1e-9)
    done = sum(s.samples_done for s in snapshots) + failed_here
    turns = sum(s.turns for s in snapshots)
    tokens = sum(s.tokens_generated for s in snapshots)
    queue_waits = sum(s.queue_waits for s in snapshots)
    return PoolMetricsSnapshot(
        occupancy=dict(occupancy),
        in_flight=sum(occupancy.values()),
        dwell_ms_mean={state: dwell_total[state] / n for state, n in dwell_counts.items() if n},
        statuses=dict(statuses),
        reasons=dict(reasons),
        samples_done=done,
        turns=turns,
        tokens_generated=tokens,
        elapsed_s=elapsed,
        samples_per_s=done / elapsed,
        turns_per_s=turns / elapsed,
        tokens_per_s=tokens / elapsed,
        suspended=sum(s.suspended for s in snapshots),
        suspensions=sum(s.suspensions for s in snapshots),
        dwell_counts=dict(dwell_counts),
        queued=sum(s.queued for s in snapshots),
        queued_ms_mean=(sum(s.queued_ms_mean * s.queue_waits for s in snapshots) / queue_waits) if queue_waits else 0.0,
        queue_waits=queue_waits,
        forks=sum(s.forks for s in snapshots),
        sequences=sum(s.sequences for s in snapshots) + failed_here,
        workers_alive=len(snapshots),
        workers_lost=workers_lost,
        per_worker=tuple(snapshots),
    )


def combine_suspensions(stats: Sequence[SuspendStats]) -> SuspendStats:
    """Workers' :class:`~fsm_rollout.weights.suspension.SuspendStats` of one suspension as one: counts summed, times the
    slowest worker's (they suspend at once), errors all."""
    if not stats:
        return SuspendStats()
    return SuspendStats(
        reason=stats[0].reason,
        strategy=stats[0].strategy,
        requests_in_flight=sum(item.requests_in_flight for item in stats),
        abort_calls=sum(item.abort_calls for item in stats),
        pause_calls=sum(item.pause_calls for item in stats),
        suspend_s=max(item.suspend_s for item in stats),
        resume_s=max(item.resume_s for item in stats),
        errors=[error for item in stats for error in item.errors],
    )


__all__ = ["MetricsSnapshot", "PoolMetricsSnapshot", "RunnerMetrics", "combine_metrics", "combine_suspensions"]
