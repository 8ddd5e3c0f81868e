"""One version: the package metadata's, the package's ``__version__``, and what tapes and the CLI report."""

from __future__ import annotations

import tomllib
from pathlib import Path

import fsm_rollout
from fsm_rollout._version import __version__

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_version_is_the_project_metadata_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert __version__ == project["version"] == fsm_rollout.__version__
