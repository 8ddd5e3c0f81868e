"""Build (or reuse) the layered venv the verl tier runs in, and run the verl cases in it.

verl 0.9.1 requires ``transformers<5.11`` and this project ``>=5.16``, so verl cannot be an extra of the project's
venv. Its agent-loop module does import beside our pins when it is installed without its dependencies plus the few
it needs (:data:`RECIPE`). The tier therefore builds, once, a venv holding only those packages
(``<cache>/<VENV_KEY>/venv``, ``<cache>`` being ``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``), whose
site-packages has one ``.pth`` that adds the site-packages named by ``$FSM_ROLLOUT_VERL_BASE_SITE`` behind its own
(with :func:`site.addsitedir`, so the project's editable install there is honoured too). :func:`run_cases` sets
that variable to the running test venv's site-packages and runs the cases with the layered venv's python, so the
cases see verl, the project and every dev dependency of the venv that runs the tests. The venv itself names no
test venv, so one build serves every checkout.

The build is checked by importing verl's agent loop through the layering and is published by
:func:`venv_support.publish` (staging directory next to the final place, marker written last, atomic rename, file
lock); a venv built by another recipe is replaced.

Usage (from the repository root)::

    .venv/bin/python tests/integration/verl_venv.py     # build/reuse, print the path
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Final

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))

import venv_support
from resource_watch import PEAK_FILE_ENV_VAR, PROCESS_ENV_VAR
from venv_support import BuildError, output, pip_env, run

from fsm_rollout.engine.local.cache import cache_dir

#: The packages of the layered venv, installed with ``--no-deps`` (the adapter's docstring names the same).
RECIPE: Final = (
    "verl==0.9.1",
    "tensordict==0.15.3",
    "pyvers==0.2.3",
    "codetiming==1.4.0",
    "cachetools==8.0.2",
    "hydra-core==1.4.0rc3",
    "omegaconf==2.4.1rc1",
)
#: Bump when the way the venv is built changes (the packages are in the key already).
RECIPE_VERSION: Final = 1
PYTHON_TAG: Final = f"py{sys.version_info.major}.{sys.version_info.minor}"
VENV_KEY: Final = (
    f"{RECIPE[0].replace('==', '-')}-layered-{PYTHON_TAG}-"
    f"{hashlib.sha256(json.dumps([RECIPE_VERSION, *RECIPE]).encode()).hexdigest()[:10]}"
)
MARKER: Final = "fsm-rollout-verl-venv.json"
BASE_SITE_VAR: Final = "FSM_ROLLOUT_VERL_BASE_SITE"
#: Runs at interpreter start-up from the venv's site-packages; a .pth executes a line only when it starts with
#: "import", the whole statement must fit on that line, and it runs under exec with separate locals (so no
#: comprehension, whose scope would not see ``site``).
LAYER_PTH_NAME: Final = "zz_fsm_rollout_verl_base.pth"
LAYER_PTH: Final = (
    "import os, site; "
    f"list(map(site.addsitedir, filter(None, os.environ.get('{BASE_SITE_VAR}', '').split(os.pathsep))))\n"
)
CASES_DIR: Final = pathlib.Path(__file__).parent / "verl_cases"
WHO: Final = "verl_venv"


def venv_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    return (cache or cache_dir()) / VENV_KEY / "venv"


def is_complete(directory: pathlib.Path) -> bool:
    marker = venv_support.read_marker(directory, MARKER)
    return (
        marker is not None
        and marker.get("recipe") == [RECIPE_VERSION, *RECIPE]
        and (directory / "bin" / "python").exists()
    )


def base_site_packages() -> str:
    """The running interpreter's site-packages (pure and platform), as ``$FSM_ROLLOUT_VERL_BASE_SITE`` holds them."""
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    return os.pathsep.join(paths)


def layered_env(base: str | None = None) -> dict[str, str]:
    env = {**os.environ, BASE_SITE_VAR: base if base is not None else base_site_packages()}
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _build(staging: pathlib.Path, final: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    python = venv_support.create_venv(staging, VENV_KEY, log)
    run([python, "-m", "pip", "install", "--no-deps", "--no-compile", "--progress-bar", "off", *RECIPE], log,
        env=pip_env(layered_env(base="")))  # fmt: skip
    installed = time.perf_counter() - started
    (venv_support.purelib(python, log) / LAYER_PTH_NAME).write_text(LAYER_PTH, encoding="utf-8")
    check = (
        "import importlib.metadata as m, json, verl.experimental.agent_loop, fsm_rollout\n"
        "print(json.dumps({name: m.version(name) for name in ('verl', 'transformers', 'omegaconf', 'torch')}))\n"
    )
    versions = json.loads(output([python, "-c", check], log, env=layered_env()).splitlines()[-1])
    venv_support.relocate(staging, final)
    return {
        "key": VENV_KEY,
        "recipe": [RECIPE_VERSION, *RECIPE],
        "checked_with": versions,
        "install_seconds": round(installed, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_venv(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Return the layered verl venv, building it first if needed; :class:`BuildError` when it cannot be built."""
    final = venv_dir(cache)
    log = final.parent / "build.log"
    return venv_support.publish(
        final, "the verl venv", lambda staging: _build(staging, final, log), build_log=log,
        is_complete=is_complete, marker=MARKER, lock_name=".build.lock", who=WHO,
    )  # fmt: skip


def venv_info(cache: pathlib.Path | None = None) -> dict[str, object]:
    data: dict[str, object] = json.loads((venv_dir(cache) / MARKER).read_text(encoding="utf-8"))
    return data


def verl_in_process() -> bool:
    """Whether the running interpreter has verl itself (then the cases run with it, and nothing is built)."""
    return importlib.util.find_spec("verl") is not None


@dataclass(frozen=True)
class CaseRun:
    """One pytest run of the verl cases: its exit code, output and the counts its JUnit report gives."""

    python: str
    returncode: int
    output: str
    tests: int
    failures: int
    errors: int
    skipped: int
    seconds: float

    def problems(self) -> list[str]:
        """Why the run does not count as the tier passing (empty when every case ran and passed)."""
        found = [f"pytest exited {self.returncode}"] if self.returncode != 0 else []
        found += [f"{count} {name}" for name, count in
                  (("failed", self.failures), ("errors", self.errors), ("skipped", self.skipped)) if count]  # fmt: skip
        return found + (["no test ran"] if self.tests == 0 else [])


def run_cases(python: str, report: pathlib.Path, *, cwd: pathlib.Path, cases_dir: pathlib.Path = CASES_DIR) -> CaseRun:
    """Run every ``verl_case_*.py`` of ``cases_dir`` with ``python`` (the layered venv's or the running one)."""
    cases = sorted(str(path) for path in cases_dir.glob("verl_case_*.py"))
    if not cases:
        raise FileNotFoundError(f"no verl_case_*.py in {cases_dir}")
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *cases]
    started = time.perf_counter()
    env = {**layered_env(), PROCESS_ENV_VAR: "verl venv"}  # its lines in a resource log are the child's
    env.pop(PEAK_FILE_ENV_VAR, None)  # the peak .ci/run prints is the suite process's own
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, check=False)
    seconds = time.perf_counter() - started
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.is_file():
        root = ElementTree.parse(report).getroot()
        for suite in [root] if root.tag == "testsuite" else list(root):
            for name in counts:
                counts[name] += int(suite.get(name, "0"))
    return CaseRun(python, result.returncode, f"$ {' '.join(command)}\n{result.stdout}{result.stderr}",
                   seconds=seconds, **counts)  # fmt: skip


if __name__ == "__main__":
    began = time.perf_counter()
    try:
        path = ensure_venv()
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    print(f"venv: {path} ({time.perf_counter() - began:.1f} s; {venv_info()})")
