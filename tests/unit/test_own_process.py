"""``own_process`` (tests/own_process.py): a marked module's selected tests run in a child pytest and are reported one
by one by the suite's process, which never imports what they import; a child that dies fails the tests it left
without a result, with its exit code and output, and the rest of the session goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys

sys.path.insert(0, {str(TESTS)!r})
pytest_plugins = ["resource_watch", "own_process"]


def pytest_sessionfinish(session):
    # what the suite's process had imported at its end
    with open("parent-modules.txt", "w") as out:
        out.write("\\n".join(sorted(sys.modules)))
"""

MARKED = """
import os
import signal

import pytest

pytestmark = pytest.mark.own_process


def test_imports_the_big_framework():
    import big_framework

    assert big_framework.LOADED
    print("from the child")


def test_fails():
    assert os.getpid() == -1, "a failure the child saw"


def test_skips():
    pytest.skip("not here")


@pytest.fixture
def broken():
    raise RuntimeError("a fixture that breaks")


def test_errors(broken):
    pass


def test_kills_its_process():
    if os.environ.get("KILL_THE_CHILD"):
        os.kill(os.getpid(), signal.SIGKILL)


def test_after_the_kill():
    pass
"""

PLAIN = """
import os
from pathlib import Path


def test_runs_in_the_suites_process():
    Path("plain-pid.txt").write_text(str(os.getpid()))
"""


def run_suite(
    tmp_path: Path, *args: str, kill: bool = False
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """pytest over a marked module and a plain one (in that order); the outcome of each test from the JUnit report."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "big_framework.py").write_text("LOADED = True\n")
    (tmp_path / "test_a_marked.py").write_text(MARKED)
    (tmp_path / "test_b_plain.py").write_text(PLAIN)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("FSM_ROLLOUT_")}
    if kill:
        env["KILL_THE_CHILD"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--junitxml=report.xml", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    outcomes = {}
    for case in ElementTree.parse(tmp_path / "report.xml").getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name", "")] = kinds[0] if kinds else "passed"
    return run, outcomes


def test_each_marked_test_is_reported_on_its_own_and_the_suites_process_never_imports_it(tmp_path: Path) -> None:
    run, outcomes = run_suite(tmp_path)
    assert outcomes == {
        "test_imports_the_big_framework": "passed",
        "test_fails": "failure",
        "test_skips": "skipped",
        "test_errors": "error",
        "test_kills_its_process": "passed",
        "test_after_the_kill": "passed",
        "test_runs_in_the_suites_process": "passed",
    }, run.stdout
    assert run.returncode == 1
    assert "a failure the child saw" in run.stdout
    assert "a fixture that breaks" in run.stdout
    assert "from the child" in run.stdout  # -rA shows the passing test's captured output
    assert "largest own-process test module:" in run.stdout
    parent_modules = (tmp_path / "parent-modules.txt").read_text().split()
    assert "big_framework" not in parent_modules
    assert "own_process" in parent_modules  # the plugin was there, so the test above ran elsewhere


def test_tests_a_dead_child_left_fail_with_its_exit_code_and_the_session_goes_on(tmp_path: Path) -> None:
    run, outcomes = run_suite(tmp_path, "-k", "framework or kills or after or plain", kill=True)
    assert outcomes == {
        "test_imports_the_big_framework": "passed",
        "test_kills_its_process": "failure",
        "test_after_the_kill": "failure",
        "test_runs_in_the_suites_process": "passed",
    }, run.stdout  # and the deselected tests ran nowhere
    assert "gave no result for it: it exited -9" in run.stdout
