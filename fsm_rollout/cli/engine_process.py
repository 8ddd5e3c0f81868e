"""The embedded engine in a child process, for ``fsm-rollout run``: ``fsm-rollout serve`` on a free loopback port.

In the run's own process the engine's worker thread and the rollouts (HTTP on both ends, environments, results)
share one interpreter lock, and the engine's decode steps, mostly Python, wait whenever the rollouts hold it. In a
process of its own each side has an interpreter and a core to itself, as vLLM runs its engine core apart from its
API server. The child serves the model directory the parent resolved (the parent builds the default model first,
showing the build's progress), with the engine's defaults, and no API key. It stops when the run ends, and on its
own when the run's process dies (its stdin closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from fsm_rollout.cli.preflight import PreflightError

__all__ = ["EngineProcessError", "engine_process"]

_STOP_TIMEOUT_S = 1.0
"""A serving engine's grace after SIGTERM (it has nothing to save: a Ctrl-C must end the run within 2 s)."""
_KEPT_STDERR_LINES = 40


class EngineProcessError(PreflightError):
    """The engine's child process did not start (its last lines of stderr say why)."""


@contextlib.asynccontextmanager
async def engine_process(
    model_dir: Path, served_model_name: str, *options: str, interrupted: asyncio.Event | None = None
) -> AsyncIterator[str]:
    """Start ``fsm-rollout serve`` for ``model_dir`` (with more ``options``) in a child process and yield its base
    URL once it answers; stop it on exit: SIGTERM, then SIGKILL after a grace period, or SIGKILL at once when
    ``interrupted`` is set (a Ctrl-C: the run's samples are aborted already, and the engine has nothing to save)."""
    command = [
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--stop-on-stdin-eof",
        *options,
    ]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}  # no key: loopback, one user
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,  # a Ctrl-C reaches the run, which aborts its samples, then stops the engine
    )
    assert process.stdout is not None and process.stderr is not None
    lines: deque[str] = deque(maxlen=_KEPT_STDERR_LINES)
    drain = asyncio.create_task(_keep_lines(process.stderr, lines))
    rest: asyncio.Task[None] | None = None
    serving = False
    try:
        url = await _url(process.stdout)
        if url is None:  # stdout ended: the child did
            await process.wait()
            await drain
            detail = "\n".join(lines) or "(nothing on stderr)"
            raise EngineProcessError(
                f"the embedded engine's process ended (exit code {process.returncode}) before serving:\n{detail}"
            )
        rest = asyncio.create_task(_keep_lines(process.stdout, deque(maxlen=1)))  # a full pipe would block it
        serving = True
        yield url
    finally:
        await _stop(process, graceful=serving and not (interrupted is not None and interrupted.is_set()))
        for task in (drain, rest) if rest is not None else (drain,):
            task.cancel()  # the child's pipes have ended by now; this only tidies up
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _url(stream: asyncio.StreamReader) -> str | None:
    """The first line of the child's stdout that is a URL (serve prints it once the engine answers), or None at
    the end of its stdout."""
    while line := await stream.readline():
        text = line.decode(errors="replace").strip()
        if text.startswith(("http://", "https://")):
            return text
    return None


async def _keep_lines(stream: asyncio.StreamReader, lines: deque[str]) -> None:
    """Read one of the child's pipes to its end (a full pipe would block the child), keeping its last lines."""
    while line := await stream.readline():
        lines.append(line.decode(errors="replace").rstrip())


async def _stop(process: asyncio.subprocess.Process, *, graceful: bool) -> None:
    """End the child: SIGTERM and a short grace once it serves; at once while it starts (it handles SIGTERM only
    once serving, and has nothing to save)."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if not graceful:
            process.kill()
            await process.wait()
            return
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
