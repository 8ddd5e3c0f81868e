"""Servers a test starts (``vllm serve`` trees, ``vllm-router``) die with the test process, however it ends.

:func:`start_group` starts a command as the leader of a process group of its own (its children, such as vLLM's
engine core, join the group), with two guards for a test process that dies without running its teardown (the OOM
killer, ``kill -9``, a crash):

* the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) on the leader, set between fork and exec; the
  kernel ties it to the thread that forked, so it is only set from the main thread;
* a watchdog: a small Python process in a session of its own (a terminal's Ctrl-C to the test's group does not reach
  it) that waits for the test process to end (its stdin, a pipe only the test process holds, reaches end-of-file;
  or it is reparented) and then stops the whole group: SIGTERM, then SIGKILL after a short grace (vLLM's processes
  can ignore SIGTERM for tens of seconds).

:func:`stop_group` is the normal teardown: the same SIGTERM-then-SIGKILL on the group, then the watchdog is let go.
:func:`start_group_async` and :func:`stop_group_async` are the same for a test that talks to the process on its event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds a group gets to end after SIGTERM before it is killed.
GRACE_S = 5.0

_WATCHDOG = r"""
import os, select, signal, sys, time
group, parent, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def group_alive():
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

while os.getppid() == parent:
    readable, _, _ = select.select([sys.stdin], [], [], 0.5)
    if readable and not os.read(sys.stdin.fileno(), 4096):
        break  # end of file: the test process ended, or its teardown let the watchdog go
if group_alive():
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""

_WATCHDOGS: dict[int, subprocess.Popen[bytes]] = {}
_LOCK = threading.Lock()


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that sets the parent-death signal, with libc's ``prctl`` looked up here, in the parent: the child
    between fork and exec only calls it (no import, no lock another thread may have held at the fork)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):  # not Linux
        return None

    def set_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return set_signal


def _group_options() -> dict[str, Any]:
    on_main_thread = threading.current_thread() is threading.main_thread()
    return {"start_new_session": True, "preexec_fn": _parent_death_signal() if on_main_thread else None}


def _watch(group: int, grace_s: float) -> None:
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(group), str(os.getpid()), str(grace_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    with _LOCK:
        _WATCHDOGS[group] = watchdog


def start_group(command: list[str], *, grace_s: float = GRACE_S, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``command`` (``popen`` goes to :class:`subprocess.Popen`) as a process group that dies with this
    process; stop it with :func:`stop_group`."""
    process: subprocess.Popen[bytes] = subprocess.Popen(command, **_group_options(), **popen)
    _watch(process.pid, grace_s)
    return process


async def start_group_async(
    command: list[str], *, grace_s: float = GRACE_S, **options: Any
) -> asyncio.subprocess.Process:
    """:func:`start_group` for a test that talks to the process on its event loop (``options`` go to
    :func:`asyncio.create_subprocess_exec`); stop it with :func:`stop_group_async`."""
    process = await asyncio.create_subprocess_exec(*command, **_group_options(), **options)
    _watch(process.pid, grace_s)
    return process


def group_alive(group: int) -> bool:
    """Whether any process of the group is left."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(process: subprocess.Popen[bytes], grace_s: float = GRACE_S) -> None:
    """Stop the group ``process`` leads: SIGTERM, then SIGKILL after ``grace_s`` seconds; returns once the leader is
    reaped and the group is gone (or killed)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    _end_group(process.pid, grace_s)


async def stop_group_async(process: asyncio.subprocess.Process, grace_s: float = GRACE_S) -> None:
    """:func:`stop_group` for a group :func:`start_group_async` started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    await asyncio.to_thread(_end_group, process.pid, grace_s)


def _end_group(group: int, grace_s: float) -> None:
    """After the leader is reaped: the group's other processes (vLLM's engine core) may outlive it, so the same
    grace, then SIGKILL; then the watchdog is let go."""
    deadline = time.monotonic() + grace_s
    while group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    with _LOCK:
        watchdog = _WATCHDOGS.pop(group, None)
    if watchdog is not None:
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # end of file: it finds the group gone and exits
        watchdog.wait()


def watchdog_of(process: subprocess.Popen[bytes] | asyncio.subprocess.Process) -> subprocess.Popen[bytes] | None:
    """The watchdog of a group :func:`start_group` started and :func:`stop_group` has not stopped yet."""
    with _LOCK:
        return _WATCHDOGS.get(process.pid)
