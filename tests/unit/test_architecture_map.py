"""docs/architecture.md is the map of the tree: every package it names exists, every package is named in it, and
the loose modules at the package top are few and named too."""

from __future__ import annotations

import re
from pathlib import Path

import fsm_rollout

PACKAGE = Path(fsm_rollout.__file__).parent
MAP = PACKAGE.parent / "docs" / "architecture.md"
LOOSE_LIMIT = 8
NOT_COUNTED = {"__init__.py", "__main__.py", "_version.py"}


def map_block() -> list[str]:
    text = MAP.read_text(encoding="utf-8")
    block = text.split("```\nfsm_rollout/\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def named_packages() -> set[str]:
    return {match[1].rstrip("/") for line in map_block() if (match := re.match(r"^  ([a-z_]+(?:/[a-z_]+)*/)", line))}


def named_modules() -> set[str]:
    names: set[str] = set()
    for line in map_block():
        if line.startswith("  ") and not line.startswith("   "):
            names.update(re.findall(r"\b([a-z_]+\.py)\b", line.split("  ", 2)[1] if "  " in line[2:] else line))
    return names


def packages() -> set[str]:
    return {str(path.parent.relative_to(PACKAGE)) for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE}


def test_every_package_the_map_names_exists_and_every_package_is_named() -> None:
    named, actual = named_packages(), packages()
    assert named - actual == set(), "the map names packages that do not exist"
    assert actual - named == set(), "packages missing from docs/architecture.md"


def test_the_loose_modules_are_few_and_each_is_named() -> None:
    loose = {path.name for path in PACKAGE.glob("*.py")} - {"__init__.py"}
    counted = loose - NOT_COUNTED
    assert len(counted) <= LOOSE_LIMIT, sorted(counted)
    assert loose - {"__main__.py"} <= named_modules() | {"__init__.py"}, sorted(loose - named_modules())


def test_the_map_parser_reads_packages_at_both_depths() -> None:
    named = named_packages()
    assert "machine" in named and "engine/local" in named
    assert "no_such_package" not in packages()
