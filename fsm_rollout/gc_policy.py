"""Keep Python's full garbage collections off the event loop while rollouts are in flight.

CPython's collector runs a full (oldest-generation) pass whenever the objects promoted since the last one reach a
quarter of those that survived it. With thousands of samples in flight, every sample's pending request, response
and coroutine outlives two young collections, so full passes come every few hundred milliseconds, and each one
walks every tracked object in the process (800,000 at 10,000 samples in flight): pauses of 0.3-0.6 s on the
event loop, and over a third of the client's CPU (``fsm-rollout bench``, workload ``scale``).

The rollout path itself makes next to no cyclic garbage (about 3 objects per sample, from closed connections), so
nothing needs those passes while rollouts run. While at least one rollout of the process is running, the oldest
generation's threshold is raised 100-fold, so a full pass needs 100 times as many young collections (none in a
10,000-sample batch); young collections go on as usual. The previous thresholds come back when the last running
rollout ends (unless other code set thresholds of its own meanwhile: those are kept), and full collections resume
on Python's normal schedule. Rollouts opt out with
``RolloutConfig(defer_full_gc=False)``.

``gc.freeze()`` is not used: telling whether the process froze objects itself (so as not to unfreeze them) costs
a walk of every frozen object, and with full passes deferred a freeze saves nothing more.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

FULL_GC_THRESHOLD_FACTOR = 100

_lock = threading.Lock()
_running = 0
_saved_thresholds: tuple[int, int, int] | None = None
_raised_thresholds: tuple[int, int, int] | None = None


def rollout_started() -> None:
    """Note a rollout starting; the first one in flight starts deferring full collections."""
    global _running, _saved_thresholds, _raised_thresholds
    with _lock:
        _running += 1
        if _running == 1:
            young, middle, old = gc.get_threshold()
            _saved_thresholds = (young, middle, old)
            _raised_thresholds = (young, middle, old * FULL_GC_THRESHOLD_FACTOR)
            gc.set_threshold(*_raised_thresholds)


def rollout_ended() -> None:
    """Note a rollout ending; the last one in flight restores the collector."""
    global _running, _saved_thresholds, _raised_thresholds
    with _lock:
        _running -= 1
        if _running == 0 and _saved_thresholds is not None:
            if gc.get_threshold() == _raised_thresholds:  # thresholds someone set meanwhile are theirs to keep
                gc.set_threshold(*_saved_thresholds)
            _saved_thresholds = _raised_thresholds = None


@contextmanager
def rollouts_in_flight() -> Iterator[None]:
    """Defer full collections while the block runs (reference-counted across rollouts and threads)."""
    rollout_started()
    try:
        yield
    finally:
        rollout_ended()


def deferring() -> bool:
    """Whether full collections are being deferred now (some rollout of the process is running)."""
    return _running > 0
