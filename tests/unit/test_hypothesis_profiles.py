"""The Hypothesis profiles of ``tests/conftest.py``: the same examples by default, new ones (from a printed,
replayable seed) with ``HYPOTHESIS_PROFILE=explore``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS = Path(__file__).resolve().parents[1]
PROPERTY = """
import os
from hypothesis import given, strategies as st

@given(st.integers())
def test_records_its_examples(number):
    with open(os.environ["EXAMPLES_OUT"], "a") as out:
        out.write(f"{number}\\n")
"""


def test_the_default_profile_replays_the_same_examples() -> None:
    if os.environ.get("HYPOTHESIS_PROFILE"):
        pytest.skip("a profile was chosen for this run")
    assert settings.get_current_profile_name() == "repeatable"
    assert settings.default.derandomize and settings.default.database is None


def run_property(tmp_path: Path, name: str, **env: str) -> tuple[list[str], str]:
    """The property above run under the project's conftest; its examples and pytest's output."""
    (tmp_path / "test_property.py").write_text(PROPERTY)
    examples = tmp_path / f"{name}.txt"
    environ = {key: value for key, value in os.environ.items() if not key.startswith("HYPOTHESIS_")}
    environ.update(env, EXAMPLES_OUT=str(examples))
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_property.py"),
        ],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return examples.read_text().splitlines(), result.stdout


def test_explore_draws_new_examples_from_a_printed_seed_that_replays_them(tmp_path: Path) -> None:
    repeatable, _ = run_property(tmp_path, "repeatable")
    explored, output = run_property(tmp_path, "explore", HYPOTHESIS_PROFILE="explore")
    seeds = re.findall(r"HYPOTHESIS_PROFILE=explore HYPOTHESIS_SEED=(\d+)", output)
    assert len(seeds) == 2 and seeds[0] == seeds[1], output  # in the header and in the summary
    replayed, _ = run_property(tmp_path, "replayed", HYPOTHESIS_PROFILE="explore", HYPOTHESIS_SEED=seeds[0])
    assert explored != repeatable
    assert replayed == explored
