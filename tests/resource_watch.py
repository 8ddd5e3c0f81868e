"""What the test process holds as the suite runs: its peak resident memory at the end, and on request a line per test.

* At the end of every session the peak resident memory of pytest's own process (``ru_maxrss``; the servers a test
  starts are other processes and not counted) is printed in the summary and, when ``FSM_ROLLOUT_PEAK_RSS_FILE`` names
  a file, written there as one number of mebibytes (``.ci/run`` prints it after the run).
* ``FSM_ROLLOUT_RESOURCE_LOG=<file>`` appends one tab-separated line after each test: its node id, resident and peak
  memory in MiB, the process's threads (Python's, then all of them), how many files it holds open under pytest's
  temporary folders (where finished tests' tapes and logs live), the collector's thresholds, those files' names and
  the top-level packages the test imported first (a framework's first import is a lasting step up) and which process
  ran it (``main``, or ``own process`` for a module :mod:`own_process` runs in a child), so what accumulates can be
  traced to the tests that left it.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

PEAK_FILE_ENV_VAR = "FSM_ROLLOUT_PEAK_RSS_FILE"
LOG_ENV_VAR = "FSM_ROLLOUT_RESOURCE_LOG"
#: Names the process in the log's last column (a child pytest sets it); ``main`` when unset.
PROCESS_ENV_VAR = "FSM_ROLLOUT_RESOURCE_LOG_PROCESS"


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports kibibytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def open_temporary_files() -> list[str]:
    """Files this process holds open under pytest's temporary folders (where tests' tmp_path live)."""
    root = os.path.join(os.path.realpath(tempfile.gettempdir()), "pytest-of-")
    opened = []
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for descriptor in descriptors:
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:
            continue
        if target.startswith(root):
            opened.append(target)
    return opened


def top_level_packages() -> set[str]:
    return {name.partition(".")[0] for name in list(sys.modules)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    log = os.environ.get(LOG_ENV_VAR)
    before = top_level_packages() if log else set()
    yield
    if not log:
        return
    files = open_temporary_files()
    line = "\t".join(
        [
            item.nodeid,
            f"{current_rss_mib():.0f}",
            f"{peak_rss_mib():.0f}",
            str(threading.active_count()),
            str(len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1),
            str(len(files)),
            ",".join(map(str, gc.get_threshold())),
            " ".join(sorted(set(Path(name).name for name in files))),
            " ".join(sorted(top_level_packages() - before)),
            os.environ.get(PROCESS_ENV_VAR, "main"),
        ]
    )
    with open(log, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    peak = peak_rss_mib()
    terminalreporter.write_sep("=", f"pytest peak resident memory: {peak:.0f} MiB")
    target = os.environ.get(PEAK_FILE_ENV_VAR)
    if target:
        Path(target).write_text(f"{peak:.0f}\n", encoding="utf-8")
