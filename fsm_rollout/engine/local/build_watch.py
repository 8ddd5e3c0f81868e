"""Internal: watching the default model's training child from the building process: its progress lines read, the
time left estimated, the child killed when the build is stopped, and how many torch threads it may use.

Nothing here decides the weights (the thread count does not: the kernels are deterministic, and a test checks that
one and two threads give the same weights), so it lives apart from :mod:`~fsm_rollout.engine.local.default_model`,
whose source is part of the build's cache key.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from typing import Final

TRAIN_THREADS: Final = 2
"""torch threads of the training process on a machine with cores to spare (:func:`train_threads` picks one when it
has not); the deterministic kernels make the weights the same on one thread and on two."""


def end_when_stopped(child: subprocess.Popen[str], stop: threading.Event) -> None:
    """Kill ``child`` once ``stop`` is set; return when it ends on its own first."""
    while not stop.wait(0.05):
        if child.poll() is not None:
            return
    child.kill()  # it holds nothing worth saving: the staging directory is removed after it


def train_threads() -> int:
    """torch threads for a build: :data:`TRAIN_THREADS`, or one when the machine's other work leaves it less than
    a core per thread (two threads spin at each step's barriers while one waits for a core, many times slower than
    one). The weights do not depend on it (deterministic kernels; tested)."""
    try:
        busy = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return TRAIN_THREADS
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # the load average counts runnable processes: with more than half a core of other work, one thread
    return TRAIN_THREADS if busy + TRAIN_THREADS <= cores + 0.5 else 1


def progress_report(line: str) -> tuple[int, int, float | None] | str | None:
    """``(step, steps, loss)`` from one of the child's progress lines, the phase from one of its set-up beats, None
    for any other line."""
    try:
        report = json.loads(line)
        if isinstance(report, dict) and isinstance(report.get("phase"), str):
            return str(report["phase"])
        return int(report["step"]), int(report["steps"]), None if report["loss"] is None else float(report["loss"])
    except (ValueError, TypeError, KeyError):
        return None


class BuildEstimate:
    """Seconds left from the mean time per step since training started (step 0): the set-up before it (loading,
    encoding) is not a step's cost."""

    def __init__(self) -> None:
        self._start: tuple[int, float] | None = None

    def remaining(self, step: int, steps: int, now: float) -> float | None:
        if self._start is None:
            self._start = (step, now)
            return None
        first_step, first_time = self._start
        if step <= first_step:
            return None
        return (now - first_time) / (step - first_step) * (steps - step)
