"""The bench's loopback server: canned vLLM answers after a fixed delay, in a child process of its own.

The HTTP workloads measure the client, so the server must cost next to nothing: it parses the request line and
``Content-Length`` and sends prepared bytes (the README gives its cost a request). The fake vLLM server, which
renders templates and checks every field, would be the bottleneck instead.

For the weight-update workload it can also hold generate requests in flight (:class:`_Hold`, turned on and read
through the ``/bench/...`` control paths): every first-turn request waits, having "produced" the first tokens of the
canned answer, until ``abort_requests`` names it (answered ``finish_reason: "abort"`` with those tokens, their
logprobs and ``weight_versions`` spans, as vLLM answers) or the hold is released; the continuation request (prompt
plus those tokens) waits too, and gets the rest when the hold is released. It counts generate requests, abort
calls and the tokens it produced, and answers a waiting control request the moment a count is reached, so the
bench needs no polling.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import orjson

from fsm_rollout.cli.bench.params import ANSWER, PROMPT
from fsm_rollout.engine.schema.wire import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    sent_request_id,
)

HOLD_PATH = "/bench/hold"
"""``POST {"mode": "hold", "partial_tokens": K, "weight_version": V}`` holds first-turn and continuation generate
requests from now on and counts every generate request (the counts start again from zero); ``{"mode": "release"}``
answers the held ones with the rest of the canned answer and holds no more (requests are still counted);
``{"mode": "off"}`` releases them too and goes back to the canned answers alone. Answers :data:`STATS_PATH`'s
counts and the canned prompt and answer (token ids and logprobs) the hold works with."""
WAIT_PATH = "/bench/wait"
"""``POST {"held": N}`` or ``{"continued": N}`` answers :data:`STATS_PATH`'s counts once N requests are held, or N
continuation requests have arrived (at once when that is so already)."""
STATS_PATH = "/bench/stats"
"""``POST {}`` answers the counts now (:meth:`_Hold.stats`)."""


def _canned_answers() -> dict[str, bytes]:
    """One render and one generate answer of the fake vLLM server (whose shapes are checked against real vLLM),
    captured as raw JSON bodies by asking it once."""
    import aiohttp

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


def _http_response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def _json_response(value: Any) -> bytes:
    return _http_response(json.dumps(value, separators=(",", ":")).encode())


class _Hold:
    """The hold mode's state, shared by every connection of the server (see the module docstring).

    A held request is a first-turn request (its context is the canned prompt), which has produced the first
    ``partial`` tokens of the canned answer with the weights of the moment it arrived, or a continuation (the
    prompt and those tokens), which has produced nothing yet: the engine is still on it when the bench measures,
    as a real engine re-filling a whole batch would be. Times are ``time.monotonic()``: CLOCK_MONOTONIC on Linux,
    the same clock in the bench's process, so the bench can compare a moment here with one of its own.
    """

    def __init__(self, render_body: bytes, generate_body: bytes) -> None:
        self._prompt: list[int] = json.loads(render_body)["token_ids"]
        self._canned: dict[str, Any] = json.loads(generate_body)
        choice = self._canned["choices"][0]
        self._answer: list[int] = choice["token_ids"]
        self._entries: list[dict[str, Any]] = choice["logprobs"]["content"]
        self._bodies: dict[tuple[Any, ...], bytes] = {}
        self.partial = 0
        self.counting = False
        """Generate requests are looked into and counted (hold or release)."""
        self.holding = False
        self.version = "default"
        self._continuation: list[int] = []
        self._held: dict[str, tuple[_CannedHTTP, int, str]] = {}
        """Held requests by id: the connection to answer on, where in the canned answer the request starts, and the
        weight version of its tokens so far."""
        self._waiters: list[tuple[str, int, _CannedHTTP]] = []
        self._reset()

    def _reset(self) -> None:
        self.generate_requests = 0
        self.held_total = 0
        self.continued_at: list[float] = []
        self.abort_calls = 0
        self.abort_answers = 0
        self.disconnected = 0
        self.released = 0
        self.tokens_produced = 0
        self.connections_opened = 0

    # ---------------------------------------------------------------- the answers

    def _body(self, start: int, end: int, finish: str, spans: tuple[tuple[str, int, int], ...]) -> bytes:
        """A generate answer of the canned answer's tokens ``start:end`` whose versions are ``spans`` (positions
        in the answer, from ``start``)."""
        key = (start, end, finish, spans)
        body = self._bodies.get(key)
        if body is None:
            versions = [{"version": version, "start": first, "end": last} for version, first, last in spans]
            choice = {**self._canned["choices"][0], "finish_reason": finish, "token_ids": self._answer[start:end],
                      "logprobs": {"content": self._entries[start:end]}, "weight_versions": versions}
            usage = {"prompt_tokens": len(self._prompt) + start, "completion_tokens": end - start,
                     "total_tokens": len(self._prompt) + end}
            body = self._bodies[key] = _http_response(
                json.dumps({**self._canned, "choices": [choice], "usage": usage}, separators=(",", ":")).encode())
        return body

    def _spans(self, start: int, produced: int, end: int, version: str) -> tuple[tuple[str, int, int], ...]:
        """Tokens ``start:produced`` made with ``version``, the rest up to ``end`` with the current one."""
        if version == self.version or produced == end:
            return ((version, 0, end - start),) if end > start else ()
        if produced == start:
            return ((self.version, 0, end - start),)
        return ((version, 0, produced - start), (self.version, produced - start, end - start))

    # ---------------------------------------------------------------- what the bench asks

    def control(self, path: str, request: dict[str, Any], protocol: _CannedHTTP) -> bytes | None:
        """The answer to a control request, or None when it waits (:meth:`_wake` answers it)."""
        if path == HOLD_PATH:
            mode = request.get("mode")
            if mode in ("release", "off"):
                self.holding = False
                end = len(self._answer)
                for request_id, (_, start, version) in list(self._held.items()):
                    spans = self._spans(start, self._produced(start), end, version)
                    self._end_held(request_id, self._body(start, end, "stop", spans), end - start)
                    self.released += 1
                self.counting = mode == "release"
            elif mode == "hold":
                self.partial = min(int(request["partial_tokens"]), len(self._answer) - 1)
                self.version = str(request.get("weight_version", self.version))
                self._continuation = [*self._prompt, *self._answer[: self.partial]]
                self.counting = self.holding = True
                self._reset()
            else:
                raise ValueError(f"bench server: unknown hold mode {mode!r}")
            return _json_response({**self.stats(), "prompt_token_ids": self._prompt, "answer_token_ids": self._answer,
                                   "answer_logprobs": [entry["logprob"] for entry in self._entries],
                                   "partial_tokens": self.partial})
        if path == WAIT_PATH:
            kind = "held" if "held" in request else "continued"
            self._waiters.append((kind, int(request[kind]), protocol))
            self._wake()
            return None
        return _json_response(self.stats())

    def stats(self) -> dict[str, Any]:
        return {
            "generate_requests": self.generate_requests,
            "held": len(self._held),
            "held_total": self.held_total,
            "continued": len(self.continued_at),
            "continued_first_at": self.continued_at[0] if self.continued_at else None,
            "continued_last_at": self.continued_at[-1] if self.continued_at else None,
            "abort_calls": self.abort_calls,
            "abort_answers": self.abort_answers,
            "disconnected": self.disconnected,
            "released": self.released,
            "tokens_produced": self.tokens_produced,
            "connections_opened": self.connections_opened,
            "weight_version": self.version,
            "cpu_s": time.process_time(),
        }

    def _wake(self) -> None:
        waiting = []
        for kind, count, protocol in self._waiters:
            reached = len(self._held) if kind == "held" else len(self.continued_at)
            if reached >= count:
                protocol.send(_json_response(self.stats()))
            else:
                waiting.append((kind, count, protocol))
        self._waiters = waiting

    # ---------------------------------------------------------------- what the client asks

    def generate(self, request: dict[str, Any], protocol: _CannedHTTP) -> bytes | None:
        """The answer to a generate request, or None when it is held."""
        self.generate_requests += 1
        token_ids = request.get("token_ids")
        end = len(self._answer)
        if token_ids == self._continuation:
            start = self.partial
            self.continued_at.append(time.monotonic())
        else:
            start = 0
        if not self.holding or (start == 0 and token_ids != self._prompt):  # answered: a later turn, or released
            self.tokens_produced += end - start
            return self._body(start, end, "stop", self._spans(start, start, end, self.version))
        request_id = str(request.get("request_id"))
        self._held[request_id] = (protocol, start, self.version)
        protocol.held_id = request_id
        self.held_total += 1
        self._wake()
        return None

    def _produced(self, start: int) -> int:
        """Where the tokens a held request has produced end: a first-turn one has ``partial``, a continuation none."""
        return self.partial if start == 0 else start

    def abort(self, request: dict[str, Any]) -> None:
        """``abort_requests``: each held request it names answers ``abort`` with its tokens so far."""
        self.abort_calls += 1
        for name in request.get("request_ids", ()):
            request_id = sent_request_id(name)
            held = self._held.get(request_id)
            if held is not None:
                _, start, version = held
                produced = self._produced(start)
                self._end_held(request_id, self._body(start, produced, "abort",
                                                      self._spans(start, produced, produced, version)),
                               produced - start)
                self.abort_answers += 1

    def disconnected_while_held(self, request_id: str) -> None:
        """The client went away from a held request (a cancelled request): its tokens so far are lost with it."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.tokens_produced += self._produced(held[1]) - held[1]
            self.disconnected += 1

    def _end_held(self, request_id: str, response: bytes, tokens: int) -> None:
        protocol, _, _ = self._held.pop(request_id)
        protocol.held_id = None
        self.tokens_produced += tokens
        protocol.send(response)

    def set_version(self, version: str) -> bytes:
        """``/update_weight_version``: the tokens sampled from now on are ``version``'s."""
        self.version = version
        return _json_response({"success": True, "new_version": version})


class _CannedHTTP(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server answering each POST path with a fixed body after a fixed delay.

    It reads only the request line and ``Content-Length`` (see the module docstring for why), and the bodies of
    the requests the hold mode (:class:`_Hold`) looks into: control requests, abort calls and weight versions
    always, generate requests while it holds.
    """

    def __init__(self, answers: dict[str, bytes], delay: float, hold: _Hold) -> None:
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
            path = head.split(" ", 2)[1]
            hold = self._hold
            if path in _HOLD_PATHS or (hold.counting and path == GENERATE_PATH):
                request = orjson.loads(bytes(buffer[head_end + 4: end]) or b"{}")  # orjson: next to no cost
                del buffer[:end]
                self._answer_hold(hold, path, request)
                continue
            del buffer[:end]
            self._loop.call_later(self._delay, self.send, self._answers.get(path, _NOT_FOUND))

    def _answer_hold(self, hold: _Hold, path: str, request: dict[str, Any]) -> None:
        if path == GENERATE_PATH:
            response = hold.generate(request, self)
            if response is not None:
                self._loop.call_later(self._delay, self.send, response)
        elif path == ABORT_PATH:
            hold.abort(request)
            self.send(_ABORTED)
        elif path == UPDATE_WEIGHT_VERSION_PATH:
            self.send(hold.set_version(str(request["new_version"])))
        else:
            control = hold.control(path, request, self)
            if control is not None:
                self.send(control)

    def send(self, response: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(response)


_HOLD_PATHS = frozenset({HOLD_PATH, WAIT_PATH, STATS_PATH, ABORT_PATH, UPDATE_WEIGHT_VERSION_PATH})
_ABORTED = _json_response({})
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def serve(delay: float) -> None:
    """Run the bench's loopback server (in its own process): canned vLLM answers after ``delay`` seconds.

    Prints the URL on one line, then serves until stdin closes.
    """
    bodies = _canned_answers()
    answers = {path: _http_response(body) for path, body in bodies.items()}
    hold = _Hold(bodies[RENDER_PATH], bodies[GENERATE_PATH])

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


