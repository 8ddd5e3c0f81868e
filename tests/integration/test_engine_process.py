"""``fsm-rollout run``'s embedded engine in a child process: it serves until the run ends, says why when it cannot
start, stops with its parent, and ``--engine-in-process`` keeps the former single process."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from fsm_rollout.cli.engine_process import EngineProcessError, engine_process
from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir
from fsm_rollout.engine.local.tiny import tiny_model_dir

pytestmark = pytest.mark.asyncio

START_S = 300.0  # a bound for a loaded machine, not a timing assertion


async def test_the_child_engine_serves_the_default_model_until_the_context_ends() -> None:
    async with aiohttp.ClientSession() as http:
        async with (
            engine_process(default_model_dir(), DEFAULT_MODEL_NAME) as url,
            http.get(url + "/v1/models") as answer,
        ):
            assert answer.status == 200
            assert [card["id"] for card in (await answer.json())["data"]] == [DEFAULT_MODEL_NAME]
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(url + "/health"):
                pass


async def test_a_child_that_cannot_start_raises_with_what_it_said(tmp_path: Path) -> None:
    with pytest.raises(EngineProcessError) as caught:
        async with engine_process(tmp_path, DEFAULT_MODEL_NAME):
            pass
    message = str(caught.value)
    assert "the embedded engine's process ended (exit code 1) before serving" in message
    assert "fsm-rollout serve:" in message and str(tmp_path) in message


async def test_serve_with_stop_on_stdin_eof_stops_when_its_parent_closes_stdin() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "serve",
        "--model",
        str(tiny_model_dir()),
        "--port",
        "0",
        "--stop-on-stdin-eof",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        url = (await asyncio.wait_for(process.stdout.readline(), START_S)).decode().strip()
        assert url.startswith("http://127.0.0.1:")
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), START_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_engine_in_process_runs_the_demo_in_one_process(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "run",
        "--engine-in-process",
        "--limit",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--max-new-tokens",
        "8",
        "--quiet",
        "--seed",
        "5",
        "--out",
        str(tmp_path / "results.jsonl"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), START_S)
    assert process.returncode == 0, stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["response_length"] > 0 for row in rows)
    assert "2/2 samples" in stdout.decode()


async def test_the_url_is_the_first_url_line_of_the_child_s_stdout() -> None:
    from fsm_rollout.cli.engine_process import _url

    stream = asyncio.StreamReader()
    stream.feed_data(b"a library's notice on stdout\nhttp://127.0.0.1:4321\nlater\n")
    stream.feed_eof()
    assert await _url(stream) == "http://127.0.0.1:4321"
    ended = asyncio.StreamReader()
    ended.feed_data(b"no url\n")
    ended.feed_eof()
    assert await _url(ended) is None
