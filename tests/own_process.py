"""Test modules marked ``own_process`` run in a pytest process of their own, so the suite's process never imports
what they import.

A foreign framework's first import is a lasting step up in a process's memory (TRL's trainer, Gymnasium with GEM,
skyrl-gym, the agent frameworks: 180-400 MiB each), and one pytest process that imports them all does not fit the
suite's memory budget. A module that imports one is marked at its top (``pytestmark = pytest.mark.own_process``); its
own top-level imports must stay light, since the suite's process still collects it.

How it runs: at the first of a marked module's selected tests, a child pytest (the same interpreter, rootdir and
ini file) is started on exactly the module's selected tests. The child sends each test's reports back through a
pipe, serialized by pytest's own hooks (as pytest-xdist does), and the suite's process reports them as its own, test
by test: each test passes, fails, skips or errors on its own line with the child's traceback and captured output,
and ``-x``, ``-ra`` and JUnit reports see them. A test the child gave no result for (the child crashed, was killed,
or could not collect it) fails with the child's exit code and the end of its output.

The child is a process group of its own with the parent-death signal and a watchdog (:mod:`process_groups`), so it
and anything it starts end with the suite's process; a child still running when the session ends (``-x``, Ctrl-C)
is stopped. Its peak resident memory is reported back: the summary names the largest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import pytest
from process_groups import start_group, stop_group
from resource_watch import PEAK_FILE_ENV_VAR, PROCESS_ENV_VAR, peak_rss_mib

MARKER = "own_process"
#: Set in the child: the pipe's descriptor its reports go to (and the sign that it is the child).
REPORTS_FD_ENV_VAR = "FSM_ROLLOUT_OWN_PROCESS_REPORTS_FD"
#: Lines of the child's output a test it gave no result for shows.
OUTPUT_TAIL_LINES = 60


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: the module's tests run in a pytest process of their own (tests/own_process.py): they import a "
        "big foreign framework that the suite's process should not hold",
    )
    fd = os.environ.get(REPORTS_FD_ENV_VAR)
    if fd:
        config.pluginmanager.register(_Relay(config, os.fdopen(int(fd), "w", encoding="utf-8")), "own_process_relay")
    else:
        config.pluginmanager.register(_Runner(config), "own_process_runner")


class _Relay:
    """In the child: every report, and at the end the child's peak memory, as JSON lines down the pipe."""

    def __init__(self, config: pytest.Config, out: IO[str]) -> None:
        self.config = config
        self.out = out

    def _send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._send({"report": self.config.hook.pytest_report_to_serializable(config=self.config, report=report)})

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._send({"collect_error": f"{report.nodeid}: {report.longreprtext}"})

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._send({"peak_rss_mib": round(peak_rss_mib())})
        self.out.close()


class _Child:
    """One child pytest running one module's tests, and what it has sent so far."""

    def __init__(self, config: pytest.Config, module: str, nodeids: list[str]) -> None:
        self.config = config
        self.module = module
        self.nodeids = nodeids
        self.reports: dict[str, list[Any]] = {}
        self.finished: set[str] = set()
        self.collect_errors: list[str] = []
        self.peak_mib: int | None = None
        self.returncode: int | None = None
        self.output: IO[bytes] | None = None
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env[REPORTS_FD_ENV_VAR] = str(write_fd)
        env.pop(PEAK_FILE_ENV_VAR, None)  # the suite's peak is the suite process's own
        env[PROCESS_ENV_VAR] = "own process"
        seed = config.getoption("hypothesis_seed", None)
        if seed is not None:
            env["HYPOTHESIS_SEED"] = str(seed)  # an exploring session's examples, in the child too
        if config.option.capture == "no":
            streams: dict[str, Any] = {}
        else:
            self.output = tempfile.TemporaryFile()  # noqa: SIM115 - read after the child ends, closed in stop()
            streams = {"stdout": self.output, "stderr": subprocess.STDOUT}
        try:
            self.process = start_group(
                self.command(nodeids), stdin=subprocess.DEVNULL, env=env, cwd=config.rootpath, pass_fds=(write_fd,),
                **streams,
            )  # fmt: skip
        finally:
            os.close(write_fd)  # the child holds the only write end: end of file is its exit
        self.reader = os.fdopen(read_fd, "r", encoding="utf-8")

    def command(self, nodeids: list[str]) -> list[str]:
        config = self.config
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(config.rootpath)]
        if config.inipath is not None:
            command += ["-c", str(config.inipath)]
        command += [f"--capture={config.option.capture}", f"--tb={config.option.tbstyle}"]
        if config.option.showlocals:
            command.append("--showlocals")
        if config.option.verbose > 0:
            command.append("-" + "v" * config.option.verbose)  # assertion diffs are as detailed as asked
        command += [f"-W{warning}" for warning in config.known_args_namespace.pythonwarnings or []]
        return command + nodeids

    def reports_for(self, nodeid: str) -> list[Any]:
        """The reports of ``nodeid``, reading the pipe until its teardown report arrives or the child ends."""
        while nodeid not in self.finished and self.returncode is None:
            line = self.reader.readline()
            if not line:
                self.finish()
                break
            message = json.loads(line)
            if "report" in message:
                report = self.config.hook.pytest_report_from_serializable(config=self.config, data=message["report"])
                if isinstance(report.longrepr, list):
                    report.longrepr = tuple(report.longrepr)  # a skip's (path, line, reason), a list after JSON
                self.reports.setdefault(report.nodeid, []).append(report)
                if report.when == "teardown":
                    self.finished.add(report.nodeid)
            elif "collect_error" in message:
                self.collect_errors.append(message["collect_error"])
            elif "peak_rss_mib" in message:
                self.peak_mib = int(message["peak_rss_mib"])
        if self.returncode is None and self.finished.issuperset(self.nodeids):
            self.reports_for("")  # the last test's reports are in: read on to the child's exit (and its peak)
        return self.reports.get(nodeid, [])

    def finish(self) -> None:
        """Wait for the child to exit (the pipe is closed), then stop what is left of its group."""
        self.reader.close()
        self.returncode = self.process.wait()
        stop_group(self.process)

    def stop(self) -> None:
        """Stop the child if it still runs (the session ends before its last test: -x, Ctrl-C), and let its output
        go."""
        if self.returncode is None:
            stop_group(self.process)
            self.reader.close()
            self.returncode = self.process.returncode
        if self.output is not None:
            self.output.close()
            self.output = None

    def output_tail(self) -> str:
        if self.output is None:
            return "(the child's output went to the terminal: -s)"
        self.output.seek(0)
        lines = self.output.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-OUTPUT_TAIL_LINES:])

    def missing(self, item: pytest.Item) -> pytest.TestReport:
        """A failed call report for a test the child gave no result for."""
        reason = f"it exited {self.returncode}" if self.returncode is not None else "it is still running"
        errors = "".join(f"\nit could not collect: {error}" for error in self.collect_errors)
        text = (
            f"this test's own pytest process ({MARKER}: {self.module}) gave no result for it: {reason}{errors}\n"
            f"--- the last lines of its output ---\n{self.output_tail()}"
        )
        now = time.time()
        keywords: dict[str, Any] = dict.fromkeys(item.keywords, 1)
        return pytest.TestReport(item.nodeid, item.location, keywords, "failed", text, "call", start=now, stop=now)


class _Runner:
    """In the suite's process: marked tests are reported from their module's child instead of being run here."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.children: dict[str, _Child] = {}

    def child_for(self, item: pytest.Item) -> _Child:
        module = str(item.path)
        child = self.children.get(module)
        if child is None:
            for other in self.children.values():
                other.stop()  # a module interrupted by -x or an error here; its tests will not be asked for
            nodeids = [
                selected.nodeid
                for selected in item.session.items
                if selected.path == item.path and selected.get_closest_marker(MARKER) is not None
            ]
            child = _Child(self.config, os.path.relpath(module, self.config.rootpath), nodeids)
            self.children[module] = child
        return child

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if item.get_closest_marker(MARKER) is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        child = self.child_for(item)
        reports = child.reports_for(item.nodeid)
        if not any(report.when == "call" or report.failed for report in reports):
            reports = [*reports, child.missing(item)]
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        # what earlier tests of this process set up and the next one does not need is torn down now, as the runner's
        # teardown does after a test (pytest's set-up stack has no public handle; the teardown hook itself is not
        # called: other plugins' teardowns expect their setup to have run)
        teardown = pytest.CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown")
        if teardown.excinfo is not None:
            ihook.pytest_runtest_logreport(report=ihook.pytest_runtest_makereport(item=item, call=teardown))
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def pytest_sessionfinish(self) -> None:
        for child in self.children.values():
            child.stop()

    def largest_child(self) -> _Child | None:
        measured = [child for child in self.children.values() if child.peak_mib is not None]
        return max(measured, key=lambda child: child.peak_mib or 0, default=None)

    @pytest.hookimpl(trylast=True)  # after resource_watch wrote the suite's own peak
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        largest = self.largest_child()
        if largest is None:
            return
        line = f"largest own-process test module: {largest.peak_mib} MiB ({largest.module})"
        terminalreporter.write_sep("=", line)
        target = os.environ.get(PEAK_FILE_ENV_VAR)
        if target and Path(target).is_file():
            with open(target, "a", encoding="utf-8") as out:
                out.write(line + "\n")
