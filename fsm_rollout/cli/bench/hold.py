"""The bench server's hold mode and weight-update state, shared by every connection of the server.

For the weight-update workload the server can hold generate requests in flight (:class:`Hold`, turned on and read
through the ``/bench/...`` control paths): every first-turn request waits, having "produced" the first tokens of the
canned answer, until ``abort_requests`` names it (answered ``finish_reason: "abort"`` with those tokens, their
logprobs and ``weight_versions`` spans, as vLLM answers) or the hold is released; the continuation request (prompt
plus those tokens) waits too, and gets the rest when the hold is released. It counts generate requests, abort
calls and the tokens it produced, and answers a waiting control request the moment a count is reached, so the
bench needs no polling.

The pause is kept here too: ``/pause`` (``abort`` ends the held requests, ``wait`` answers once none is held,
``keep`` holds the generate requests arriving meanwhile until ``/resume``), ``/resume`` and
``/update_weight_version``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from fsm_rollout.cli.bench.canned import Answers, json_response
from fsm_rollout.engine.schema import RequestError, sent_request_id
from fsm_rollout.engine.serving import PAUSED, RESUMED, GenerateRequest

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
"""``POST {}`` answers the counts now (:meth:`Hold.stats`)."""


class Connection(Protocol):
    """One client connection of the server, as the hold answers on it."""

    held_id: str | None
    """The generate request of this connection the hold holds (a client sends one at a time)."""

    def send(self, response: bytes) -> None:
        """Send ``response`` now."""

    def send_later(self, response: bytes) -> None:
        """Send ``response`` after the canned delay (the model's latency)."""


class Hold:
    """The hold mode's and the pause's state, shared by every connection of the server (see the module docstring).

    A held request is a first-turn request (its context is the canned prompt), which has produced the first
    ``partial`` tokens of the canned answer with the weights of the moment it arrived, or a continuation (the
    prompt and those tokens), which has produced nothing yet: the engine is still on it when the bench measures,
    as a real engine re-filling a whole batch would be. Times are ``time.monotonic()``: CLOCK_MONOTONIC on Linux,
    the same clock in the bench's process, so the bench can compare a moment here with one of its own.
    """

    def __init__(self, answers: Answers) -> None:
        self._answers = answers
        self._prompt = answers.canned.prompt
        self._answer = answers.canned.answer
        self.partial = 0
        self.counting = False
        """Generate requests are looked into and counted (hold or release)."""
        self.holding = False
        self.version = "default"
        self.paused = False
        self._parked: list[tuple[GenerateRequest, Connection]] = []
        """Generate requests that arrived while paused, answered on resume."""
        self._continuation: list[int] = []
        self._held: dict[str, tuple[Connection, int, str, GenerateRequest]] = {}
        """Held requests by id: the connection to answer on, where in the canned answer the request starts, the
        weight version of its tokens so far, and the request."""
        self._waiters: list[tuple[str, int, Connection, bytes]] = []
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

    def control(self, path: str, request: dict[str, Any], protocol: Connection) -> bytes | None:
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
            return json_response(
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
        return json_response(self.stats())

    def _wait(self, kind: str, count: int, protocol: Connection, answer: bytes) -> None:
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
                protocol.send(answer or json_response(self.stats()))
            else:
                waiting.append((kind, count, protocol, answer))
        self._waiters = waiting

    # ---------------------------------------------------------------- what the client asks

    def generate(self, request: GenerateRequest, protocol: Connection) -> bytes | None:
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

    def pause(self, mode: str, protocol: Connection) -> bytes | None:
        """``/pause``: ``abort`` ends every held request, ``wait`` answers once none is held, ``keep`` leaves them."""
        self.paused = True
        if mode == "abort":
            for request_id in list(self._held):
                self._abort_held(request_id)
        if mode == "wait" and self._held:
            self._wait("drained", 0, protocol, json_response(PAUSED))
            return None
        return json_response(PAUSED)

    def resume(self) -> bytes:
        """``/resume``: the generate requests parked while paused are answered (or held) now."""
        self.paused = False
        parked, self._parked = self._parked, []
        for request, protocol in parked:
            response = self.generate(request, protocol)
            if response is not None:
                protocol.send_later(response)
        return json_response(RESUMED)

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
