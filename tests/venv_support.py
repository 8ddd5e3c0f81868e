"""What the test tiers' venv and model builders share: build once into the fsm-rollout cache, publish atomically.

``tests/vllm/build_vllm_env.py``, ``tests/vllm_vl/build_vl_env.py`` and ``tests/integration/verl_venv.py`` each
build something too large to build per test run (a venv, a tiny model) into a keyed directory of the cache. Every
build goes the same way, :func:`publish`: under a file lock (two pytest sessions, or a builder run by hand while
tests run), in a temporary directory next to the final place, completed with a marker file written last and
published with one ``os.rename``; a complete build is reused as is, an incomplete or stale one is moved aside and
replaced. The keys, the markers and what goes into a venv stay with each builder.

The builders also run as scripts (``.venv/bin/python tests/vllm/build_vllm_env.py``), so each puts this directory
on ``sys.path`` before importing this module (under pytest, ``tests/conftest.py`` already has).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final

LOG_TAIL_LINES: Final = 60


class BuildError(RuntimeError):
    """A venv or a model could not be built (the message names the command and holds its output's tail)."""


def log(who: str, message: str) -> None:
    print(f"[{who}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(lock_path: pathlib.Path, who: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``, saying so when another builder holds it first."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(who, f"waiting for another build holding {lock_path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run(command: Sequence[str], build_log: pathlib.Path, *, env: Mapping[str, str] | None = None) -> None:
    """Run ``command``, streaming its output into ``build_log``; raise :class:`BuildError` with the log's tail."""
    with build_log.open("a", encoding="utf-8") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        started = time.perf_counter()
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
        handle.write(f"[exit {result.returncode} after {time.perf_counter() - started:.1f} s]\n")
    if result.returncode != 0:
        try:
            text = build_log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = "<no log>"
        raise BuildError(
            f"command failed (exit {result.returncode}): {' '.join(command)}\n"
            f"--- last {LOG_TAIL_LINES} lines of {build_log} ---\n{_tail(text)}"
        )


def output(command: Sequence[str], build_log: pathlib.Path, *, env: Mapping[str, str] | None = None) -> str:
    """Run ``command`` and return its stripped stdout (its output also goes to ``build_log``); :class:`BuildError`
    with the output's tail when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    both = result.stdout + result.stderr
    with build_log.open("a", encoding="utf-8") as handle:
        handle.write(f"\n$ {' '.join(command)}\n{both}[exit {result.returncode}]\n")
    if result.returncode != 0:
        raise BuildError(
            f"command failed (exit {result.returncode}): {' '.join(command)}\n"
            f"--- last {LOG_TAIL_LINES} lines of its output (full log: {build_log}) ---\n{_tail(both)}"
        )
    return result.stdout.strip()


def base_python() -> str:
    """The interpreter a venv is created from: the base of the running one (never a venv's own python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def pip_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without ``PYTHONPATH``, with pip quiet and non-interactive."""
    env = {**(os.environ if base is None else base), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    return env


def create_venv(staging: pathlib.Path, prompt: str, build_log: pathlib.Path) -> str:
    """Create a venv in ``staging`` from :func:`base_python`; return its python."""
    run([base_python(), "-m", "venv", "--prompt", prompt, str(staging)], build_log)
    return str(staging / "bin" / "python")


def purelib(python: str, build_log: pathlib.Path) -> pathlib.Path:
    """The site-packages directory of ``python``."""
    return pathlib.Path(output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], build_log))


def relocate(staging: pathlib.Path, final: pathlib.Path) -> None:
    """Point the scripts in ``bin/`` (shebangs, activate scripts) and ``pyvenv.cfg`` at the final location."""
    old, new = str(staging).encode(), str(final).encode()
    for path in [staging / "pyvenv.cfg", *(path for path in (staging / "bin").iterdir() if path.is_file())]:
        if path.is_symlink():
            continue
        data = path.read_bytes()
        if old in data and b"\0" not in data[:4096]:
            path.write_bytes(data.replace(old, new))


def read_marker(directory: pathlib.Path, marker: str) -> dict[str, object] | None:
    """The JSON marker of a published build, or None when it is missing or unreadable."""
    try:
        data = json.loads((directory / marker).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def publish(
    final: pathlib.Path,
    what: str,
    build: Callable[[pathlib.Path], dict[str, object]],
    *,
    is_complete: Callable[[pathlib.Path], bool],
    marker: str,
    lock_name: str,
    who: str,
    build_log: pathlib.Path | None = None,
) -> pathlib.Path:
    """Return ``final``, building it first unless it is complete (``what`` names it in the messages).

    ``build(staging)`` fills a staging directory (``.<final's name>.tmp-*`` beside ``final``) and returns what the
    marker records; the marker is written last, so a directory with one is whole. ``build_log``, when given, is
    started afresh for the build. The lock file ``lock_name`` sits in ``final``'s parent.
    """
    if is_complete(final):
        return final
    root = final.parent
    with locked(root / lock_name, who):
        if is_complete(final):  # another process finished it while we waited
            return final
        if final.exists():  # built by an older recipe, or damaged: move it out of the way, rebuild
            stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=root))
            log(who, f"replacing {final} (incomplete, or built by another recipe)")
            os.rename(final, stale / final.name)
            shutil.rmtree(stale, ignore_errors=True)
        if build_log is not None:
            build_log.write_text(f"building {final}\n", encoding="utf-8")
        log(who, f"building {what} in {final}" + (f" (log: {build_log})" if build_log else ""))
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            info = build(staging)
            (staging / marker).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            staging.chmod(0o755)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(who, f"{what} ready in {info['build_seconds']} s: {final}")
    return final
