"""Keep Python's full garbage collections off the event loop while rollouts are in flight.

CPython's collector runs a full (oldest-generation) pass whenever the objects promoted since the last one reach a
quarter of those that survived it. With thousands of samples in flight, every sample's pending request, response
and coroutine outlives two young collections, so full passes come every few hundred milliseconds, and each one
walks every tracked object in the process (800,000 at 10,000 samples in flight): pauses of 0.3-0.6 s on the
event loop, and over a third of the client's CPU (``fsm-rollout bench``, workload ``scale``).

The rollout path itself makes next to no cyclic garbage (about 3 objects per sample, from closed connections), so
nothing needs those passes while rollouts run. :func:`rollouts_in_flight` therefore, while at least one rollout
of the process is running:

* freezes the objects that existed before (``gc.freeze()``: imports, tokenizer, the batch's samples), so no
  collection walks them (unless the process has frozen objects itself; then its freeze is left alone), and
* raises the oldest generation's threshold 100-fold, so a full pass needs 100 times as many young collections.

Both are undone when the last running rollout ends (``gc.unfreeze()`` and the previous thresholds), and full
collections resume on Python's normal schedule. Rollouts opt out with ``RolloutConfig(defer_full_gc=False)``.
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
_froze = False


def rollout_started() -> None:
    """Note a rollout starting; the first one in flight starts deferring full collections."""
    global _running, _saved_thresholds, _froze
    with _lock:
        _running += 1
        if _running == 1:
            young, middle, old = gc.get_threshold()
            _saved_thresholds = (young, middle, old)
            _froze = gc.get_freeze_count() == 0  # a process that froze objects itself keeps its own freeze
            if _froze:
                gc.freeze()
            gc.set_threshold(young, middle, old * FULL_GC_THRESHOLD_FACTOR)


def rollout_ended() -> None:
    """Note a rollout ending; the last one in flight restores the collector."""
    global _running, _saved_thresholds, _froze
    with _lock:
        _running -= 1
        if _running == 0 and _saved_thresholds is not None:
            gc.set_threshold(*_saved_thresholds)
            _saved_thresholds = None
            if _froze:
                gc.unfreeze()
                _froze = False


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
