"""A fake vLLM server for tests: vLLM's token-in/token-out HTTP endpoints, answered from scripted turns.

``FakeVLLMServer`` listens on loopback over real HTTP (aiohttp) and answers the endpoints the rollout client
uses with vLLM's JSON shapes:

* ``POST /v1/chat/completions/render`` renders the conversation with the tokenizer's chat template;
* ``POST /inference/v1/generate`` answers with the next ``ScriptedTurn`` of the request's session, cut by
  ``stop`` strings, ``stop_token_ids``, EOS and ``max_tokens`` the way vLLM would cut a real generation;
* ``POST /inference/v1/abort_requests`` ends delayed or hanging generate requests with
  ``finish_reason="abort"``;
* ``GET /health`` and ``GET /v1/models``.

Every request is recorded (``requests``); ``fail_next`` injects faults (HTTP errors, malformed JSON, dropped
connections) ahead of the normal handling. Tokenizer work runs in one worker thread so the event loop stays
free.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar

import orjson
from aiohttp import web

from fsm_rollout.engine.endpoints import EndpointHandlers, error_response, json_response, serve_endpoints
from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    RENDER_PATH,
    Finish,
    GenerateAnswer,
    GenerateChoice,
    LogprobEntry,
    RenderAnswer,
    RequestError,
    abort_request_ids,
    boolean_field,
    check_model,
    check_prompt_room,
    check_single_prompt_extra,
    decode_json_object,
    generate_request_id,
    model_list,
    render_messages,
    render_sampling_params,
    render_template_kwargs,
    render_tools,
    request_sampling_params,
    request_token_ids,
    resolve_max_tokens,
    server_request_id,
    stop_strings,
    stop_token_ids,
    token_text,
)

__all__ = [
    "ABORT_PATH",
    "GENERATE_PATH",
    "HEALTH_PATH",
    "MODELS_PATH",
    "RENDER_PATH",
    "FakeVLLMServer",
    "RecordedRequest",
    "ScriptedTurn",
]

SESSION_HEADER = "x-session-id"
"""Header naming the script queue a generate request draws its turn from."""

LogprobEntryStyle = Literal["token_id", "token"]
RenderFeaturesHook = Callable[[list[dict[str, Any]], list[int]], tuple[list[int], dict[str, Any] | None]]
"""``(messages, template_ids) -> (prompt_ids, features)``: how render answers a conversation with images."""

_CLIENT_MAX_SIZE = 64 * 1024 * 1024
_MIN_LOGPROB = -9999.0  # vLLM clamps logprobs to this in the "token" entry style (-inf is not JSON)
_MALFORMED_JSON_BODY = b'{"request_id": "%s", "choices": [{"index": 0, "token_ids": [1, 2' % (
    server_request_id("trunc").encode()
)
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class ScriptedTurn:
    """One answer of the fake model to one generate request.

    Give the output as ``text`` (encoded with ``add_special_tokens=False``) or as exact ``token_ids``, unless
    ``raw`` is set: then ``raw`` is sent verbatim as the JSON body (for schema-violation tests). A ``status``
    other than 200 answers with a vLLM-like error body (or with ``raw``, when set).

    ``finish=None`` lets the server decide like vLLM: the output is cut at the first stop string, stop token
    or EOS (the token is kept; "stop") and capped to ``max_tokens`` ("length"). A set ``finish`` overrides the
    reason but not the cuts. ``logprobs`` default to ``-0.01 * (i + 1)`` for the i-th returned token.

    ``delay`` waits before answering and ``hang`` never answers by itself; both end early, with
    ``finish_reason="abort"`` and no tokens, when the request is named by ``/inference/v1/abort_requests``.
    ``choice_extra`` is merged into ``choices[0]`` and ``top_extra`` into the top level of the answer.
    """

    text: str | None = None
    token_ids: list[int] | None = None
    finish: Finish | None = None
    logprobs: list[float] | None = None
    delay: float = 0.0
    hang: bool = False
    raw: Any = None
    status: int = 200
    choice_extra: Mapping[str, Any] = field(default_factory=dict)
    top_extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.raw is None and self.status == 200 and (self.text is None) == (self.token_ids is None):
            raise ValueError(
                "ScriptedTurn needs exactly one of text= or token_ids= (unless raw= or status= is set)"
            )
        if self.delay < 0:
            raise ValueError(f"ScriptedTurn.delay must be >= 0, got {self.delay}")


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it.

    ``body`` is the parsed JSON, the raw text when the body is not JSON, or None when it is empty;
    ``at`` is ``time.monotonic()`` on arrival.
    """

    path: str
    headers: dict[str, str]
    body: Any
    at: float


@dataclass(frozen=True)
class _Fault:
    status: int
    malformed_json: bool
    reset: bool
    delay: float


@dataclass(frozen=True)
class _GenerateParams:
    request_id: str
    prompt_len: int
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool


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
        self._faults: dict[str, deque[_Fault]] = {}
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
        for turn in turns:
            if not isinstance(turn, ScriptedTurn):
                raise TypeError(f"script() takes ScriptedTurn objects, got {type(turn).__name__}")
            if (
                turn.token_ids is not None
                and turn.logprobs is not None
                and len(turn.logprobs) != len(turn.token_ids)
            ):
                raise ValueError(
                    f"ScriptedTurn has {len(turn.logprobs)} logprobs for {len(turn.token_ids)} token ids"
                )
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
        if sum((status is not None, malformed_json, reset)) > 1:
            raise ValueError("fail_next takes one of status=, malformed_json=, reset=")
        if times < 1:
            raise ValueError(f"fail_next times must be >= 1, got {times}")
        if status is not None and not 400 <= status <= 599:
            raise ValueError(f"fail_next status must be an HTTP error status, got {status}")
        fault = _Fault(
            status=500 if status is None else status, malformed_json=malformed_json, reset=reset, delay=delay
        )
        self._faults.setdefault(path, deque()).extend([fault] * times)

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
        body = _recorded_body(raw)
        self.requests.append(RecordedRequest(request.path, dict(request.headers), body, arrived))

        fault_queue = self._faults.get(request.path)
        if fault_queue:
            return await self._answer_fault(request, fault_queue.popleft())
        try:
            return await handler(request)
        except RequestError as error:
            return error_response(error.status, error.message, error.param)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as error:
            return json_response({"detail": error.reason}, status=error.status)

    async def _answer_fault(self, request: web.Request, fault: _Fault) -> web.StreamResponse:
        if fault.delay > 0:
            await asyncio.sleep(fault.delay)
        if fault.reset:
            transport = request.transport
            if transport is not None:
                transport.abort()
            return web.Response(status=500)  # never sent: the connection is gone
        if fault.malformed_json:
            return web.Response(status=200, body=_MALFORMED_JSON_BODY, content_type="application/json")
        return error_response(fault.status, f"fake vLLM: injected fault ({fault.status})")

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
        params = self._generate_params(body)
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

        token_ids, natural_finish = await self._in_tokenizer_thread(self._complete, turn, params)
        answer = self._generate_answer(params, turn, token_ids, turn.finish or natural_finish)
        return json_response(answer)

    # ---------------------------------------------------------------- generate helpers

    def _generate_params(self, body: Mapping[str, Any]) -> _GenerateParams:
        # vLLM's field checks, in this server's order; everything else in the body is accepted and ignored
        token_ids = request_token_ids(body)
        sampling = request_sampling_params(body)
        check_single_prompt_extra(body)
        request_id = generate_request_id(body, uuid.uuid4().hex)
        prompt_len = len(token_ids)
        check_prompt_room(prompt_len, self.max_model_len)
        return _GenerateParams(
            request_id=request_id,
            prompt_len=prompt_len,
            max_tokens=resolve_max_tokens(sampling, prompt_len=prompt_len, max_model_len=self.max_model_len),
            stop=stop_strings(sampling.get("stop")),
            stop_token_ids=stop_token_ids(sampling.get("stop_token_ids")),
            ignore_eos=boolean_field(sampling, "ignore_eos", False),
        )

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
        self, params: _GenerateParams, turn: ScriptedTurn, token_ids: list[int], finish: Finish
    ) -> dict[str, Any]:
        if turn.logprobs is not None:
            logprobs = list(turn.logprobs[: len(token_ids)])
        else:
            logprobs = [-0.01 * (i + 1) for i in range(len(token_ids))]
        if len(logprobs) != len(token_ids):
            raise RequestError(
                500, f"fake vLLM: the scripted turn has {len(logprobs)} logprobs for {len(token_ids)} tokens"
            )
        choice: GenerateChoice = {
            "index": 0,
            "finish_reason": finish,
            "token_ids": token_ids,
            "logprobs": {
                "content": [self._logprob_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
            },
            "routed_experts": None,
            "sampling_mask": None,
        }
        answer: GenerateAnswer = {
            "request_id": server_request_id(params.request_id),
            "model": self.model,
            "created": int(time.time()),
            "choices": [choice],
            "usage": {
                "prompt_tokens": params.prompt_len,
                "completion_tokens": len(token_ids),
                "total_tokens": params.prompt_len + len(token_ids),
            },
        }
        # the extras are free-form (for schema-violation tests): merged outside the record types
        return {**answer, "choices": [{**choice, **turn.choice_extra}], **turn.top_extra}

    def _logprob_entry(self, token_id: int, logprob: float) -> LogprobEntry:
        if self.logprob_entry_style == "token":
            return {
                "token": token_text(token_id),
                "logprob": max(logprob, _MIN_LOGPROB),
                "top_logprobs": [],
            }
        return {"token_id": token_id, "logprob": logprob, "rank": 1, "top_logprobs": []}

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
        return _as_token_ids(rendered)

    def _complete(self, turn: ScriptedTurn, params: _GenerateParams) -> tuple[list[int], Finish]:
        """The tokens vLLM would return for this scripted output, and why it would have stopped."""
        if turn.token_ids is not None:
            scripted = list(turn.token_ids)
        else:
            scripted = _as_token_ids(self.tokenizer.encode(turn.text, add_special_tokens=False))
        end = len(scripted)
        stopped_by_token = False
        stop_at = self._first_stop_string_end(scripted, params.stop)
        if stop_at is not None:
            end = stop_at
            stopped_by_token = True
        eos = None if params.ignore_eos else self.tokenizer.eos_token_id
        for index, token in enumerate(scripted[:end]):
            if token in params.stop_token_ids or token == eos:
                end = index + 1
                stopped_by_token = True
                break
        # Like vLLM's stop check: a stop condition on the last token wins over reaching max_tokens ("length").
        if end > params.max_tokens or (end == params.max_tokens and not stopped_by_token):
            return scripted[: params.max_tokens], "length"
        return scripted[:end], "stop"

    def _first_stop_string_end(self, token_ids: list[int], stop: tuple[str, ...]) -> int | None:
        """Length of the shortest prefix whose text contains a stop string, or None.

        Containment only grows with the prefix, so a binary search over prefix lengths needs log(n) decodes.
        """
        if not stop or not token_ids or not self._contains_stop(token_ids, stop):
            return None
        low, high = 1, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if self._contains_stop(token_ids[:middle], stop):
                high = middle
            else:
                low = middle + 1
        return low

    def _contains_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return any(s in text for s in stop)


# -------------------------------------------------------------------- module helpers


def _recorded_body(raw: bytes) -> Any:
    """A request body as :class:`RecordedRequest` keeps it: the JSON, else the text, else None when empty."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", errors="replace")


async def _json_object_body(request: web.Request) -> dict[str, Any]:
    # aiohttp caches the body the middleware read, so this reads no bytes from the socket.
    return decode_json_object(await request.read())


def _as_token_ids(encoded: Any) -> list[int]:
    """Token ids from a tokenizer result: a list, a mapping (``BatchEncoding``) with ``input_ids``, or a batch
    of one."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if len(ids) == 1 and isinstance(ids[0], list | tuple):
        ids = list(ids[0])
    return [int(token) for token in ids]
