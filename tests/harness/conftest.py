"""The coding-harness tier: Codex CLI and Claude Code from npm, unchanged, drive the gateway (marked ``harness``).

The session fixture :func:`harnesses` installs the pinned packages once into the cache (``harness_install.py``:
about 12 s to a minute and 760 MB in ``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``) and reuses them after.

Running it:

* ``pytest`` runs this tier with everything else; ``pytest -m harness`` runs only it, ``-m "not harness"`` leaves
  it out.
* It needs ``node`` and ``npm`` on PATH and npm's registry for the first install. Without node or npm the tier
  skips on a developer machine and fails when ``CI`` is set; ``FSM_ROLLOUT_SKIP_HARNESS=1`` skips it too (refused
  when ``CI`` is set). An install that fails fails the tests.

Each harness runs as a subprocess in a process group of its own, with its home, its configuration and its working
directory in the test's temporary folder; the group is killed when the test ends, however it ends.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import harness_install
from harness_install import Harnesses
from harness_support import MODEL_CASES, ModelCase

SKIP_VAR = "FSM_ROLLOUT_SKIP_HARNESS"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in {"", "0", "false", "no"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.harness)


def _unavailable(reason: str) -> None:
    if _truthy("CI"):
        pytest.fail(f"the harness tier must run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def harnesses() -> Harnesses:
    if _truthy(SKIP_VAR):
        _unavailable(f"{SKIP_VAR} is set")
    missing = harness_install.missing_tools()
    if missing:
        _unavailable(f"{' and '.join(missing)} not on PATH: the harness tier installs and runs Codex and Claude Code")
    return harness_install.ensure_harnesses()


@pytest.fixture(params=sorted(MODEL_CASES))
def model(request: pytest.FixtureRequest) -> ModelCase:
    """The engine's model: a plain template, and a thinking one whose reasoning the harness must echo back."""
    return MODEL_CASES[str(request.param)]
