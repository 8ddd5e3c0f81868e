"""Install (or reuse) the coding harnesses the harness tier runs, unchanged, from npm at pinned versions.

``npm install`` of :data:`PACKAGES` goes into ``<cache>/<INSTALL_KEY>/npm`` (``<cache>`` being
``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``), published by :func:`venv_support.publish` (staging directory
next to the final place, marker written last, atomic rename, file lock). The install is checked by asking each
binary its version; an install by another recipe is replaced. About 12 s and 760 MB (the two packages carry native
binaries for this platform).

Usage (from the repository root)::

    .venv/bin/python tests/harness/harness_install.py     # install/reuse, print the binaries' paths
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Final

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))

import venv_support
from venv_support import BuildError, output, run

from fsm_rollout.engine.local.cache import cache_dir

CODEX_VERSION: Final = "0.169.0"
CLAUDE_CODE_VERSION: Final = "2.1.328"
PACKAGES: Final = (f"@openai/codex@{CODEX_VERSION}", f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}")
#: Bump when the way the install is made changes (the packages are in the key already).
RECIPE_VERSION: Final = 1
INSTALL_KEY: Final = (
    f"harnesses-codex-{CODEX_VERSION}-claude-code-{CLAUDE_CODE_VERSION}-"
    f"{hashlib.sha256(json.dumps([RECIPE_VERSION, *PACKAGES]).encode()).hexdigest()[:10]}"
)
MARKER: Final = "fsm-rollout-harnesses.json"
WHO: Final = "harness_install"


@dataclass(frozen=True)
class Harnesses:
    """The installed binaries: ``codex`` (a Node shim that runs the native binary) and ``claude`` (native)."""

    root: pathlib.Path
    codex: pathlib.Path
    claude: pathlib.Path


def install_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    return (cache or cache_dir()) / INSTALL_KEY / "npm"


def binaries(root: pathlib.Path) -> Harnesses:
    bin_dir = root / "node_modules" / ".bin"
    return Harnesses(root=root, codex=bin_dir / "codex", claude=bin_dir / "claude")


def is_complete(directory: pathlib.Path) -> bool:
    marker = venv_support.read_marker(directory, MARKER)
    found = binaries(directory)
    return (
        marker is not None
        and marker.get("recipe") == [RECIPE_VERSION, *PACKAGES]
        and found.codex.exists()
        and found.claude.exists()
    )


def npm_env() -> dict[str, str]:
    """This process's environment with npm quiet: no audit, funding or update notices."""
    return {
        **os.environ,
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "npm_config_update_notifier": "false",
    }


def missing_tools() -> list[str]:
    """The commands the install and the harnesses need that are not on PATH (``npm`` installs, ``node`` runs the
    Codex shim)."""
    return [name for name in ("node", "npm") if shutil.which(name) is None]


def _build(staging: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    npm = shutil.which("npm")
    if npm is None:
        raise BuildError("npm is not on PATH: the harness tier installs Codex and Claude Code with it")
    run([npm, "install", "--prefix", str(staging), "--no-package-lock", *PACKAGES], log, env=npm_env())
    installed = time.perf_counter() - started
    found = binaries(staging)
    versions = {
        "codex": output([str(found.codex), "--version"], log),
        "claude": output([str(found.claude), "--version"], log),
        "node": output(["node", "--version"], log),
    }
    # the binaries say their own versions: an install that resolved anything else is refused
    if CODEX_VERSION not in versions["codex"] or CLAUDE_CODE_VERSION not in versions["claude"]:
        raise BuildError(f"the installed harnesses report {versions}, not {PACKAGES}")
    return {
        "key": INSTALL_KEY,
        "recipe": [RECIPE_VERSION, *PACKAGES],
        "versions": versions,
        "install_seconds": round(installed, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_harnesses(cache: pathlib.Path | None = None) -> Harnesses:
    """The installed harnesses, installing them first if needed; :class:`BuildError` when that fails."""
    final = install_dir(cache)
    log = final.parent / "build.log"
    root = venv_support.publish(
        final, "the coding harnesses", lambda staging: _build(staging, log), build_log=log,
        is_complete=is_complete, marker=MARKER, lock_name=".build.lock", who=WHO,
    )  # fmt: skip
    return binaries(root)


if __name__ == "__main__":
    harnesses = ensure_harnesses()
    print(f"codex:  {harnesses.codex}\nclaude: {harnesses.claude}")
