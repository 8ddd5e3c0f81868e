"""The README's commands are the ones CI runs, and the code stays ruff- and mypy-clean."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = next(command for command in readme_commands() if "pytest" in command)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_starts_with_its_two_commands_run_then_test() -> None:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("\n## ")]
    blocks = re.findall(r"```bash\n(.+?)\n```", head, flags=re.S)
    assert len(blocks) == 2
    assert "fsm-rollout run" in blocks[0]
    assert "pytest" in blocks[1]


def test_the_command_line_summary_names_every_subcommand_and_links_the_reference() -> None:
    from fsm_rollout.cli import build_parser

    text = (ROOT / "README.md").read_text()
    section = text.split("\n## The command line\n", 1)[1].split("\n## ", 1)[0]
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    summarised = re.findall(r"^- `fsm-rollout (\S+)`: \S", section, flags=re.M)
    assert sorted(summarised) == sorted(subcommands)  # each once, with what it does
    assert "](docs/cli.md)" in section and (ROOT / "docs" / "cli.md").is_file()


def test_package_is_ruff_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "fsm_rollout", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_ruff_formatted() -> None:
    """The whole checkout stays as `ruff format` writes it (ruff is pinned in .ci/constraints-cpu.txt, since another
    version may format differently)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_package_is_mypy_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
