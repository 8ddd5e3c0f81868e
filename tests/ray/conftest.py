"""The Ray tier: rollout workers as actors on a local Ray cluster (2 CPUs, loopback only), and the real
``vllm-router`` binary in front of two servers.

* ``pytest`` runs it with everything else; ``pytest tests/ray`` alone. Ray and vllm-router come with the ``dev``
  extra, so a missing one fails the tier in CI (``CI`` set) and skips it elsewhere; ``FSM_ROLLOUT_SKIP_RAY=1``
  skips it on a developer machine and is refused in CI.
* One cluster serves a test module (:func:`ray_cluster`); its temp dir and logs are under the test session's tmp
  path. Pools in tests use it and must leave it running.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout import RetryPolicy, RolloutConfig, Sample

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0}
ENV_PATH = "fsm_rollout.testing.envs"
ONE_TURN = {"scripted_env": {"steps": [["ok", True]]}}
"""Sample metadata whose scripted environment ends the episode after the first turn."""
RAY_INIT = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
#: Ray waits a fixed 30 s (not configurable) for its raylet to register; on a loaded 2-core machine a cold start can
#: take longer, so a start that timed out is tried again, up to this many starts in all.
RAY_STARTS = 3


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in {"", "0", "false", "no"}


def require(what: str, present: bool) -> None:
    """Skip (a developer machine) or fail (CI) when something the tier needs is missing."""
    if _truthy("FSM_ROLLOUT_SKIP_RAY"):
        if _truthy("CI"):
            pytest.fail("FSM_ROLLOUT_SKIP_RAY is not honoured in CI: the Ray tier must run there", pytrace=False)
        pytest.skip("FSM_ROLLOUT_SKIP_RAY is set")
    if present:
        return
    message = f"{what} is missing: install the project with its dev extra (pip install -e '.[dev]')"
    if _truthy("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def router_binary() -> str:
    """The ``vllm-router`` command of this environment."""
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    require("the vllm-router command", found is not None)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local Ray cluster for one test module, started and stopped here (never by a pool)."""
    require("ray", importlib.util.find_spec("ray") is not None)
    import ray

    if ray.is_initialized():
        pytest.fail("a Ray cluster is already initialised in the test process: a test left one running")
    for start in range(1, RAY_STARTS + 1):
        temp_dir = str(tmp_path_factory.mktemp("ray"))
        try:
            ray.init(address="local", _temp_dir=temp_dir, **RAY_INIT)
            break
        except Exception as error:  # Ray raises a bare Exception for this
            ray.shutdown()
            _kill_processes_under(temp_dir)  # the timed-out start's GCS and raylet, which no handle owns
            if "timed out during startup" not in str(error) or start == RAY_STARTS:
                raise
    try:
        yield ray
    finally:
        ray.shutdown()


def _kill_processes_under(temp_dir: str) -> None:
    """SIGKILL every process whose command line names ``temp_dir`` (a Ray start's own session folder)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in command:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def pool_config(url: str, tokenizer_path: str, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": url,
        "model": MODEL,
        "max_turns": 2,
        "router_policy": "consistent_hash",
        "check_invariants": True,
        "tokenizer_path": tokenizer_path,
        "env_path": ENV_PATH,
        "retry": RetryPolicy(max_attempts=2, base_delay_s=0.01),
    }
    values.update(overrides)
    return RolloutConfig(**values)


def samples(prefix: str, n: int, **metadata: Any) -> list[Sample]:
    """``n`` one-turn samples with session ids ``<prefix>0``, ``<prefix>1``, ..."""
    return [
        Sample(prompt=f"question {i}", index=i, session_id=f"{prefix}{i}", metadata={**ONE_TURN, **metadata})
        for i in range(n)
    ]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ray)
