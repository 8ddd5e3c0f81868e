"""The bench's loopback server: canned vLLM answers after a fixed delay, in a child process of its own.

The HTTP workloads measure the client, so the server must cost next to nothing: it reads the request line and
``Content-Length`` off the socket itself, and answers from a canned conversation (one prompt, one answer) instead of
a model. A fully featured server (the fake vLLM server renders templates with a tokenizer thread and records every
request) would be the bottleneck. What it answers is still the serving frame's (:mod:`fsm_rollout.engine.serving`),
through :mod:`~fsm_rollout.cli.bench.canned` (the canned answers and their caches).

The weight-update endpoints are served too: ``/pause``, ``/resume``, ``/is_paused``, ``/update_weight_version``,
``/weight_info`` and ``/update_weights`` (nothing to load). For the weight-update workload it can also hold generate
requests in flight, turned on and read through the ``/bench/...`` control paths (:mod:`~fsm_rollout.cli.bench.hold`).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Final

from fsm_rollout.cli.bench.canned import (
    MAX_MODEL_LEN,
    MODEL,
    Answers,
    http_response,
    json_response,
    load_canned,
    status_response,
)
from fsm_rollout.cli.bench.hold import HOLD_PATH, STATS_PATH, WAIT_PATH, Hold
from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    IS_PAUSED_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    RENDER_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    UPDATE_WEIGHTS_PATH,
    WEIGHT_INFO_PATH,
    RequestError,
    abort_request_ids,
)
from fsm_rollout.engine.serving import (
    NOT_FOUND,
    UPDATED_WEIGHTS,
    error_answer,
    is_paused_answer,
    method_not_allowed,
    models_answer,
    pause_query,
    read_json,
    update_info,
    update_weight_version_answer,
    weight_info_answer,
    weight_version_of,
)

# The control paths are the hold's; the bench's workloads and the conformance tests import them from here.
__all__ = ["HOLD_PATH", "STATS_PATH", "WAIT_PATH", "Server", "serve"]


class _CannedHTTP(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server: it reads the request line, ``Content-Length`` and the body, and
    answers through :class:`Answers` and :class:`Hold` (render and generate answers after a fixed delay)."""

    def __init__(self, answers: Answers, delay: float, hold: Hold) -> None:
        self._answers = answers
        self._delay = delay
        self._hold = hold
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.held_id: str | None = None
        """The generate request of this connection the hold mode holds (a client sends one at a time)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._hold.connections_opened += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self.held_id is not None:
            self._hold.disconnected_while_held(self.held_id)
            self.held_id = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(buffer[:head_end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            end = head_end + 4 + length
            if len(buffer) < end:
                return
            method, target = head.split(" ", 2)[:2]
            body = bytes(buffer[head_end + 4 : end])
            del buffer[:end]
            try:
                response = self._respond(method, target, body)
            except RequestError as error:
                response = status_response(error_answer(error))
            if response is not None:
                self.send(response)

    def _respond(self, method: str, target: str, body: bytes) -> bytes | None:
        """The answer to one request, or None when it is answered later (delayed, held or waiting)."""
        path, _, query = target.partition("?")
        expected = _METHODS.get(path)
        if expected is None:
            return json_response(NOT_FOUND, 404)
        if method != expected:
            return status_response(method_not_allowed())
        hold = self._hold
        if path == GENERATE_PATH:
            response = hold.generate(self._answers.parse_generate(body), self)
            if response is not None:
                self.send_later(response)
            return None
        if path == RENDER_PATH:
            self.send_later(self._answers.render(body))
            return None
        if path == ABORT_PATH:
            hold.abort(abort_request_ids(read_json(body)))
            return http_response(b"")
        if path in (HOLD_PATH, WAIT_PATH, STATS_PATH):
            return hold.control(path, read_json(body or b"{}"), self)
        if path == PAUSE_PATH:
            return hold.pause(pause_query(_query(query)), self)
        if path == RESUME_PATH:
            return hold.resume()
        if path == IS_PAUSED_PATH:
            return json_response(is_paused_answer(hold.paused))
        if path == UPDATE_WEIGHT_VERSION_PATH:
            version = weight_version_of(read_json(body))
            hold.set_version(version)
            return json_response(update_weight_version_answer(version))
        if path == WEIGHT_INFO_PATH:
            return json_response(weight_info_answer(hold.version))
        if path == UPDATE_WEIGHTS_PATH:
            update_info(read_json(body))
            return json_response(UPDATED_WEIGHTS)
        if path == MODELS_PATH:
            return json_response(models_answer(MODEL, root=MODEL, max_model_len=MAX_MODEL_LEN))
        return http_response(b"")  # /health

    def send_later(self, response: bytes) -> None:
        """Send ``response`` after the canned delay (the model's latency)."""
        self._loop.call_later(self._delay, self.send, response)

    def send(self, response: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(response)


_METHODS: Final = {
    RENDER_PATH: "POST",
    GENERATE_PATH: "POST",
    ABORT_PATH: "POST",
    HEALTH_PATH: "GET",
    MODELS_PATH: "GET",
    PAUSE_PATH: "POST",
    RESUME_PATH: "POST",
    IS_PAUSED_PATH: "GET",
    UPDATE_WEIGHT_VERSION_PATH: "POST",
    WEIGHT_INFO_PATH: "GET",
    UPDATE_WEIGHTS_PATH: "POST",
    HOLD_PATH: "POST",
    WAIT_PATH: "POST",
    STATS_PATH: "POST",
}
"""Every path the server answers, with its method."""


def _query(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(query, keep_blank_values=True))


def serve(delay: float) -> None:
    """Run the bench's loopback server (in its own process): canned vLLM answers after ``delay`` seconds.

    Prints the URL on one line, then serves until stdin closes.
    """
    answers = Answers(load_canned())
    hold = Hold(answers)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _CannedHTTP(answers, delay, hold), "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
        print(f"http://127.0.0.1:{port}", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        server.close()

    asyncio.run(main())


class Server:
    """The canned loopback server (:func:`serve`) in a child process, so its CPU and memory are not the client's."""

    def __init__(self, delay: float) -> None:
        import subprocess

        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from fsm_rollout.cli.bench.server import serve; serve({delay})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def url(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"bench: the fake vLLM server did not start (got {line!r})")
        return line

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (user and system)."""
        with open(f"/proc/{self._process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)
