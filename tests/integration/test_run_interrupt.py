"""Ctrl-C to ``fsm-rollout run`` at each phase before the samples run: the default model's first build and the
engine's start. Each stops with exit 130 and one line, writes nothing and leaves nothing half-built in the cache.

The signal goes when the process shows it is in the phase (its own output line, or the engine's child holding at
its start), never after a sleep. (Ctrl-C while the samples run: ``test_run_cli``.) Each test prints how long the
process took to exit after the signal: a measurement, not an assertion.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from fsm_rollout.engine.local.cache import CACHE_ENV_VAR
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.engine.local.tiny import tiny_model_dir
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

INTERRUPTED = "interrupted: stopped before any sample ran; nothing was written"

# imported by every Python process given its directory on PYTHONPATH: `fsm-rollout serve` (the run's engine child)
# tells the test it has started and holds there until the test's socket closes
HOLD_SERVE = """\
import os, socket, sys
if sys.argv[1:2] == ["serve"] and os.environ.get("FSM_TEST_HOLD_SERVE"):
    held = socket.socket(socket.AF_UNIX)
    held.connect(os.environ["FSM_TEST_HOLD_SERVE"])
    held.sendall(b"held\\n")
    held.recv(1)
"""


async def start_run(tmp_path: Path, env: dict[str, str]) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", "--limit", "1", "--out", str(tmp_path / "out.jsonl")]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    return await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=environment
    )


async def interrupt(process: asyncio.subprocess.Process) -> tuple[int, str, str, float]:
    """SIGINT, then the exit code, the rest of stdout and stderr, and the seconds the process took to exit."""
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode(), time.monotonic() - sent


async def test_ctrl_c_during_the_default_models_first_build_stops_it_and_leaves_no_partial_build(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    # the tokenizer and the random model are built already (as after any earlier run): only the training is new
    for built in (qwen_tokenizer_dir(), tiny_model_dir()):
        shutil.copytree(built, cache / built.name)
    before = sorted(path.name for path in cache.iterdir())
    process = await start_run(tmp_path, {CACHE_ENV_VAR: str(cache)})
    assert process.stderr is not None
    seen = []
    while line := (await asyncio.wait_for(process.stderr.readline(), timeout=900)).decode():
        seen.append(line)
        if line.startswith("training the default model: step"):  # the build's progress line: it trains
            break
    else:
        raise AssertionError(f"the run ended before its build's progress line: {''.join(seen)}")
    code, stdout, rest, took = await interrupt(process)
    print(f"exit {code} {took:.2f} s after SIGINT during the build")
    assert code == 130, rest
    assert rest.strip().splitlines() == [INTERRUPTED], rest  # one line: no traceback, no "training failed"
    assert stdout == ""
    assert sorted(path.name for path in cache.iterdir()) == before  # no staging, inputs or half-written build
    assert not (tmp_path / "out.jsonl").exists()


async def test_ctrl_c_during_the_engines_start_stops_the_engine_and_runs_nothing(tmp_path: Path) -> None:
    default_model_dir()  # warm: the phase is the engine's start alone
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOLD_SERVE)
    held = asyncio.get_running_loop().create_future()
    closed = asyncio.Event()

    async def engine_child(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.set_result(await reader.readline())
        await reader.read()  # EOF: the child is gone
        closed.set()
        writer.close()

    socket_path = str(tmp_path / "hold.sock")
    server = await asyncio.start_unix_server(engine_child, socket_path)
    python_path = os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")])
    process = await start_run(tmp_path, {"PYTHONPATH": python_path, "FSM_TEST_HOLD_SERVE": socket_path})
    try:
        assert await asyncio.wait_for(held, timeout=600) == b"held\n"
        code, stdout, stderr, took = await interrupt(process)
        print(f"exit {code} {took:.2f} s after SIGINT during the engine's start")
        assert code == 130, stderr
        assert stderr.strip().splitlines()[-1] == INTERRUPTED, stderr
        assert "Traceback" not in stderr and stdout == ""
        await asyncio.wait_for(closed.wait(), timeout=30)  # the engine's child was stopped with the run
        assert not (tmp_path / "out.jsonl").exists()
    finally:
        if process.returncode is None:
            process.kill()
        server.close()
