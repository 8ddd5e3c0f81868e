"""Fixtures for the seed differential tests: the seed file, and the vime stand-in on ``sys.path`` for one test.

The differential tests need the seed rollout at ``<repository>/../shared/seed/geo3k_rollout_seed.py`` (or at
``$FSM_ROLLOUT_SEED``). When it is missing:

* with ``$CI`` set, every test that needs it fails (CI must not pass without running the tier), and
  ``FSM_ROLLOUT_SKIP_SEED=1`` is refused;
* otherwise they are skipped, loudly: one ``PytestWarning`` and a summary line at the end of the run saying how
  many tests did not run and where the seed was looked for. ``FSM_ROLLOUT_SKIP_SEED=1`` says the skip is meant
  and drops the warning (the summary line stays).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

STANDIN_ROOT = Path(__file__).resolve().parent / "vime_standin"
SEED_ENV_VAR = "FSM_ROLLOUT_SEED"
SKIP_ENV_VAR = "FSM_ROLLOUT_SKIP_SEED"
NOT_RUN_BANNER = "SEED DIFFERENTIAL TIER NOT RUN"

_skipped_for_missing_seed: list[str] = []


def seed_path() -> Path:
    """``$FSM_ROLLOUT_SEED``, else ``shared/seed/geo3k_rollout_seed.py`` beside the repository."""
    override = os.environ.get(SEED_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared/seed/geo3k_rollout_seed.py"


@pytest.fixture
def seed_file(request: pytest.FixtureRequest) -> Path:
    """The seed rollout's path; fails (in CI) or skips loudly (elsewhere) when there is no file there."""
    path = seed_path()
    if path.is_file():
        return path
    reason = f"seed rollout not found at {path} (set ${SEED_ENV_VAR} or put shared/ beside the repository)"
    if os.environ.get("CI"):
        refused = f"; ${SKIP_ENV_VAR} is refused in CI" if os.environ.get(SKIP_ENV_VAR) else ""
        pytest.fail(f"{reason}: in CI the seed differential tier must run{refused}", pytrace=False)
    if not _skipped_for_missing_seed and os.environ.get(SKIP_ENV_VAR) != "1":
        warnings.warn(
            pytest.PytestWarning(
                f"{reason}: the seed differential tests are skipped and the library is NOT compared with the seed "
                f"(set {SKIP_ENV_VAR}=1 if that is intended)"
            ),
            stacklevel=1,
        )
    _skipped_for_missing_seed.append(request.node.nodeid)
    pytest.skip(reason)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _skipped_for_missing_seed:
        return
    intended = os.environ.get(SKIP_ENV_VAR) == "1"
    count = len(_skipped_for_missing_seed)
    terminalreporter.write_sep(
        "=" if intended else "!",
        f"{NOT_RUN_BANNER}: {count} test{'' if count == 1 else 's'} skipped, no seed at {seed_path()}"
        + (f" ({SKIP_ENV_VAR}=1)" if intended else ""),
        yellow=True,
        bold=not intended,
    )


def _drop_vime_modules() -> None:
    for name in [name for name in sys.modules if name == "vime" or name.startswith("vime.")]:
        del sys.modules[name]


@pytest.fixture
def vime_standin(tokenizer: Any) -> Iterator[ModuleType]:
    """Put the vime stand-in on ``sys.path`` for one test; yields its ``vllm_rollout`` with the tokenizer set.

    ``vime*`` modules are dropped before and after, so every test starts with a fresh ``GenerateState``
    singleton and nothing of the stand-in leaks into other tests.
    """
    root = str(STANDIN_ROOT)
    _drop_vime_modules()
    sys.path.insert(0, root)
    try:
        vllm_rollout = importlib.import_module("vime.rollout.vllm_rollout")
        vllm_rollout.TOKENIZER = tokenizer
        vllm_rollout.PROCESSOR = None
        yield vllm_rollout
    finally:
        _drop_vime_modules()
        if root in sys.path:
            sys.path.remove(root)
