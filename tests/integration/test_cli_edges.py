"""The command line's edges: a reader that stops reading (``inspect | head``) and ``run --limit 0``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_run_cli import run_command  # pytest puts this directory on sys.path

from fsm_rollout.testing.fake_vllm import FakeVLLMServer

TRACE = Path(__file__).parent.parent / "fixtures" / "tapes" / "schema1" / "run.jsonl"


def test_inspect_into_a_pipe_nobody_reads_exits_quietly_without_a_traceback() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte (as `| head` that has had its lines)
    try:
        done = subprocess.run([sys.executable, "-m", "fsm_rollout.cli", "inspect", str(TRACE)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 141  # as a command SIGPIPE ended
    assert done.stderr == ""


async def test_run_with_limit_0_starts_no_engine_and_says_why(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    code, _, stderr = await run_command("run", "--engine-url", fake_vllm.url, "--limit", "0",
                                             "--out", str(tmp_path / "out.jsonl"))  # fmt: skip
    assert code == 2
    assert stderr.strip().splitlines() == [
        "error: no prompt to run (--limit 0 or an empty dataset): nothing was started"
    ]
    assert fake_vllm.requests == []  # not even asked whether it is up
    assert not (tmp_path / "out.jsonl").exists()
