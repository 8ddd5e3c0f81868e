"""Internal: the worker pools that run synchronous environment code off the event loop.

Kept apart from :mod:`fsm_rollout.envs.protocol` so that the environment adapters (:mod:`fsm_rollout.envs.adapters`),
which
:mod:`fsm_rollout.envs.protocol` loads by name, can use the same pools without importing it back.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def env_thread_pool(max_workers: int) -> ThreadPoolExecutor:
    """The worker pool that runs synchronous environment calls with ``env_executor="thread"`` (and the adapters'
    calls into synchronous foreign environments): one per size, created on first use (the caller asked for threads
    by choosing that executor or such an adapter)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(max_workers)
        if pool is None:
            pool = _POOLS[max_workers] = ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="fsm-rollout-env"
            )
        return pool
