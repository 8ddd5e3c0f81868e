"""Only what users run ships in the wheel: the build finds the package alone (``tools/``, the maintainers' tools,
stays in the checkout), no module of the package needs ``tools/``, and no maintainer tool creeps back in."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import setuptools

import fsm_rollout

PACKAGE = Path(fsm_rollout.__file__).parent
REPO = PACKAGE.parent
TOOLS = REPO / "tools"

MAINTAINER_MARKERS = {
    "BEGIN GENERATED": "rewrites the checkout's generated documents (tools/docs.py)",
    "Page.captureScreenshot": "shoots pictures in a browser over DevTools (tools/chromium.py)",
    "--remote-debugging-port": "drives a browser over DevTools (tools/chromium.py)",
}
"""Text only a maintainer's tool holds, each with what that tool does."""


def wheel_packages() -> list[str]:
    """The packages the build puts in the wheel: setuptools' discovery with the project's own settings."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return sorted(setuptools.find_packages(where=str(REPO), include=config["include"]))


def test_the_wheel_holds_the_package_and_not_the_maintainers_tools() -> None:
    packages = wheel_packages()
    assert {"fsm_rollout", "fsm_rollout.cli", "fsm_rollout.cli.bench", "fsm_rollout.report"} <= set(packages)
    assert [name for name in packages if name.split(".")[0] != "fsm_rollout"] == []
    assert (TOOLS / "__init__.py").is_file()  # a package discovery would take, without the project's include


def test_no_module_of_the_package_imports_the_maintainers_tools() -> None:
    imports = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            imports += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "tools"]
    assert imports == [], "an installed package has no tools/: the module belongs in tools/ too"


def test_no_maintainer_tool_creeps_back_into_the_package() -> None:
    tools_text = "\n".join(path.read_text() for path in TOOLS.glob("*.py"))
    assert all(marker in tools_text for marker in MAINTAINER_MARKERS)  # each marker does find its tool
    found = [
        f"{path.relative_to(REPO)} {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for marker, what in MAINTAINER_MARKERS.items()
        if marker in path.read_text()
    ]
    assert found == [], "maintainers' tools live in tools/, which is not installed"
