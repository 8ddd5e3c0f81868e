"""A missing seed file never passes unnoticed: CI fails, a developer run skips with a warning and a banner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SELECTED = "multi_turn_until_max_turns and fsm_rollout_sample"  # one differential test is enough


def run_seed_tier(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {key: value for key, value in os.environ.items() if key not in {"CI", "FSM_ROLLOUT_SKIP_SEED"}}
    environ.update(env, FSM_ROLLOUT_SEED=str(tmp_path / "no-such-seed.py"))
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/seed/test_seed_differential.py",
            "-k",
            SELECTED,
            "-p",
            "no:cacheprovider",
            "-q",
        ],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("env", "code", "expected", "unexpected"),
    [
        ({}, 0, ["SEED DIFFERENTIAL TIER NOT RUN: 1 test skipped", "PytestWarning", "1 skipped"], []),
        ({"FSM_ROLLOUT_SKIP_SEED": "1"}, 0, ["SEED DIFFERENTIAL TIER NOT RUN: 1 test skipped"], ["PytestWarning"]),
        ({"CI": "true"}, 1, ["in CI the seed differential tier must run", "1 error"], ["skipped"]),
        ({"CI": "true", "FSM_ROLLOUT_SKIP_SEED": "1"}, 1, ["FSM_ROLLOUT_SKIP_SEED is refused in CI"], ["skipped"]),
    ],
    ids=["developer", "developer_skip_requested", "ci", "ci_skip_requested"],
)
def test_a_missing_seed_is_reported_or_fails(
    tmp_path: Path, env: dict[str, str], code: int, expected: list[str], unexpected: list[str]
) -> None:
    result = run_seed_tier(tmp_path, **env)
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    for text in expected:
        assert text in output, output
    for text in unexpected:
        assert text not in output, output
