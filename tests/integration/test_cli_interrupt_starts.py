"""Ctrl-C while a command loads the embedded engine's model in its own process: ``run --engine-in-process``,
``serve`` and ``gateway``. Each stops with exit 130 and one line, without waiting for the load.

The load is held inside the import of the engine's model module (a thread of the command's process, as a slow
torch import or weight read would be) until the test has seen the process exit, so a command that waited for
the load would never exit: the test's bound on the wait fails it, not a timing assertion. The signal goes when
the hold reports, never after a sleep. Each test prints how long the process took to exit after the signal.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fsm_rollout.engine.local.default_model import default_model_dir

HELD_MODULE = "fsm_rollout.engine.local.model"

# imported by every Python process given its directory on PYTHONPATH: the first import of HELD_MODULE tells the
# test it has started and holds there until the test's socket closes
HOLD_IMPORT = """\
import os, socket, sys

class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["FSM_TEST_HOLD_MODULE"]:
            sys.meta_path.remove(self)
            held = socket.socket(socket.AF_UNIX)
            held.connect(os.environ["FSM_TEST_HOLD_SOCKET"])
            held.sendall(b"held\\n")
            held.recv(1)
        return None

if os.environ.get("FSM_TEST_HOLD_SOCKET"):
    sys.meta_path.insert(0, _Hold())
"""

COMMANDS = {
    "run": (
        ["run", "--engine-in-process", "--limit", "1"],
        "interrupted: stopped before any sample ran; nothing was written",
    ),
    "serve": (["serve", "--port", "0"], "fsm-rollout serve: interrupted before the engine served"),
    "gateway": (["gateway", "--port", "0"], "gateway: interrupted before it listened"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
async def test_ctrl_c_while_the_engine_loads_in_process_exits_at_once(tmp_path: Path, command: str) -> None:
    default_model_dir()  # warm: the phase is the model's load alone
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOLD_IMPORT)
    held = asyncio.get_running_loop().create_future()

    async def loading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.set_result(await reader.readline())
        await reader.read()  # the process is gone, or the test has ended
        writer.close()

    socket_path = str(tmp_path / "hold.sock")
    server = await asyncio.start_unix_server(loading, socket_path)
    arguments, interrupted = COMMANDS[command]
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]),
        "FSM_TEST_HOLD_SOCKET": socket_path,
        "FSM_TEST_HOLD_MODULE": HELD_MODULE,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_rollout.cli", *arguments, cwd=tmp_path, env=environment,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert await asyncio.wait_for(held, timeout=600) == b"held\n"
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)  # the load never ends by itself
        print(f"{command}: exit {process.returncode} {time.monotonic() - sent:.2f} s after SIGINT during the load")
        lines = stderr.decode().strip().splitlines()
        assert process.returncode == 130, stderr.decode()
        assert lines[-1] == interrupted, stderr.decode()
        assert "Traceback" not in stderr.decode()
        assert stdout.decode() == ""  # neither a URL nor a summary: nothing was served or run
        assert not (tmp_path / "results.jsonl").exists()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        server.close()
