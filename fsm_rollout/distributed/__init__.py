"""Rollout workers beyond one process: :class:`RayRolloutPool` runs :class:`~fsm_rollout.runtime.runner.RolloutRunner`
instances as Ray actors (the optional extra ``fsm-rollout[ray]``).

Importing this package imports no Ray; the pool imports it when it starts.

Its modules are internal: import the pool and its helpers from this package.
"""

from fsm_rollout.distributed.pool import (
    DEFAULT_WORKER_OPTIONS,
    LOCAL_CLUSTER_OPTIONS,
    WORKER_LOST,
    PoolMetricsSnapshot,
    RayRolloutPool,
    WorkerStatus,
    combine_metrics,
)
from fsm_rollout.distributed.worker import RolloutWorker, config_from_data, config_to_data

__all__ = [
    "DEFAULT_WORKER_OPTIONS",
    "LOCAL_CLUSTER_OPTIONS",
    "WORKER_LOST",
    "PoolMetricsSnapshot",
    "RayRolloutPool",
    "RolloutWorker",
    "WorkerStatus",
    "combine_metrics",
    "config_from_data",
    "config_to_data",
]
