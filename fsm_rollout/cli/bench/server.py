"""The bench's loopback server: canned vLLM answers after a fixed delay, in a child process of its own.

The HTTP workloads measure the client, so the server must cost next to nothing: it reads the request line and
``Content-Length`` off the socket itself, and answers from a canned conversation (one prompt, one answer) instead of
a model. A fully featured server (the fake vLLM server renders templates with a tokenizer thread and records every
request) would be the bottleneck. What it answers is still the serving frame's (:mod:`fsm_rollout.engine.serving`):
every request is checked as vLLM checks it and errors get vLLM's bodies; render answers the canned prompt with the
request's sampling fields (a conversation of more than one message, a fork policy's re-render, goes through the
chat template); generate answers the canned answer cut by the request's ``max_tokens``, ``min_tokens``,
stop strings and stop tokens (:func:`~fsm_rollout.engine.stop_strings.cut_at_stop`), under the request's id. Cuts
and answer bodies are cached, so a repeated request costs a JSON parse, the checks and a dictionary lookup.

The weight-update endpoints are served too: ``/pause`` (``abort`` ends the held requests, ``wait`` answers once none
is held, ``keep`` holds the generate requests arriving meanwhile until ``/resume``), ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/weight_info`` and ``/update_weights`` (nothing to load).

For the weight-update workload it can also hold generate requests in flight (:class:`_Hold`, turned on and read
through the ``/bench/...`` control paths): every first-turn request waits, having "produced" the first tokens of the
canned answer, until ``abort_requests`` names it (answered ``finish_reason: "abort"`` with those tokens, their
logprobs and ``weight_versions`` spans, as vLLM answers) or the hold is released; the continuation request (prompt
plus those tokens) waits too, and gets the rest when the hold is released. It counts generate requests, abort
calls and the tokens it produced, and answers a waiting control request the moment a count is reached, so the
bench needs no polling.

Why this module is long: the socket protocol, the canned answers and the hold mode act on one shared state
(the held and parked requests and their connections), and the bench reads them as one server.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

import orjson

from fsm_rollout.cli.bench.params import ANSWER, PROMPT
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
    sent_request_id,
    server_request_id,
)
from fsm_rollout.engine.serving import (
    NOT_FOUND,
    PAUSED,
    RESUMED,
    UPDATED_WEIGHTS,
    GenerateOutcome,
    GenerateRequest,
    error_answer,
    generate_answer,
    is_paused_answer,
    method_not_allowed,
    models_answer,
    parse_generate_request,
    parse_render_request,
    pause_query,
    read_json,
    render_answer,
    update_info,
    update_weight_version_answer,
    weight_info_answer,
    weight_version_of,
)
from fsm_rollout.engine.stop_strings import StopCut, cut_at_stop

MODEL: Final = "fake-model"
"""The served model name (the fake vLLM server's default, which the bench's configs name)."""
MAX_MODEL_LEN: Final = 4096

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

_CACHE_LIMIT = 4096
"""Cached cuts and answer bodies (by sampling fields and prompt length) before the caches start over."""
_ID_MARK = "@@request-id@@"
"""Stands for the request id in a cached answer body, so one body serves every request id."""


@dataclass(frozen=True)
class _Canned:
    """The canned conversation: the prompt's token ids (the chat template's rendering of :data:`PROMPT`), the
    answer's (:data:`ANSWER` and EOS) with the fake server's default logprobs, and how to decode token ids."""

    prompt: list[int]
    answer: list[int]
    logprobs: list[float]
    eos_token_id: int
    decode: Callable[[Sequence[int], bool], str]
    render: Callable[[Any], list[int]]
    """The chat template's rendering of a longer conversation (a fork policy's re-render), with a generation prompt."""


def _canned() -> _Canned:
    from fsm_rollout.testing.fake_vllm.generation import as_token_ids
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eos_token_id = tokenizer.eos_token_id
    if not isinstance(eos_token_id, int):
        raise RuntimeError(f"bench server: the tokenizer has no EOS token id (got {eos_token_id!r})")
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), eos_token_id]

    def decode(token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render(messages: Any) -> list[int]:
        return as_token_ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    return _Canned(
        prompt=as_token_ids(prompt),
        answer=answer,
        logprobs=[-0.01 * (index + 1) for index in range(len(answer))],
        eos_token_id=eos_token_id,
        decode=decode,
        render=render,
    )


def _entries(token_ids: Sequence[int], logprobs: Sequence[float], top: int | None) -> list[Any]:
    """The answer's ``logprobs.content``, with the fake server's candidates for a request's ``logprobs``."""
    from fsm_rollout.testing.fake_vllm.generation import logprob_entry

    return [
        logprob_entry("token_id", token, logprob, top=top) for token, logprob in zip(token_ids, logprobs, strict=True)
    ]


_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}


def _http_response(body: bytes, status: int = 200) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        status,
        _REASONS.get(status, "Error").encode(),
        len(body),
    )
    return head + body


def _status_response(answer: tuple[int, bytes]) -> bytes:
    status, body = answer
    return _http_response(body, status)


def _json_response(value: Any, status: int = 200) -> bytes:
    return _http_response(orjson.dumps(value), status)


class _Answers:
    """What the canned server answers each endpoint, through the serving frame (see the module docstring)."""

    def __init__(self, canned: _Canned) -> None:
        self.canned = canned
        self._cuts: dict[tuple[Any, ...], StopCut] = {}
        self._bodies: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}

    def render(self, raw: bytes) -> bytes:
        parsed = parse_render_request(read_json(raw), MODEL)
        # the canned prompt for a first render; a whole conversation (a fork policy's re-render) through the template
        prompt = self.canned.prompt if len(parsed.messages) == 1 else self.canned.render(parsed.messages)
        return _json_response(render_answer(parsed, prompt, None, model=MODEL, max_model_len=MAX_MODEL_LEN))

    def parse_generate(self, raw: bytes) -> GenerateRequest:
        return parse_generate_request(read_json(raw), MODEL, max_model_len=MAX_MODEL_LEN)

    def generate(self, request: GenerateRequest, version: str) -> bytes:
        """The canned answer cut for this request, under its id, its tokens labelled ``version``."""
        settings = request.settings
        key = (
            settings.max_tokens,
            settings.min_tokens,
            settings.stop,
            settings.stop_token_ids,
            settings.ignore_eos,
            settings.skip_special_tokens,
        )
        cut = self._cuts.get(key)
        if cut is None:
            canned = self.canned
            skip = settings.skip_special_tokens
            cut = self._cuts[key] = cut_at_stop(
                canned.answer,
                max_tokens=settings.max_tokens,
                min_tokens=settings.min_tokens,
                stop=settings.stop,
                stop_token_ids=settings.stop_token_ids,
                eos_token_id=None if settings.ignore_eos else canned.eos_token_id,
                decode=lambda ids: canned.decode(ids, skip),
            )
            if len(self._cuts) > _CACHE_LIMIT:
                self._cuts = {key: cut}
        count = len(cut.token_ids)
        return self.answer(request, 0, count, cut.finish, ((version, 0, count),) if count else (), cut.stop_reason)

    def answer(
        self,
        request: GenerateRequest,
        start: int,
        end: int,
        finish: str,
        spans: tuple[tuple[str, int, int], ...],
        stop_reason: str | int | None = None,
    ) -> bytes:
        """A generate answer of the canned answer's tokens ``start:end`` whose versions are ``spans`` (positions in
        the answer, from ``start``), for ``request``."""
        key = (request.prompt_len, start, end, finish, spans, stop_reason, request.settings.logprobs)
        parts = self._bodies.get(key)
        if parts is None:
            outcome = GenerateOutcome(
                token_ids=self.canned.answer[start:end],
                finish=finish,  # type: ignore[arg-type]
                logprobs=_entries(
                    self.canned.answer[start:end], self.canned.logprobs[start:end], request.settings.logprobs
                ),
                weight_versions=[{"version": version, "start": first, "end": last} for version, first, last in spans],
                stop_reason=stop_reason,
            )
            body = orjson.dumps(generate_answer(_ID_MARK, request.prompt_len, outcome, model=MODEL))
            head, _, tail = body.partition(orjson.dumps(server_request_id(_ID_MARK)))
            parts = self._bodies[key] = (head, tail)
            if len(self._bodies) > _CACHE_LIMIT:
                self._bodies = {key: parts}
        head, tail = parts
        return _http_response(head + orjson.dumps(server_request_id(request.request_id)) + tail)


class _Hold:
    """The hold mode's and the pause's state, shared by every connection of the server (see the module docstring).

    A held request is a first-turn request (its context is the canned prompt), which has produced the first
    ``partial`` tokens of the canned answer with the weights of the moment it arrived, or a continuation (the
    prompt and those tokens), which has produced nothing yet: the engine is still on it when the bench measures,
    as a real engine re-filling a whole batch would be. Times are ``time.monotonic()``: CLOCK_MONOTONIC on Linux,
    the same clock in the bench's process, so the bench can compare a moment here with one of its own.
    """

    def __init__(self, answers: _Answers) -> None:
        self._answers = answers
        self._prompt = answers.canned.prompt
        self._answer = answers.canned.answer
        self.partial = 0
        self.counting = False
        """Generate requests are looked into and counted (hold or release)."""
        self.holding = False
        self.version = "default"
        self.paused = False
        self._parked: list[tuple[GenerateRequest, _CannedHTTP]] = []
        """Generate requests that arrived while paused, answered on resume."""
        self._continuation: list[int] = []
        self._held: dict[str, tuple[_CannedHTTP, int, str, GenerateRequest]] = {}
        """Held requests by id: the connection to answer on, where in the canned answer the request starts, the
        weight version of its tokens so far, and the request."""
        self._waiters: list[tuple[str, int, _CannedHTTP, bytes]] = []
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
                self._release_all()
                self.counting = mode == "release"
            elif mode == "hold":
                self.partial = min(int(request["partial_tokens"]), len(self._answer) - 1)
                self.version = str(request.get("weight_version", self.version))
                self._continuation = [*self._prompt, *self._answer[: self.partial]]
                self.counting = self.holding = True
                self._reset()
            else:
                raise RequestError(400, f"bench server: unknown hold mode {mode!r}", "mode")
            return _json_response(
                {
                    **self.stats(),
                    "prompt_token_ids": self._prompt,
                    "answer_token_ids": self._answer,
                    "answer_logprobs": self._answers.canned.logprobs,
                    "partial_tokens": self.partial,
                }
            )
        if path == WAIT_PATH:
            kind = "held" if "held" in request else "continued"
            self._wait(kind, int(request[kind]), protocol, b"")
            return None
        return _json_response(self.stats())

    def _wait(self, kind: str, count: int, protocol: _CannedHTTP, answer: bytes) -> None:
        """Answer ``protocol`` once ``count`` requests are held or continued (``answer``, else the stats), or none is
        held any more (kind ``drained``)."""
        self._waiters.append((kind, count, protocol, answer))
        self._wake()

    def stats(self) -> dict[str, Any]:
        return {
            "generate_requests": self.generate_requests,
            "held": len(self._held),
            "held_total": self.held_total,
            "parked": len(self._parked),
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
        for kind, count, protocol, answer in self._waiters:
            if kind == "drained":
                reached = not self._held
            else:
                reached = (len(self._held) if kind == "held" else len(self.continued_at)) >= count
            if reached:
                protocol.send(answer or _json_response(self.stats()))
            else:
                waiting.append((kind, count, protocol, answer))
        self._waiters = waiting

    # ---------------------------------------------------------------- what the client asks

    def generate(self, request: GenerateRequest, protocol: _CannedHTTP) -> bytes | None:
        """The answer to a generate request, or None when it is held (or parked while paused)."""
        if self.paused:
            self._parked.append((request, protocol))
            return None
        if not self.counting:
            return self._answers.generate(request, self.version)
        self.generate_requests += 1
        token_ids = request.token_ids
        end = len(self._answer)
        if token_ids == self._continuation:
            start = self.partial
            self.continued_at.append(time.monotonic())
        else:
            start = 0
        if not self.holding or (start == 0 and token_ids != self._prompt):  # answered: a later turn, or released
            self.tokens_produced += end - start
            return self._answers.answer(request, start, end, "stop", self._spans(start, start, end, self.version))
        self._held[request.request_id] = (protocol, start, self.version, request)
        protocol.held_id = request.request_id
        self.held_total += 1
        self._wake()
        return None

    def _produced(self, start: int) -> int:
        """Where the tokens a held request has produced end: a first-turn one has ``partial``, a continuation none."""
        return self.partial if start == 0 else start

    def abort(self, request_ids: list[str]) -> None:
        """``abort_requests``: each held request it names answers ``abort`` with its tokens so far."""
        self.abort_calls += 1
        for name in request_ids:
            request_id = sent_request_id(name)
            held = self._held.get(request_id)
            if held is not None:
                self._abort_held(request_id)

    def _abort_held(self, request_id: str) -> None:
        _, start, version, request = self._held[request_id]
        produced = self._produced(start)
        spans = self._spans(start, produced, produced, version)
        self._end_held(request_id, self._answers.answer(request, start, produced, "abort", spans), produced - start)
        self.abort_answers += 1

    def _release_all(self) -> None:
        end = len(self._answer)
        for request_id, (_, start, version, request) in list(self._held.items()):
            spans = self._spans(start, self._produced(start), end, version)
            self._end_held(request_id, self._answers.answer(request, start, end, "stop", spans), end - start)
            self.released += 1

    def pause(self, mode: str, protocol: _CannedHTTP) -> bytes | None:
        """``/pause``: ``abort`` ends every held request, ``wait`` answers once none is held, ``keep`` leaves them."""
        self.paused = True
        if mode == "abort":
            for request_id in list(self._held):
                self._abort_held(request_id)
        if mode == "wait" and self._held:
            self._wait("drained", 0, protocol, _json_response(PAUSED))
            return None
        return _json_response(PAUSED)

    def resume(self) -> bytes:
        """``/resume``: the generate requests parked while paused are answered (or held) now."""
        self.paused = False
        parked, self._parked = self._parked, []
        for request, protocol in parked:
            response = self.generate(request, protocol)
            if response is not None:
                protocol.send_later(response)
        return _json_response(RESUMED)

    def disconnected_while_held(self, request_id: str) -> None:
        """The client went away from a held request (a cancelled request): its tokens so far are lost with it."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.tokens_produced += self._produced(held[1]) - held[1]
            self.disconnected += 1
            self._wake()

    def _end_held(self, request_id: str, response: bytes, tokens: int) -> None:
        protocol = self._held.pop(request_id)[0]
        protocol.held_id = None
        self.tokens_produced += tokens
        protocol.send(response)
        self._wake()

    def set_version(self, version: str) -> None:
        """``/update_weight_version``: the tokens sampled from now on are ``version``'s."""
        self.version = version


class _CannedHTTP(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server: it reads the request line, ``Content-Length`` and the body, and
    answers through :class:`_Answers` and :class:`_Hold` (render and generate answers after a fixed delay)."""

    def __init__(self, answers: _Answers, delay: float, hold: _Hold) -> None:
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
                response = _status_response(error_answer(error))
            if response is not None:
                self.send(response)

    def _respond(self, method: str, target: str, body: bytes) -> bytes | None:
        """The answer to one request, or None when it is answered later (delayed, held or waiting)."""
        path, _, query = target.partition("?")
        expected = _METHODS.get(path)
        if expected is None:
            return _json_response(NOT_FOUND, 404)
        if method != expected:
            return _status_response(method_not_allowed())
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
            return _http_response(b"")
        if path in (HOLD_PATH, WAIT_PATH, STATS_PATH):
            return hold.control(path, read_json(body or b"{}"), self)
        if path == PAUSE_PATH:
            return hold.pause(pause_query(_query(query)), self)
        if path == RESUME_PATH:
            return hold.resume()
        if path == IS_PAUSED_PATH:
            return _json_response(is_paused_answer(hold.paused))
        if path == UPDATE_WEIGHT_VERSION_PATH:
            version = weight_version_of(read_json(body))
            hold.set_version(version)
            return _json_response(update_weight_version_answer(version))
        if path == WEIGHT_INFO_PATH:
            return _json_response(weight_info_answer(hold.version))
        if path == UPDATE_WEIGHTS_PATH:
            update_info(read_json(body))
            return _json_response(UPDATED_WEIGHTS)
        if path == MODELS_PATH:
            return _json_response(models_answer(MODEL, root=MODEL, max_model_len=MAX_MODEL_LEN))
        return _http_response(b"")  # /health

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
    answers = _Answers(_canned())
    hold = _Hold(answers)

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
