"""Tune Python's garbage collector for the rollouts a process has in flight.

Thousands of rollouts on one event loop keep a large population of in-flight objects alive: every pending request
with its aiohttp machinery, every answer waiting for its share of the loop, every per-turn coroutine. They all
outlive the young collections, which is what makes CPython's default schedule expensive for this workload (the
figures are in ``fsm-rollout bench``'s output, workload ``scale``, and the README):

* **Full passes.** CPython runs a full (oldest-generation) pass whenever the objects promoted since the last one
  reach a quarter of those that survived it. With thousands of samples in flight that comes often, and each one
  walks every tracked object in the process: long pauses of the event loop and a large share of the client's CPU.
  The rollout path makes next to no cyclic garbage (a few objects per sample, from closed connections), so nothing
  needs those passes while rollouts run.
* **Young passes.** With CPython 3.11's and 3.12's default thresholds (700, 10) the middle generation gathers
  eleven young passes' survivors before it is walked, by which time they are out of the CPU's caches. With a
  young collection once more than 300 net allocations have accumulated, and the middle generation collected with
  every third one, the survivors are walked while still warm: less collector time per turn and shorter pauses.

So while at least one rollout of the process runs, the thresholds become ``(300, 1, n)``, where ``n`` makes a full
pass need :data:`FULL_GC_THRESHOLD_FACTOR` times the allocations it needs under the previous thresholds
(:func:`full_pass_allocations`), far more than a large batch allocates. Young and middle thresholds the process
set lower are kept. The previous thresholds come back when the last running rollout ends, unless other code set
thresholds of its own meanwhile (those are kept), and collections resume on Python's normal schedule; a process
forked while rollouts run gets them back at once. A process that turned automatic collection off with a zero
threshold, or set a negative one, is left alone. Nothing here runs unless asked for: rollouts opt in with
``RolloutConfig(tune_gc=True)`` (``fsm-rollout run`` and ``bench`` do), and the fork hook is installed the first
time the collector is tuned.

Only CPython's generational collector (up to 3.13, with the GIL) is tuned. From 3.14 the collector is
incremental, with no full passes to defer and other meanings for the thresholds, and the free-threaded build
walks the whole heap each time; both are left as they are.

``gc.freeze()`` is not used: telling whether the process froze objects itself (so as not to unfreeze them) costs
a walk of every frozen object, and with full passes deferred a freeze saves nothing more.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 300
"""While rollouts run, a young collection runs once more than this many container objects have been allocated (net)
since the last one (CPython 3.11's and 3.12's default: 700)."""
MIDDLE_THRESHOLD = 1
"""While rollouts run, the middle generation is collected once more than this many young collections have run
since its last one (CPython's default: 10)."""
FULL_GC_THRESHOLD_FACTOR = 100
"""How many times the allocations a full collection needs under the previous thresholds it needs while rollouts
run."""

# CPython's generational collector: up to 3.13, and not the free-threaded build (which walks the whole heap each
# time and uses only the young threshold)
_GENERATIONAL = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")
_MAX_THRESHOLD = 2**31 - 1  # gc.set_threshold takes C ints

_lock = threading.Lock()
_running = 0
_saved_thresholds: tuple[int, int, int] | None = None
_raised_thresholds: tuple[int, int, int] | None = None
_fork_hook_registered = False


def full_pass_allocations(thresholds: tuple[int, int, int]) -> int:
    """Net allocations of container objects from one full collection to the next under ``thresholds``.

    CPython's generational collector runs a collection once the young count exceeds ``young`` (every ``young + 1``
    allocations); a collection is of the middle generation once ``middle + 1`` young ones have run since its last
    one (every ``middle + 2`` collections), and full once ``old + 1`` middle ones have. (A full one also waits until
    the objects promoted since the last one are a quarter of those that survived it, which only defers it further.)
    """
    young, middle, old = thresholds
    return (young + 1) * ((middle + 2) * (old + 1) + 1)


def tuned_thresholds(saved: tuple[int, int, int]) -> tuple[int, int, int]:
    """The collector thresholds used while rollouts run, given the ones in force before."""
    young, middle, old = saved
    if not _GENERATIONAL or young <= 0 or middle < 0 or old < 0:  # incremental collector, collection off, or odd
        return saved
    tuned_young, tuned_middle = min(young, YOUNG_THRESHOLD), min(middle, MIDDLE_THRESHOLD)
    # the least ``n`` with full_pass_allocations((tuned_young, tuned_middle, n)) >= the factor times the saved one
    collections = -(-full_pass_allocations(saved) * FULL_GC_THRESHOLD_FACTOR // (tuned_young + 1))
    tuned_old = -(-(collections - 1) // (tuned_middle + 2)) - 1
    return tuned_young, tuned_middle, min(_MAX_THRESHOLD, max(old, tuned_old))


def rollout_started() -> None:
    """Note a rollout starting; the first one in flight tunes the collector."""
    global _running, _saved_thresholds, _raised_thresholds, _fork_hook_registered
    with _lock:
        if _running == 0:
            saved = gc.get_threshold()
            tuned = tuned_thresholds(saved)
            if tuned != saved:
                if not _fork_hook_registered and hasattr(os, "register_at_fork"):
                    # installed when tuning is first used, never at import: a process that does not ask for
                    # tuning gets no hook
                    os.register_at_fork(after_in_child=_after_fork_in_child)
                    _fork_hook_registered = True
                gc.set_threshold(*tuned)
                _saved_thresholds, _raised_thresholds = saved, tuned
        _running += 1


def rollout_ended() -> None:
    """Note a rollout ending; the last one in flight restores the collector. An end without a start is ignored
    (it is called from ``finally`` blocks, where raising would skip the rest of the cleanup)."""
    global _running, _saved_thresholds, _raised_thresholds
    with _lock:
        if _running <= 0:
            return
        _running -= 1
        if _running == 0 and _saved_thresholds is not None:
            if gc.get_threshold() == _raised_thresholds:  # thresholds someone set meanwhile are theirs to keep
                gc.set_threshold(*_saved_thresholds)
            _saved_thresholds = _raised_thresholds = None


def _after_fork_in_child() -> None:
    """A process forked while rollouts ran (a data-loader worker, say) runs none of them: it gets the collector
    back as it was."""
    global _lock, _running, _saved_thresholds, _raised_thresholds
    _lock = threading.Lock()
    if _saved_thresholds is not None and gc.get_threshold() == _raised_thresholds:
        gc.set_threshold(*_saved_thresholds)
    _running, _saved_thresholds, _raised_thresholds = 0, None, None


@contextmanager
def rollouts_in_flight() -> Iterator[None]:
    """Keep the collector tuned while the block runs (reference-counted across rollouts and threads)."""
    rollout_started()
    try:
        yield
    finally:
        rollout_ended()


def tuning() -> bool:
    """Whether the collector's thresholds are the tuned ones now (some rollout of the process is running, and there
    was something to tune)."""
    return _running > 0 and _raised_thresholds is not None
