"""The fake vLLM server itself: lifecycle, scripting, request recording and the endpoint handlers."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web

from fsm_rollout.engine.endpoints import EndpointHandlers, error_response, json_response, serve_endpoints
from fsm_rollout.engine.schema import (
    Finish,
    RenderAnswer,
    RequestError,
    abort_request_ids,
    check_model,
    decode_json_object,
    model_list,
    render_messages,
    render_sampling_params,
    render_template_kwargs,
    render_tools,
)
from fsm_rollout.testing.fake_vllm.faults import Fault, answer_fault, make_fault
from fsm_rollout.testing.fake_vllm.generation import (
    GenerateParams,
    LogprobEntryStyle,
    as_token_ids,
    complete,
    generate_answer,
    generate_params,
)
from fsm_rollout.testing.fake_vllm.scripting import (
    SESSION_HEADER,
    RecordedRequest,
    ScriptedTurn,
    check_turns,
    recorded_body,
)

RenderFeaturesHook = Callable[[list[dict[str, Any]], list[int]], tuple[list[int], dict[str, Any] | None]]
"""``(messages, template_ids) -> (prompt_ids, features)``: how render answers a conversation with images."""

_CLIENT_MAX_SIZE = 64 * 1024 * 1024
_T = TypeVar("_T")


class FakeVLLMServer:
    """A scripted stand-in for ``vllm serve --enable-scale-out`` on loopback; use as an async context manager.

    ``url`` is ``http://<host>:<port>`` once started (``port=0`` picks a free port). ``requests`` holds every
    request in arrival order, ``aborted_request_ids`` the ids named by abort_requests, and
    ``disconnected_request_ids`` the generate requests whose client went away before the answer.
    ``logprob_entry_style`` picks which of vLLM's two ``logprobs.content`` entry shapes is sent.

    ``render_features``, when given, is called (in the tokenizer thread) with each render request's messages and
    the ids the chat template rendered; it returns the prompt ids to answer with (e.g. with image placeholders
    expanded) and the ``features`` to send (see :func:`fsm_rollout.mm_codec.render_features`). An exception
    from it answers 400. Without it, render answers the template's ids and ``features: null``.
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
    ) -> None:
        if logprob_entry_style not in ("token_id", "token"):
            raise ValueError(
                f"logprob_entry_style must be 'token_id' or 'token', got {logprob_entry_style!r}"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.logprob_entry_style: LogprobEntryStyle = logprob_entry_style
        self.host = host
        self.port = port
        self.render_features = render_features
        self.requests: list[RecordedRequest] = []
        self.aborted_request_ids: list[str] = []
        self.disconnected_request_ids: list[str] = []
        self._queues: dict[str | None, deque[ScriptedTurn]] = {None: deque()}
        self._faults: dict[str, deque[Fault]] = {}
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._runner: web.AppRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._url: str | None = None
        self._stopping = False

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
        runner, url = await serve_endpoints(
            EndpointHandlers.of(self),
            host=self.host,
            port=self.port,
            client_max_size=_CLIENT_MAX_SIZE,
            middlewares=[self._record_and_inject],
        )
        self._runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-vllm-tokenizer")
        self._stopping = False
        self._url = url

    async def stop(self) -> None:
        """Answer every waiting generate with "abort", then close the server."""
        self._stopping = True
        for events in self._waiting.values():
            for event in events:
                event.set()
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
        check_turns(turns)
        self._queues.setdefault(session, deque()).extend(turns)

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

    def requests_to(self, path: str) -> list[RecordedRequest]:
        """The recorded requests to ``path``, in arrival order."""
        return [recorded for recorded in self.requests if recorded.path == path]

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
        try:
            return await handler(request)
        except RequestError as error:
            return error_response(error.status, error.message, error.param)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as error:
            return json_response({"detail": error.reason}, status=error.status)

    # ---------------------------------------------------------------- handlers

    async def _handle_health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        return json_response(model_list(self.model, root=self.model, max_model_len=self.max_model_len))

    async def _handle_abort(self, request: web.Request) -> web.StreamResponse:
        body = await _json_object_body(request)
        for request_id in abort_request_ids(body):
            self.aborted_request_ids.append(request_id)
            for event in self._waiting.get(request_id, ()):
                event.set()
        return json_response({})

    async def _handle_render(self, request: web.Request) -> web.StreamResponse:
        body = await _json_object_body(request)
        check_model(body, self.model)
        messages = render_messages(body)
        tools = render_tools(body)
        template_kwargs = render_template_kwargs(body)
        try:
            token_ids = await self._in_tokenizer_thread(self._render_ids, messages, tools, template_kwargs)
        except Exception as error:  # a template that cannot render these messages is the request's fault
            raise RequestError(400, f"chat template rendering failed: {error}") from error
        features: dict[str, Any] | None = None
        if self.render_features is not None:
            try:
                token_ids, features = await self._in_tokenizer_thread(self.render_features, messages, token_ids)
            except Exception as error:  # like vLLM's answer to an image it cannot load or process
                raise RequestError(400, f"multimodal processing failed: {error}") from error
        answer: RenderAnswer = {
            "request_id": f"chatcmpl-{uuid.uuid4().hex}",
            "token_ids": token_ids,
            "features": features,
            "sampling_params": render_sampling_params(body),
            "model": self.model,
            "stream": False,
            "stream_options": None,
            "cache_salt": None,
            "priority": 0,
        }
        return json_response(answer)

    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_object_body(request)
        check_model(body, self.model)
        params = generate_params(body, self.max_model_len)
        session = request.headers.get(SESSION_HEADER)
        queue = self._queues[session if session in self._queues else None]
        if not queue:
            name = "<default>" if session is None else session
            raise RequestError(500, f"fake vLLM: no scripted turn left for session {name}")
        turn = queue.popleft()

        if await self._wait_unless_aborted(params.request_id, turn):
            return json_response(self._generate_answer(params, turn, [], "abort"))
        if turn.raw is not None:
            return json_response(turn.raw, status=turn.status)
        if turn.status != 200:
            return error_response(turn.status, f"fake vLLM: scripted error ({turn.status})")

        token_ids, natural_finish = await self._in_tokenizer_thread(complete, self.tokenizer, turn, params)
        answer = self._generate_answer(params, turn, token_ids, turn.finish or natural_finish)
        return json_response(answer)

    # ---------------------------------------------------------------- generate helpers

    async def _wait_unless_aborted(self, request_id: str, turn: ScriptedTurn) -> bool:
        """Sleep for the turn's delay (forever if it hangs); True when abort_requests named the request first.

        A client that disconnects meanwhile cancels this handler (``handler_cancellation=True``): the request
        is recorded in ``disconnected_request_ids`` and the cancellation goes on.
        """
        if not turn.hang and turn.delay <= 0:
            return False
        event = asyncio.Event()
        self._waiting.setdefault(request_id, set()).add(event)
        try:
            timeout = None if turn.hang else turn.delay
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                return False
            return True
        except asyncio.CancelledError:
            if not self._stopping:
                self.disconnected_request_ids.append(request_id)
            raise
        finally:
            events = self._waiting.get(request_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[request_id]

    def _generate_answer(
        self, params: GenerateParams, turn: ScriptedTurn, token_ids: list[int], finish: Finish
    ) -> dict[str, Any]:
        return generate_answer(
            params, turn, token_ids, finish, model=self.model, logprob_entry_style=self.logprob_entry_style
        )

    # ---------------------------------------------------------------- tokenizer work (worker thread)

    async def _in_tokenizer_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._executor is None:
            raise RuntimeError("FakeVLLMServer is not started")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _render_ids(
        self, messages: list[Any], tools: list[Any] | None, template_kwargs: dict[str, Any]
    ) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **template_kwargs
        )
        return as_token_ids(rendered)


async def _json_object_body(request: web.Request) -> dict[str, Any]:
    # aiohttp caches the body the middleware read, so this reads no bytes from the socket.
    return decode_json_object(await request.read())
