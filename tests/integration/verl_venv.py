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

The build happens in a temporary directory next to its final place, is checked by importing verl's agent loop
through the layering, gets a marker file written last and is published with one ``os.rename``; a file lock
serialises concurrent builders. A venv built by another recipe is replaced.

Usage (from the repository root)::

    .venv/bin/python tests/integration/verl_venv.py     # build/reuse, print the path
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

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
LOG_TAIL_LINES: Final = 60


class BuildError(RuntimeError):
    """The venv could not be built (the message names the command and holds its output's tail)."""


def venv_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    return (cache or cache_dir()) / VENV_KEY / "venv"


def is_complete(directory: pathlib.Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == [RECIPE_VERSION, *RECIPE] and (directory / "bin" / "python").exists()


def base_site_packages() -> str:
    """The running interpreter's site-packages (pure and platform), as ``$FSM_ROLLOUT_VERL_BASE_SITE`` holds them."""
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    return os.pathsep.join(paths)


def layered_env(base: str | None = None) -> dict[str, str]:
    env = {**os.environ, BASE_SITE_VAR: base if base is not None else base_site_packages()}
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _log(message: str) -> None:
    print(f"[verl_venv] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another build holding {lock_path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _run(command: Sequence[str], log: pathlib.Path, *, env: dict[str, str] | None = None) -> str:
    """Run ``command``, append its output to ``log``, return it; raise :class:`BuildError` with its tail."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    output = result.stdout + result.stderr
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"\n$ {' '.join(command)}\n{output}[exit {result.returncode}]\n")
    if result.returncode != 0:
        raise BuildError(
            f"command failed (exit {result.returncode}): {' '.join(command)}\n"
            f"--- last {LOG_TAIL_LINES} lines of its output (full log: {log}) ---\n{_tail(output)}"
        )
    return result.stdout


def _base_python() -> str:
    """The interpreter the venv is created from: the base of the running one (never a venv's own python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _relocate(staging: pathlib.Path, final: pathlib.Path) -> None:
    """Point the scripts in ``bin/`` and ``pyvenv.cfg`` at the final location."""
    old, new = str(staging).encode(), str(final).encode()
    for path in [staging / "pyvenv.cfg", *(path for path in (staging / "bin").iterdir() if path.is_file())]:
        if path.is_symlink():
            continue
        data = path.read_bytes()
        if old in data and b"\0" not in data[:4096]:
            path.write_bytes(data.replace(old, new))


def _build(staging: pathlib.Path, final: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    python = str(staging / "bin" / "python")
    _run([_base_python(), "-m", "venv", "--prompt", VENV_KEY, str(staging)], log)
    pip_env = {**layered_env(base=""), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    _run([python, "-m", "pip", "install", "--no-deps", "--no-compile", "--progress-bar", "off", *RECIPE], log,
         env=pip_env)  # fmt: skip
    installed = time.perf_counter() - started
    site_packages = pathlib.Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], log).strip()
    )
    (site_packages / LAYER_PTH_NAME).write_text(LAYER_PTH, encoding="utf-8")
    check = (
        "import importlib.metadata as m, json, verl.experimental.agent_loop, fsm_rollout\n"
        "print(json.dumps({name: m.version(name) for name in ('verl', 'transformers', 'omegaconf', 'torch')}))\n"
    )
    versions = json.loads(_run([python, "-c", check], log, env=layered_env()).splitlines()[-1])
    _relocate(staging, final)
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
    if is_complete(final):
        return final
    root = final.parent
    with _locked(root / ".build.lock"):
        if is_complete(final):  # another process finished it while we waited
            return final
        if final.exists():  # damaged or left by hand: move it out of the way, rebuild
            stale = pathlib.Path(tempfile.mkdtemp(prefix=".venv.stale-", dir=root))
            os.rename(final, stale / "venv")
            shutil.rmtree(stale, ignore_errors=True)
        log = root / "build.log"
        log.write_text(f"building {final}\n", encoding="utf-8")
        _log(f"building the verl venv {final} (log: {log})")
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".venv.tmp-", dir=root))
        try:
            info = _build(staging, final, log)
            (staging / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            staging.chmod(0o755)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _log(f"verl venv ready in {info['build_seconds']} s: {info}")
    return final


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
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=layered_env(), check=False)
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
