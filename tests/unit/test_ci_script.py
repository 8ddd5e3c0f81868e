"""``.ci/run`` requires Graphviz, Chromium, and Node with npm: it installs each with apt-get when missing, and a failed
install fails CI."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_ci(tmp_path: Path, apt_get: str, *, missing: str = "dot") -> subprocess.CompletedProcess[str]:
    """``.ci/run`` copied into an empty checkout, with a PATH of stubs: no ``missing`` program (``dot``, ``chromium``
    or ``node``; the others are there, ``npm`` too), the given ``apt-get``, and a ``python3`` that only records its
    arguments (so nothing is installed or tested for real)."""
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", checkout / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id", "rm", "chmod", "mktemp", "cat"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    _stub(bin_dir, "sudo", 'exec "$@"')
    _stub(bin_dir, "apt-get", apt_get.replace("BIN", str(bin_dir)))
    _stub(bin_dir, "python3", f'echo "$@" >> {tmp_path}/python3.log')
    for program in {"dot", "chromium", "node", "npm"} - {missing}:
        _stub(bin_dir, program, "exit 0")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run(
        [str(bin_dir / "bash"), str(checkout / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("apt_get", "message"),
    [
        ("exit 100", "Graphviz is required"),
        ('[ "$1" = update ] && exit 1; exit 0', "Graphviz is required"),
        ("exit 0", "dot is still not on PATH"),
    ],
    ids=["install_fails", "update_fails", "installs_nothing"],
)
def test_ci_fails_when_graphviz_cannot_be_installed(tmp_path: Path, apt_get: str, message: str) -> None:
    result = run_ci(tmp_path, apt_get)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "python3.log").exists(), "the run went on without Graphviz"


def test_ci_installs_graphviz_and_goes_on(tmp_path: Path) -> None:
    installs_dot = 'if [ "$1" = install ]; then printf "#!/bin/sh\\n" > BIN/dot; chmod +x BIN/dot; fi'
    result = run_ci(tmp_path, installs_dot)
    assert (tmp_path / "bin" / "dot").exists()
    assert (tmp_path / "python3.log").read_text().startswith("-m venv .venv"), result.stderr
    assert os.access(tmp_path / "bin" / "dot", os.X_OK)


@pytest.mark.parametrize(
    ("apt_get", "message"),
    [
        ("exit 100", "Chromium is required"),
        ('[ "$1" = update ] && exit 1; exit 0', "Chromium is required"),
        ("exit 0", "chromium is still not on PATH"),
    ],
    ids=["install_fails", "update_fails", "installs_nothing"],
)
def test_ci_fails_when_chromium_cannot_be_installed(tmp_path: Path, apt_get: str, message: str) -> None:
    result = run_ci(tmp_path, apt_get, missing="chromium")
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "python3.log").exists(), "the run went on without Chromium"


def test_ci_installs_chromium_and_goes_on(tmp_path: Path) -> None:
    installs = 'if [ "$1" = install ]; then printf "#!/bin/sh\\n" > BIN/chromium; chmod +x BIN/chromium; fi'
    result = run_ci(tmp_path, installs, missing="chromium")
    assert (tmp_path / "python3.log").read_text().startswith("-m venv .venv"), result.stderr
    assert os.access(tmp_path / "bin" / "chromium", os.X_OK)


@pytest.mark.parametrize(
    ("apt_get", "message"),
    [
        ("exit 100", "Node and npm are required"),
        ('[ "$1" = update ] && exit 1; exit 0', "Node and npm are required"),
        ("exit 0", "node or npm is still not on PATH"),
    ],
    ids=["install_fails", "update_fails", "installs_nothing"],
)
def test_ci_fails_when_node_cannot_be_installed(tmp_path: Path, apt_get: str, message: str) -> None:
    result = run_ci(tmp_path, apt_get, missing="node")
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "python3.log").exists(), "the run went on without Node"


def test_ci_installs_node_and_goes_on(tmp_path: Path) -> None:
    installs = 'if [ "$1" = install ]; then printf "#!/bin/sh\\n" > BIN/node; chmod +x BIN/node; fi'
    result = run_ci(tmp_path, installs, missing="node")
    assert (tmp_path / "python3.log").read_text().startswith("-m venv .venv"), result.stderr
    assert os.access(tmp_path / "bin" / "node", os.X_OK)
