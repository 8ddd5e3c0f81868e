"""A server tree a test starts (tests/process_groups.py) dies with the test process, even one killed with SIGKILL, and
even when the tree ignores SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: A server stand-in: a leader and a child of it, both ignoring SIGTERM (as vLLM's processes do for a while); the
#: leader writes both pids to the file it is given once the child runs.
TREE = r"""
import json, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as out:
    json.dump([__import__("os").getpid(), child.pid], out)
__import__("os").rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

#: The test process stand-in: starts the tree with start_group, then waits to be killed.
PARENT = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from process_groups import start_group
start_group([sys.executable, "-c", sys.argv[2], sys.argv[3]], grace_s=1.0)
time.sleep(600)
"""

#: The same with start_group_async, from an event loop that is still running when the process is killed.
PARENT_ASYNC = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from process_groups import start_group_async

async def main():
    await start_group_async([sys.executable, "-c", sys.argv[2], sys.argv[3]], grace_s=1.0)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def gone(pid: int) -> bool:
    """The process has ended (a zombie not yet reaped by whoever adopted it counts as ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


def wait_for(condition: object, what: str, limit_s: float = 30.0) -> None:
    """Poll ``condition`` (the limit only turns a hang into a failure naming ``what``)."""
    deadline = time.monotonic() + limit_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        time.sleep(0.05)


def tree_pids(pids_file: Path) -> list[int]:
    wait_for(pids_file.exists, "the tree to start")
    pids: list[int] = json.loads(pids_file.read_text())
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's here")
@pytest.mark.parametrize("parent_program", [PARENT, PARENT_ASYNC], ids=["start_group", "start_group_async"])
def test_a_tree_that_ignores_sigterm_dies_when_its_test_process_is_killed(tmp_path: Path, parent_program: str) -> None:
    pids_file = tmp_path / "pids.json"
    parent = subprocess.Popen([sys.executable, "-c", parent_program, str(TESTS), TREE, str(pids_file)])
    try:
        leader, child = tree_pids(pids_file)
        assert os.getpgid(child) == leader  # the child joined the leader's group
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: gone(leader) and gone(child), "the tree to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pids_file.exists():
            for pid in json.loads(pids_file.read_text()):
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's here")
def test_stopping_a_group_kills_a_tree_that_ignores_sigterm_and_lets_its_watchdog_go(tmp_path: Path) -> None:
    sys.path.insert(0, str(TESTS))
    try:
        from process_groups import start_group, stop_group, watchdog_of
    finally:
        sys.path.remove(str(TESTS))
    pids_file = tmp_path / "pids.json"
    process = start_group([sys.executable, "-c", TREE, str(pids_file)], grace_s=1.0)
    watchdog = watchdog_of(process)
    assert watchdog is not None
    leader, child = tree_pids(pids_file)
    assert os.getpgid(child) == leader
    stop_group(process, grace_s=1.0)
    assert process.returncode == -signal.SIGKILL  # SIGTERM was ignored
    wait_for(lambda: gone(child), "the leader's child to die")
    assert watchdog.returncode == 0  # it exited once the group was gone
    assert watchdog_of(process) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's here")
async def test_stopping_a_group_from_the_event_loop_kills_a_tree_that_ignores_sigterm(tmp_path: Path) -> None:
    sys.path.insert(0, str(TESTS))
    try:
        from process_groups import start_group_async, stop_group_async, watchdog_of
    finally:
        sys.path.remove(str(TESTS))
    pids_file = tmp_path / "pids.json"
    process = await start_group_async([sys.executable, "-c", TREE, str(pids_file)], grace_s=1.0)
    watchdog = watchdog_of(process)
    assert watchdog is not None
    leader, child = await asyncio.to_thread(tree_pids, pids_file)
    assert os.getpgid(child) == leader
    await stop_group_async(process, grace_s=1.0)
    assert process.returncode == -signal.SIGKILL  # SIGTERM was ignored
    await asyncio.to_thread(wait_for, lambda: gone(child), "the leader's child to die")
    assert watchdog.returncode == 0
    assert watchdog_of(process) is None
