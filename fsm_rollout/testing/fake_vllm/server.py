"""The fake vLLM server itself: lifecycle, scripting, request recording, generate answers and its backend for
the serving frame.

Which turn a request answers is :mod:`~fsm_rollout.testing.fake_vllm.turns`'s; how requests wait (holds, pauses,
aborts, releases) is :mod:`~fsm_rollout.testing.fake_vllm.waiting`'s.

Why this module is long: it is one class whose methods share the server's state (its script, recorded requests,
load and weight version), the handles tests reach the fake by; what can stand alone already lives beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web

from fsm_rollout.engine.endpoints import error_response, json_response, serve_backend
from fsm_rollout.engine.load import EngineLoad
from fsm_rollout.engine.schema import (
    DEFAULT_WEIGHT_VERSION,
    Finish,
    ModelList,
    PauseMode,
    RequestError,
    WeightVersionSpan,
)
from fsm_rollout.engine.serving import GenerateRequest, RenderRequest, models_answer
from fsm_rollout.engine.stop_strings import StopCut
from fsm_rollout.engine.token_stream import stream_flags
from fsm_rollout.testing.fake_vllm.faults import Fault, answer_fault, make_fault
from fsm_rollout.testing.fake_vllm.generation import (
    LogprobEntryStyle,
    as_token_ids,
    complete,
    generate_answer,
    version_spans,
)
from fsm_rollout.testing.fake_vllm.routes import ExpertDims, answer_routes, check_expert_dims
from fsm_rollout.testing.fake_vllm.scripting import SESSION_HEADER, RecordedRequest, ScriptedTurn, recorded_body
from fsm_rollout.testing.fake_vllm.streaming import send_tokens, stream_rest
from fsm_rollout.testing.fake_vllm.turns import Job, TurnQueues
from fsm_rollout.testing.fake_vllm.waiting import Waiter, WaitingRoom

RenderFeaturesHook = Callable[[list[dict[str, Any]], list[int]], tuple[list[int], dict[str, Any] | None]]
"""``(messages, template_ids) -> (prompt_ids, features)``: how render answers a conversation with images."""

_CLIENT_MAX_SIZE = 64 * 1024 * 1024
_T = TypeVar("_T")


class FakeVLLMServer:
    """A scripted stand-in for ``vllm serve --enable-scale-out`` (with ``VLLM_SERVER_DEV_MODE=1``) on loopback;
    use as an async context manager.

    ``url`` is ``http://<host>:<port>`` once started (``port=0`` picks a free port). ``requests`` holds every
    request in arrival order, ``aborted_request_ids`` the ids named by abort_requests,
    ``disconnected_request_ids`` the generate requests whose client went away before the answer,
    ``interrupted_request_ids`` the generate requests answered ``abort`` because they were aborted while
    waiting, and ``continuation_request_ids`` those that continued an interrupted turn (see
    :class:`ScriptedTurn`'s ``held_after``). ``logprob_entry_style`` picks which of vLLM's two
    ``logprobs.content`` entry shapes is sent.

    Weight updates: ``POST /pause?mode=abort|wait|keep`` pauses generation (``paused``, ``pause_mode``).
    ``abort`` aborts every held request (see :class:`ScriptedTurn`) and ``wait`` lets them finish; both answer
    once no generate request is being answered. ``keep`` freezes held requests (a delay's clock stops) until
    ``POST /resume`` or a pause in another mode. While paused, arriving generate requests are recorded and
    draw their turn, then wait for resume; they are not at the engine yet, so no abort reaches them.
    ``POST /update_weight_version`` sets ``weight_version`` (initially ``"default"``), ``GET /weight_info``
    reports it, and ``POST /update_weights`` bodies are kept in ``weight_updates`` (there are no weights to
    load).

    Every generate answer has ``choices[0].weight_versions``: its tokens carry the version current when the
    request started, except that a held request frozen by a ``keep`` pause gives its remaining tokens (after
    ``held_after``) the version current when the pause let it go on. ``weight_version_spans=False`` leaves the
    spans out of every answer, as a server that does not label its tokens.

    ``waiting_request_ids`` are the generate requests waiting now (held, or waiting for resume) and
    ``held_request_ids`` the held ones; ``await wait_until_waiting(n)`` returns once ``n`` wait, so tests act on
    a request known to be waiting instead of sleeping, and :meth:`release` ends a hold without a clock.

    ``routed_experts=(num_layers, topk)`` makes every answer carry ``choices[0].routed_experts`` as vLLM does with
    ``--enable-return-routed-experts``: one row per prompt and output token, less the last, each row the fake
    routing of the version it was computed under (:mod:`fsm_rollout.testing.fake_vllm.routes`). An aborted answer
    carries none, as vLLM's abort path sends none, unless ``routes_on_abort``. A turn's ``choice_extra`` still wins.

    ``render_features``, when given, is called (in the tokenizer thread) with each render request's messages and
    the ids the chat template rendered; it returns the prompt ids to answer with (e.g. with image placeholders
    expanded) and the ``features`` to send (see :func:`fsm_rollout.multimodal.codec.render_features`). An exception
    from it answers 400. Without it, render answers the template's ids and ``features: null``.

    ``generate_stream`` is how a ``"stream": true`` generate is met: ``"sse"`` streams it as vLLM 0.32 does;
    ``"rejected"`` answers 400 for ``"stream": true``, as an older server that does not stream this endpoint;
    ``"ignored"`` answers the whole JSON body, as a server that does not read the field.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        model: str = "fake-model",
        max_model_len: int = 4096,
        logprob_entry_style: LogprobEntryStyle = "token_id",
        host: str = "127.0.0.1",
        port: int = 0,
        render_features: RenderFeaturesHook | None = None,
        weight_version_spans: bool = True,
        routed_experts: ExpertDims | None = None,
        routes_on_abort: bool = False,
        publish_metrics: bool = True,
        kv_cache_tokens: int | None = None,
        generate_stream: str = "sse",
    ) -> None:
        if generate_stream not in ("sse", "rejected", "ignored"):
            raise ValueError(f"generate_stream must be 'sse', 'rejected' or 'ignored', got {generate_stream!r}")
        self.generate_stream = generate_stream
        if logprob_entry_style not in ("token_id", "token"):
            raise ValueError(f"logprob_entry_style must be 'token_id' or 'token', got {logprob_entry_style!r}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.model = model
        self.model_root = model
        """What ``/v1/models`` names as the model's ``root`` (vLLM: the path it loaded); a test may point it at a
        tokenizer directory."""
        self.max_model_len = max_model_len
        self.logprob_entry_style: LogprobEntryStyle = logprob_entry_style
        self.host = host
        self.port = port
        self.render_features = render_features
        self.weight_version_spans = weight_version_spans
        self.routed_experts = check_expert_dims(routed_experts)
        self.routes_on_abort = routes_on_abort
        self.requests: list[RecordedRequest] = []
        self.aborted_request_ids: list[str] = []
        self.disconnected_request_ids: list[str] = []
        self.interrupted_request_ids: list[str] = []
        self.continuation_request_ids: list[str] = []
        self.weight_updates: list[Any] = []
        self._turns = TurnQueues()
        self._faults: dict[str, deque[Fault]] = {}
        self._room = WaitingRoom(on_disconnect=self.disconnected_request_ids.append)
        self._in_flight = 0
        self._in_flight_tokens = 0
        self.publish_metrics = publish_metrics
        """Whether ``GET /metrics`` is served (False: a 404, as from a server that publishes no load)."""
        self.kv_cache_tokens = kv_cache_tokens or 16 * max_model_len
        """The KV cache the fake counts its in-flight prompts against (``vllm:kv_cache_usage_perc``)."""
        self.metrics_reads = 0
        """How often ``GET /metrics`` was answered (:meth:`wait_until` sees it change)."""
        self.reported_load: dict[str, float] = {}
        """What :meth:`report_load` set: published over the fake's own counts."""
        self._weight_version: str = DEFAULT_WEIGHT_VERSION
        self._runner: web.AppRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._url: str | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """The server's base URL; only available while it runs."""
        if self._url is None:
            raise RuntimeError("FakeVLLMServer is not started")
        return self._url

    async def start(self) -> None:
        """Bind the port and start answering."""
        if self._runner is not None:
            raise RuntimeError("FakeVLLMServer is already started")
        runner, url = await serve_backend(
            _Backend(self),
            host=self.host,
            port=self.port,
            client_max_size=_CLIENT_MAX_SIZE,
            middlewares=[self._record_and_inject],
            load=self.load if self.publish_metrics else None,
        )
        self._runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-vllm-tokenizer")
        self._room.open()
        self._url = url

    async def stop(self) -> None:
        """Answer every waiting generate with "abort", then close the server."""
        self._room.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._url = None

    async def __aenter__(self) -> FakeVLLMServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---------------------------------------------------------------- scripting

    def script(self, turns: Sequence[ScriptedTurn], *, session: str | None = None) -> None:
        """Append turns to a session's queue.

        ``session=None`` is the default queue, used by generate requests without an ``x-session-id`` header
        and by requests naming a session that was never scripted.
        """
        self._turns.script(turns, session)

    def fail_next(
        self,
        path: str,
        *,
        status: int | None = None,
        times: int = 1,
        malformed_json: bool = False,
        reset: bool = False,
        delay: float = 0.0,
    ) -> None:
        """Make the next ``times`` requests to ``path`` fail, before any other handling.

        Exactly one kind of fault: ``status`` (an HTTP error with a vLLM-like error body; the default, 500),
        ``malformed_json`` (a 200 whose body is not valid JSON) or ``reset`` (the connection is closed without
        an answer). ``delay`` seconds pass before the fault. Faults queue up in call order per path.
        """
        fault = make_fault(status=status, malformed_json=malformed_json, reset=reset, delay=delay, times=times)
        self._faults.setdefault(path, deque()).extend([fault] * times)

    def clear_faults(self) -> None:
        """Drop every queued fault that no request has met yet."""
        self._faults.clear()

    def load(self) -> EngineLoad:
        """The load ``GET /metrics`` publishes: generate requests being answered (``running``), those held by a
        pause (``waiting``), their prompts' share of :attr:`kv_cache_tokens`; what :meth:`report_load` set wins."""
        reported = self.reported_load
        kv_usage = min(1.0, self._in_flight_tokens / self.kv_cache_tokens)
        self.metrics_reads += 1
        self._room.changed()
        return EngineLoad(
            running=int(reported.get("running", self._in_flight)),
            waiting=int(reported.get("waiting", sum(not waiter.held for waiter in self._room.waiters))),
            kv_cache_usage=float(reported.get("kv_cache_usage", kv_usage)),
            preemptions=int(reported.get("preemptions", 0)),
        )

    def report_load(self, **fields: float | None) -> None:
        """Publish these load fields (``running``, ``waiting``, ``kv_cache_usage``, ``preemptions``) over the fake's
        own counts, as a loaded engine would; None gives a field back to the counts."""
        for name, value in fields.items():
            if name not in ("running", "waiting", "kv_cache_usage", "preemptions"):
                raise ValueError(f"report_load: unknown load field {name!r}")
            if value is None:
                self.reported_load.pop(name, None)
            else:
                self.reported_load[name] = value

    def requests_to(self, path: str) -> list[RecordedRequest]:
        """The recorded requests to ``path``, in arrival order."""
        return [recorded for recorded in self.requests if recorded.path == path]

    # ---------------------------------------------------------------- weight-update state

    @property
    def paused(self) -> bool:
        """Whether ``/pause`` stopped generation (until ``/resume``)."""
        return self._room.pause_mode is not None

    @property
    def pause_mode(self) -> str | None:
        """The mode of the pause in force (``abort``, ``wait`` or ``keep``), None when not paused."""
        return self._room.pause_mode

    @property
    def weight_version(self) -> str:
        """The weight version new tokens are labelled with; ``/update_weight_version`` sets it."""
        return self._weight_version

    @property
    def waiting_request_ids(self) -> list[str]:
        """The generate requests waiting now, held by their turn or for resume, in the order they began to."""
        return [waiter.request_id for waiter in self._room.waiters]

    @property
    def held_request_ids(self) -> list[str]:
        """The generate requests held by their turn's ``hang`` or ``delay`` now (frozen ones included)."""
        return [waiter.request_id for waiter in self._room.waiters if waiter.held]

    def release(self, request_id: str) -> int:
        """Let the held requests with this id (either id form) finish as if their delay had run out, a hanging
        one too; one frozen by a ``keep`` pause finishes once the pause ends. Returns how many were released."""
        return self._room.release(request_id)

    async def wait_until_waiting(self, count: int = 1) -> None:
        """Return once at least ``count`` generate requests wait at the server (see ``waiting_request_ids``)."""
        await self.wait_until(lambda: len(self._room.waiters) >= count)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; it is checked now and after every change of the server's waiting
        requests, requests being answered, pause mode or weight version."""
        await self._room.wait_until(predicate)

    # ---------------------------------------------------------------- middleware

    @web.middleware
    async def _record_and_inject(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            raw = await request.read()
        except web.HTTPException:  # e.g. 413: the body exceeds client_max_size
            self.requests.append(RecordedRequest(request.path, dict(request.headers), None, arrived))
            raise
        body = recorded_body(raw)
        self.requests.append(RecordedRequest(request.path, dict(request.headers), body, arrived))

        fault_queue = self._faults.get(request.path)
        if fault_queue:
            return await answer_fault(request, fault_queue.popleft())
        return await handler(request)

    # ---------------------------------------------------------------- the frame's backend (see _Backend)

    async def _abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.aborted_request_ids.append(request_id)
            self._room.abort(request_id)

    async def _pause(self, mode: PauseMode) -> None:
        self._set_pause_mode(mode)
        if mode == "abort":
            self._room.abort_held()
        if mode != "keep":
            await self.wait_until(lambda: self._in_flight == 0)

    async def _set_weight_version(self, version: str) -> None:
        self._weight_version = version
        self._room.changed()

    def _set_pause_mode(self, mode: str | None) -> None:
        self._room.set_pause_mode(mode, self._weight_version)

    async def _render(self, request: RenderRequest) -> tuple[list[int], Any]:
        messages = request.messages
        try:
            token_ids = await self._in_tokenizer_thread(self._render_ids, request)
        except Exception as error:  # a template that cannot render these messages is the request's fault
            raise RequestError(400, f"chat template rendering failed: {error}") from error
        features: dict[str, Any] | None = None
        if self.render_features is not None:
            try:
                token_ids, features = await self._in_tokenizer_thread(self.render_features, messages, token_ids)
            except Exception as error:  # like vLLM's answer to an image it cannot load or process
                raise RequestError(400, f"multimodal processing failed: {error}") from error
        return token_ids, features

    def _stream_flags(self, params: GenerateRequest) -> tuple[bool, bool]:
        """``(stream, include_usage)`` as this server meets them (``generate_stream``)."""
        flags = stream_flags(params.body)
        if self.generate_stream == "sse":
            return flags
        if self.generate_stream == "rejected" and flags[0]:  # the field is known (its render sends it false)
            raise RequestError(400, "stream: streaming is not supported on this endpoint", "stream")
        return False, False

    async def _generate(self, params: GenerateRequest, http: web.Request) -> web.StreamResponse:
        session = http.headers.get(SESSION_HEADER)
        self._stream_flags(params)  # an older server refuses the field before it draws a turn
        job = self._turns.next_job(session, params.token_ids)
        if job.continued:
            self.continuation_request_ids.append(params.request_id)
        if self._room.pause_mode is not None:
            await self._room.wait_for_resume(params.request_id)
            if self._room.stopping:
                self.interrupted_request_ids.append(params.request_id)
                aborted = self._generate_answer(params, job, [], "abort", [])
                if self._stream_flags(params)[0]:
                    return await stream_rest(http, None, params.request_id, aborted)
                return json_response(aborted)
        self._in_flight += 1
        self._in_flight_tokens += params.prompt_len
        try:
            return await self._answer(session, params, job, http)
        finally:
            self._in_flight -= 1
            self._in_flight_tokens -= params.prompt_len
            self._room.changed()

    # ---------------------------------------------------------------- generate helpers

    async def _answer(
        self, session: str | None, params: GenerateRequest, job: Job, http: web.Request
    ) -> web.StreamResponse:
        turn = job.turn
        version = self._weight_version
        stream, include_usage = self._stream_flags(params)
        waiter: Waiter | None = None
        opened: web.StreamResponse | None = None  # a streamed held turn's first tokens went out before its hold
        sent = 0
        if job.waits:
            waiter = Waiter(params.request_id, held=True)
            if stream and job.held_after and turn.raw is None and turn.status == 200:
                cut = await self._output(job, params)
                sent = min(job.held_after, len(cut.token_ids))
                early = self._generate_answer(params, job, cut.token_ids, "stop", [])
                opened = await send_tokens(http, None, params.request_id, early, sent)
            # A keep pause stops the delay's clock; a client gone meanwhile is recorded in disconnected_request_ids.
            if await self._room.hold(waiter, None if turn.hang else turn.delay):
                aborted = await self._aborted_answer(session, params, job, version)
                if stream:
                    return await stream_rest(
                        http, opened, params.request_id, aborted, start=sent, include_usage=include_usage
                    )
                return json_response(aborted)
        if turn.raw is not None:
            return json_response(turn.raw, status=turn.status)
        if turn.status != 200:
            return error_response(turn.status, f"fake vLLM: scripted error ({turn.status})")

        cut = await self._output(job, params)
        token_ids = cut.token_ids
        runs = [(version, len(token_ids))]
        if waiter is not None and waiter.resumed_version is not None:
            held = min(job.held_after or 0, len(token_ids))
            runs = [(version, held), (waiter.resumed_version, len(token_ids) - held)]
        finish = turn.finish or cut.finish
        reason = cut.stop_reason if finish == "stop" else None
        answer = self._generate_answer(
            params, job, token_ids, finish, version_spans(runs), stop_reason=reason, routes=(version, runs)
        )
        if stream:
            return await stream_rest(http, opened, params.request_id, answer, start=sent, include_usage=include_usage)
        return json_response(answer)

    async def _aborted_answer(
        self, session: str | None, params: GenerateRequest, job: Job, version: str
    ) -> dict[str, Any]:
        """The ``abort`` answer of a held request: the tokens it had produced, and the turn left to continue."""
        token_ids: list[int] = []
        if job.held_after is not None:
            token_ids = (await self._output(job, params)).token_ids[: job.held_after]
            self._turns.interrupt(session, job, (*params.token_ids, *token_ids), len(token_ids))
        self.interrupted_request_ids.append(params.request_id)
        runs = [(version, len(token_ids))]
        routes = (version, runs) if self.routes_on_abort else None
        return self._generate_answer(params, job, token_ids, "abort", version_spans(runs), routes=routes)

    async def _output(self, job: Job, params: GenerateRequest) -> StopCut:
        """The job's new tokens and why they end: the whole turn is cut (so a stop string across an interruption
        is found where it would have been) with ``max_tokens`` and ``min_tokens`` counted from ``job.offset``."""
        settings = params.settings
        whole = dataclasses.replace(
            settings, max_tokens=job.offset + settings.max_tokens, min_tokens=job.offset + settings.min_tokens
        )
        cut = await self._in_tokenizer_thread(complete, self.tokenizer, job.turn, whole)
        return dataclasses.replace(cut, token_ids=cut.token_ids[job.offset :])

    def _generate_answer(
        self,
        params: GenerateRequest,
        job: Job,
        token_ids: list[int],
        finish: Finish,
        weight_versions: list[WeightVersionSpan],
        stop_reason: str | int | None = None,
        routes: tuple[str, list[tuple[str, int]]] | None = None,
    ) -> dict[str, Any]:
        routed = None
        if routes is not None and self.routed_experts is not None:
            routed = answer_routes(params.prompt_len, routes[1], routes[0], self.routed_experts)
        return generate_answer(
            params,
            job.turn,
            token_ids,
            finish,
            model=self.model,
            logprob_entry_style=self.logprob_entry_style,
            weight_versions=weight_versions if self.weight_version_spans else None,
            stop_reason=stop_reason,
            offset=job.offset,
            routed_experts=routed,
        )

    # ---------------------------------------------------------------- tokenizer work (worker thread)

    async def _in_tokenizer_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._executor is None:
            raise RuntimeError("FakeVLLMServer is not started")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _render_ids(self, request: RenderRequest) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            request.messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=True,
            **request.template_kwargs,
        )
        return as_token_ids(rendered)


class _Backend:
    """The fake server as the serving frame's backend (see :mod:`fsm_rollout.engine.endpoints`)."""

    def __init__(self, server: FakeVLLMServer) -> None:
        self._server = server

    @property
    def served_model_name(self) -> str:
        return self._server.model

    @property
    def max_model_len(self) -> int:
        return self._server.max_model_len

    @property
    def vocab_size(self) -> None:
        return None  # scripted token ids are whatever a test chose

    def models(self) -> ModelList:
        server = self._server
        return models_answer(server.model, root=server.model_root, max_model_len=server.max_model_len)

    async def render(self, request: RenderRequest) -> tuple[list[int], Any]:
        return await self._server._render(request)

    async def generate(self, request: GenerateRequest, http: web.Request) -> web.StreamResponse:
        return await self._server._generate(request, http)

    async def abort(self, request_ids: list[str]) -> None:
        await self._server._abort_requests(request_ids)

    async def pause(self, mode: PauseMode) -> None:
        await self._server._pause(mode)

    async def resume(self) -> None:
        self._server._set_pause_mode(None)

    def is_paused(self) -> bool:
        return self._server.paused

    async def update_weight_version(self, version: str) -> None:
        await self._server._set_weight_version(version)

    def weight_version(self) -> str:
        return self._server.weight_version

    async def update_weights(self, body: dict[str, Any]) -> None:
        self._server.weight_updates.append(body)  # there are no weights to load
