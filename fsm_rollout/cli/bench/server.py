"""The bench's loopback server: canned vLLM answers after a fixed delay, in a child process of its own.

The HTTP workloads measure the client, so the server must cost next to nothing: it parses the request line and
``Content-Length`` and sends prepared bytes (the README gives its cost a request). The fake vLLM server, which
renders templates and checks every field, would be the bottleneck instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from fsm_rollout.cli.bench.params import ANSWER, PROMPT


def _canned_answers() -> dict[str, bytes]:
    """One render and one generate answer of the fake vLLM server (whose shapes are checked against real vLLM),
    captured as raw JSON bodies by asking it once."""
    import aiohttp

    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH
    from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]

    async def capture() -> dict[str, bytes]:
        async with FakeVLLMServer(tokenizer) as server, aiohttp.ClientSession() as session:
            server.script([ScriptedTurn(token_ids=answer)])
            render_body = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}]}
            async with session.post(server.url + RENDER_PATH, json=render_body) as response:
                response.raise_for_status()
                render = await response.read()
            rendered = json.loads(render)
            generate_body = {"model": server.model, "token_ids": rendered["token_ids"], "request_id": "bench",
                             "sampling_params": {"max_tokens": 256, "logprobs": 1, "skip_special_tokens": False}}
            async with session.post(server.url + GENERATE_PATH, json=generate_body) as response:
                response.raise_for_status()
                generate = await response.read()
        return {RENDER_PATH: render, GENERATE_PATH: generate}

    return asyncio.run(capture())


class _CannedHTTP(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server answering each POST path with a fixed body after a fixed delay.

    It reads only the request line and ``Content-Length`` (see the module docstring for why).
    """

    def __init__(self, answers: dict[str, bytes], delay: float) -> None:
        self._answers = answers
        self._delay = delay
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

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
            if len(buffer) < head_end + 4 + length:
                return
            del buffer[: head_end + 4 + length]
            path = head.split(" ", 2)[1]
            self._loop.call_later(self._delay, self._send, self._answers.get(path, _NOT_FOUND))

    def _send(self, response: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(response)


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def serve(delay: float) -> None:
    """Run the bench's loopback server (in its own process): canned vLLM answers after ``delay`` seconds.

    Prints the URL on one line, then serves until stdin closes.
    """
    bodies = _canned_answers()
    answers = {
        path: b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        for path, body in bodies.items()
    }

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _CannedHTTP(answers, delay), "127.0.0.1", 0, backlog=4096)
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


