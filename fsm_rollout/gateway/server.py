"""The agent gateway's HTTP surface and :class:`AgentGateway`, an async context manager over a runner.

Paths (the agent is given ``base_url`` = ``<gateway>/sessions/<id>/v1`` and uses it as an OpenAI base URL):

* ``POST /sessions`` (control), optional ``{"metadata": {...}, "label": ...}`` → 201 ``{"session_id", "base_url"}``
* ``POST /sessions/{id}/v1/chat/completions`` (agent): OpenAI Chat Completions, streamed or not. A retry of the
  call in flight or of the last one (the same body, or the same ``Idempotency-Key`` header) gets that call's answer:
  a client's retry after a timeout or a disconnect generates nothing twice
* ``POST /sessions/{id}/v1/responses`` (agent): OpenAI Responses, streamed or not
  (:mod:`fsm_rollout.gateway.responses_wire`); ``store`` keeps a session's responses for ``previous_response_id``
* ``GET /sessions/{id}/v1/models`` (agent)
* ``POST /sessions/{id}/v1/messages`` and ``.../v1/messages/count_tokens`` (agent): the Anthropic Messages API
  (:mod:`fsm_rollout.gateway.messages_wire`) on the same session, for clients given ``<gateway>/sessions/<id>``
  as their Anthropic base URL; its errors are in Anthropic's shape, and its key may come as ``x-api-key``
* ``GET /sessions`` (control): the open sessions (each as ``GET /sessions/{id}`` answers, with ``created`` and
  ``base_url``), so a trainer can close and reward them after a harness exits
* with ``auto_sessions``, ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/messages`` (and its
  ``count_tokens``) and ``GET /v1/models`` at the root (agent): the first request with a client session key
  (:mod:`fsm_rollout.gateway.hints`: ``x-session-id``, or a harness's own header) opens a session, later ones with
  that key use it
* ``POST /sessions/{id}/reward`` (control) ``{"reward": float}``
* ``POST /sessions/{id}/close`` (control), optional ``{"reward": ...}`` → ``{"samples": [Sample.to_dict(), ...]}``
* ``GET /sessions/{id}`` (control): the machine's state, turns and status

With ``api_key`` the control endpoints need ``Authorization: Bearer <api_key>``; with ``agent_api_key`` the agent
endpoints need that key. Session ids are 256 random bits: a session's data is reachable only through its id.
Every error is OpenAI's body ``{"error": {"message", "type", "code"}}``, except on the Messages paths, whose errors
are Anthropic's.

Why this module is long: it is the gateway's whole HTTP surface, one short handler per route for three agent dialects
and the control API, sharing the authorization, body reading and session resolution; the dialects' own work lives
in their wire modules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, cast

import orjson
import structlog
from aiohttp import web

from fsm_rollout.envs.protocol import EnvFactory
from fsm_rollout.errors import ConfigError, EngineError, EngineHTTPError
from fsm_rollout.gateway.answers import TokenText
from fsm_rollout.gateway.chat_answers import ChatChunks, ChatEvents, chat_completion
from fsm_rollout.gateway.hints import header_hints
from fsm_rollout.gateway.live_stream import stream_answer
from fsm_rollout.gateway.messages_stream import MessageEvents
from fsm_rollout.gateway.messages_wire import (
    is_messages_path,
    message_object,
    messages_error_body,
    new_message_id,
    parse_messages_request,
)
from fsm_rollout.gateway.openai_wire import (
    ChatCall,
    GatewayError,
    TurnAnswer,
    error_body,
    parse_chat_request,
    public_error,
    render_message,
)
from fsm_rollout.gateway.responses_stream import ResponseEvents
from fsm_rollout.gateway.responses_wire import StoredResponses, parse_responses_request, response_object
from fsm_rollout.gateway.session import GatewaySession, SessionEnvironment
from fsm_rollout.gateway.stream_text import AnswerStream
from fsm_rollout.runtime.engine_check import served_context_len
from fsm_rollout.runtime.pacing import LoopPacer, pacer_for
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.sample import Sample

__all__ = ["AgentGateway"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# structlog's processors (the host's, if configured) on this module's stdlib logger: nothing printed unless asked
_log = structlog.wrap_logger(logging.getLogger(__name__))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status=status, content_type="application/json"
    )


class AgentGateway:
    """Serves OpenAI-compatible sessions over ``runner``'s engines (see the module docstring).

    ``async with AgentGateway(runner) as gateway:`` enters the runner (its engines, tokenizer, trace and tape) and
    starts the HTTP server on ``host:port`` (port 0: a free one; :attr:`url` says which). The gateway's sessions
    are the runner's environment, so the runner must not have an ``env_factory`` of its own; its config is used
    with ``router_policy="consistent_hash"`` (every request carries ``x-session-id``) and without an environment
    step limit (an agent's pause between calls is bounded by ``session_idle_timeout_s`` instead). Under the
    config's ``loop_slice_ms`` the HTTP handlers share the rollouts' pacer (:mod:`fsm_rollout.runtime.pacing`): a burst
    of agents' calls starts a few per loop iteration, so the loop stays responsive. ``max_call_tokens`` bounds every
    call's answer (the client's ``max_tokens`` / ``max_output_tokens`` or, when it sets none, the cap itself), apart
    from the session's whole budget (the runner's ``max_new_tokens``).
    """

    def __init__(
        self,
        runner: RolloutRunner,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        agent_api_key: str | None = None,
        session_idle_timeout_s: float | None = 3600.0,
        closed_session_ttl_s: float = 600.0,
        disconnect_grace_s: float = 30.0,
        auto_sessions: bool = False,
        max_call_tokens: int | None = None,
    ) -> None:
        if runner.env_factory is not None:
            raise ConfigError(
                "the gateway's sessions are the runner's environment: build the runner without env_factory"
            )
        if session_idle_timeout_s is not None and session_idle_timeout_s <= 0:
            raise ConfigError(f"session_idle_timeout_s must be positive, got {session_idle_timeout_s!r}")
        if disconnect_grace_s < 0:
            raise ConfigError(f"disconnect_grace_s must be >= 0, got {disconnect_grace_s!r}")
        if closed_session_ttl_s < 0:
            raise ConfigError(f"closed_session_ttl_s must be >= 0, got {closed_session_ttl_s!r}")
        if max_call_tokens is not None and (isinstance(max_call_tokens, bool) or max_call_tokens < 1):
            raise ConfigError(f"max_call_tokens must be at least 1, got {max_call_tokens!r}")
        self.runner = runner
        self.host = host
        self.port = port
        self.api_key = api_key
        self.agent_api_key = agent_api_key
        self.session_idle_timeout_s = session_idle_timeout_s
        self.closed_session_ttl_s = closed_session_ttl_s
        self.disconnect_grace_s = disconnect_grace_s
        self.auto_sessions = auto_sessions
        self.max_call_tokens = max_call_tokens
        self._auto: dict[str, str] = {}  # a client's session key -> the session it opened (auto_sessions)
        self._created: dict[str, float] = {}  # open sessions' wall-clock opening times, for GET /sessions
        # each session's stored responses (store: true), gone with the session
        self._stored: weakref.WeakKeyDictionary[GatewaySession, StoredResponses] = weakref.WeakKeyDictionary()
        self._sessions: dict[str, GatewaySession] = {}
        # closed sessions kept for a repeated close (a lost close response must not lose the samples), each with
        # the loop time it is forgotten at; insertion order is expiry order, the TTL being one for all
        self._closed: dict[str, tuple[float, GatewaySession]] = {}
        self._opened = 0
        self._site_runner: web.AppRunner | None = None
        self._pacer: LoopPacer | None = None
        self._text: TokenText | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AgentGateway:
        runner = self.runner
        runner.config = dataclasses.replace(runner.config, router_policy="consistent_hash", env_step_timeout_s=None)
        runner.env_factory = cast(EnvFactory, self._build_env)  # its step is a coroutine: the rollout awaits it
        await runner.__aenter__()
        if runner.config.rollout_max_context_len is None:
            # as `fsm-rollout gateway` does: an agent's max_tokens (Claude Code asks for 128000 each call) is cut to
            # what the engine's context leaves, rather than refused by the engine call after call
            served = served_context_len(runner.served_models, runner.config.model)
            if served is not None:
                runner.config = dataclasses.replace(runner.config, rollout_max_context_len=served)
        slice_ms = runner.config.loop_slice_ms
        self._pacer = pacer_for(asyncio.get_running_loop(), slice_ms) if slice_ms is not None else None
        try:
            app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
            app.router.add_post("/sessions", self._open)
            app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
            app.router.add_get("/sessions/{sid}/v1/models", self._models)
            app.router.add_post("/sessions/{sid}/v1/messages", self._messages)
            app.router.add_post("/sessions/{sid}/v1/messages/count_tokens", self._count_tokens)
            app.router.add_post("/sessions/{sid}/v1/responses", self._responses)
            app.router.add_get("/sessions", self._list)
            if self.auto_sessions:  # the same handlers: a path without {sid} resolves the session by the client's key
                app.router.add_post("/v1/chat/completions", self._chat)
                app.router.add_post("/v1/responses", self._responses)
                app.router.add_post("/v1/messages", self._messages)
                app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
                app.router.add_get("/v1/models", self._models)
            app.router.add_post("/sessions/{sid}/reward", self._reward)
            app.router.add_post("/sessions/{sid}/close", self._close)
            app.router.add_get("/sessions/{sid}", self._status)
            # an agent that disconnects cancels its handler; its answer waits for the client's retry (the session's
            # disconnect grace), then the session's rollout and its engine request are aborted
            site_runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await site_runner.setup()
            site = web.TCPSite(site_runner, self.host, self.port)
            await site.start()
            self._site_runner = site_runner
            addresses = site_runner.addresses
            if addresses:
                self.port = int(addresses[0][1])
        except BaseException:
            await runner.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            for session in list(self._sessions.values()):
                await session.abort("shutdown")
            if self._site_runner is not None:
                await self._site_runner.cleanup()
                self._site_runner = None
        finally:
            await self.runner.__aexit__(exc_type, exc, tb)

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ the Python API

    async def open_session(self, *, metadata: dict[str, Any] | None = None, label: Any = None) -> GatewaySession:
        """A new session; give the agent its ``base_url``. ``await session.close(reward=...)`` ends it."""
        if metadata is not None and not isinstance(metadata, dict):
            raise GatewayError(400, "'metadata' must be an object", code="metadata")
        session_id = secrets.token_urlsafe(32)
        session = GatewaySession(
            self.runner,
            session_id,
            f"{self.url}/sessions/{session_id}/v1",
            index=self._opened,
            metadata=metadata,
            label=label,
            idle_timeout_s=self.session_idle_timeout_s,
            disconnect_grace_s=self.disconnect_grace_s,
            on_closed=self._forget,
            token_text=self._token_text(),
            max_call_tokens=self.max_call_tokens,
        )
        self._opened += 1
        self._sessions[session_id] = session
        self._created[session_id] = time.time()
        self.runner.counters.session_opened()
        return session

    def _answer_stream(self, call: ChatCall) -> AnswerStream:
        stop = self.runner.sampling_params.get("stop") or ()
        stops = [*(call.sampling.get("stop") or ()), *([stop] if isinstance(stop, str) else stop)]
        return AnswerStream(self._token_text(), parse_calls=call.tool_choice != "none", stops=stops)

    def _token_text(self) -> TokenText:
        if self._text is None:
            self._text = TokenText(self.runner.tokenizer, self.runner.sampling_params)
        return self._text

    def session(self, session_id: str) -> GatewaySession:
        """The session ``session_id``, open or closed less than ``closed_session_ttl_s`` ago (a closed one answers
        a repeated close with the same samples and a call with 409); a 404 :class:`GatewayError` otherwise."""
        session = self._sessions.get(session_id)
        if session is None:
            self._drop_expired()
            kept = self._closed.get(session_id)
            if kept is None:
                raise GatewayError(404, "no such session (unknown, or closed long ago)", code="session_not_found")
            session = kept[1]
        return session

    @property
    def sessions(self) -> int:
        """Sessions open now."""
        return len(self._sessions)

    def _forget(self, session: GatewaySession) -> None:
        self._created.pop(session.session_id, None)
        key = session.metadata.get("session_key")
        if isinstance(key, str) and self._auto.get(key) == session.session_id:
            del self._auto[key]
        if self._sessions.pop(session.session_id, None) is not None:
            self.runner.counters.session_closed()
            self._drop_expired()
            if self.closed_session_ttl_s > 0:
                deadline = asyncio.get_running_loop().time() + self.closed_session_ttl_s
                self._closed[session.session_id] = (deadline, session)

    def _drop_expired(self) -> None:
        """Forget the closed sessions whose TTL has passed (the oldest first: they expire in insertion order)."""
        if not self._closed:
            return
        now = asyncio.get_running_loop().time()
        while self._closed:
            session_id, (deadline, _) = next(iter(self._closed.items()))
            if deadline > now:
                break
            del self._closed[session_id]

    def _build_env(self, *, sample: Sample, args: Any = None) -> SessionEnvironment:
        session = self._sessions.get(sample.session_id or "")
        if session is None:
            raise ConfigError(f"no gateway session {sample.session_id!r} for this sample")
        return session.environment(sample)

    # ------------------------------------------------------------------ HTTP

    @web.middleware
    async def _errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            if self._pacer is not None:  # a burst of calls is admitted a few per loop iteration, as rollouts are
                waiter = self._pacer.admit()
                if waiter is not None:
                    await waiter
            return await handler(request)
        except GatewayError as error:
            public = public_error(error)
            if public is not error:  # what the agent is not shown goes to the trace
                _log.warning(
                    "gateway_error", path=request.path, status=error.status, code=error.code, detail=error.message
                )
            if is_messages_path(request.path):
                return _json(messages_error_body(public.status, public.message), public.status)
            return _json(public.body(), public.status)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            kind = "not_found" if error.status == 404 else "invalid_request"
            if is_messages_path(request.path):
                return _json(messages_error_body(error.status, error.reason or "request refused"), error.status)
            return _json(
                error_body(error.reason or "request refused", type="invalid_request_error", code=kind), error.status
            )

    def _authorize(self, request: web.Request, key: str | None, *, x_api_key: bool = False) -> None:
        """The key as ``Authorization: Bearer``, or (Anthropic's clients) as ``x-api-key`` when ``x_api_key``."""
        if key is None:
            return
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        if x_api_key and not given:
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise GatewayError(401, "missing or wrong API key", code="invalid_api_key", type="authentication_error")

    async def _body(self, request: web.Request, *, optional: bool) -> Any:
        raw = await request.read()
        if not raw:
            if optional:
                return {}
            raise GatewayError(400, "the request needs a JSON body", code="invalid_json")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as error:
            raise GatewayError(400, f"the body is not valid JSON ({error})", code="invalid_json") from error
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
        return body

    async def _open(self, request: web.Request) -> web.Response:
        self._authorize(request, self.api_key)
        body = await self._body(request, optional=True)
        session = await self.open_session(metadata=body.get("metadata"), label=body.get("label"))
        return _json({"session_id": session.session_id, "base_url": session.base_url}, 201)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request, self.agent_api_key)
        self._known_session(request)  # an unknown session is a 404 before the body is read
        call = parse_chat_request(await self._body(request, optional=False))
        call = dataclasses.replace(call, hints=header_hints(request.headers))
        session = await self._agent_session(request, call.hints)
        model = self.runner.config.model
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        decode = self.runner.tokenizer.decode
        key = request.headers.get("Idempotency-Key")
        if call.stream:  # sent as the engine generates it (:mod:`fsm_rollout.gateway.live_stream`)
            chunks = ChatChunks(
                completion_id=completion_id,
                model=model,
                include_usage=call.include_usage,
                want_logprobs=call.logprobs,
                decode=decode,
            )
            return await stream_answer(
                request,
                lambda listener: session.chat(call, idempotency_key=key, listener=listener),
                self._answer_stream(call),
                ChatEvents(chunks),
            )
        answer = await session.chat(call, idempotency_key=key)
        return _json(
            chat_completion(
                answer, completion_id=completion_id, model=model, want_logprobs=call.logprobs, decode=decode
            )
        )

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request, self.agent_api_key, x_api_key=True)
        self._known_session(request)
        read = parse_messages_request(await self._body(request, optional=False), request.headers)
        call = dataclasses.replace(read.call, hints={**read.call.hints, **header_hints(request.headers)})
        session = await self._agent_session(request, call.hints)
        if read.dropped_tools:  # Anthropic's typed tools the prompt leaves out, named where the trainer reads
            listed = session.metadata.setdefault("dropped_tools", [])
            listed.extend(name for name in read.dropped_tools if name not in listed)
        key = request.headers.get("Idempotency-Key")
        message_id, model = new_message_id(), self.runner.config.model
        if call.stream:  # sent as the engine generates it (:mod:`fsm_rollout.gateway.live_stream`)
            return await stream_answer(
                request,
                lambda listener: session.chat(call, idempotency_key=key, listener=listener),
                self._answer_stream(call),
                MessageEvents(message_id=message_id, model=model, stop_sequences=read.stop_sequences),
            )
        answer = await session.chat(call, idempotency_key=key)
        return _json(message_object(answer, message_id=message_id, model=model, stop_sequences=read.stop_sequences))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """``{"input_tokens"}``: the engine's render of the request as a session's first call (or a fork) sends it."""
        self._authorize(request, self.agent_api_key, x_api_key=True)
        self._known_session(request)
        call = parse_messages_request(await self._body(request, optional=True), count_only=True).call
        session = await self._agent_session(request, header_hints(request.headers))
        config = self.runner.config
        payload: dict[str, Any] = {"model": config.model, "messages": [render_message(m) for m in call.messages]}
        if call.tools:
            payload["tools"] = [dict(tool) for tool in call.tools]
        if config.apply_chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(config.apply_chat_template_kwargs)
        try:
            rendered = await self.runner.render(payload, session_id=session.session_id)
        except EngineHTTPError as error:
            if error.status >= 500:
                raise GatewayError(502, f"the engine failed to render: {error}", code="render_failed") from error
            detail = error.body.strip().splitlines()[0] if error.body.strip() else str(error.status)
            raise GatewayError(400, f"the engine refused to render the request: {detail}", code="render") from error
        except EngineError as error:
            raise GatewayError(502, f"the engine failed to render: {error}", code="render_failed") from error
        return _json({"input_tokens": len(rendered.token_ids)})

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request, self.agent_api_key)
        self._known_session(request)
        model = self.runner.config.model
        # how a streamed answer goes out: as the engine generates it, or whole when an engine cannot stream
        metadata = {"streaming": "tokens" if self.runner.streams_tokens else "whole_answer"}
        card = {"id": model, "object": "model", "created": 0, "owned_by": "fsm-rollout", "metadata": metadata}
        return _json({"object": "list", "data": [card]})

    async def _reward(self, request: web.Request) -> web.Response:
        self._authorize(request, self.api_key)
        session = self.session(request.match_info["sid"])
        body = await self._body(request, optional=False)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise GatewayError(400, "'reward' must be a number", code="reward")
        session.set_reward(float(reward))
        return _json({"session_id": session.session_id, "reward": session.reward})

    async def _close(self, request: web.Request) -> web.Response:
        self._authorize(request, self.api_key)
        session = self.session(request.match_info["sid"])
        body = await self._body(request, optional=True)
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise GatewayError(400, "'reward' must be a number", code="reward")
        samples = await asyncio.shield(session.close(reward=reward))
        return _json({"samples": [sample.to_dict() for sample in samples]})

    async def _status(self, request: web.Request) -> web.Response:
        self._authorize(request, self.api_key)
        return _json(self.session(request.match_info["sid"]).status())

    async def _list(self, request: web.Request) -> web.Response:
        self._authorize(request, self.api_key)
        listed = [
            {**session.status(), "created": self._created.get(sid), "base_url": session.base_url}
            for sid, session in self._sessions.items()
        ]
        return _json({"sessions": listed})

    def _known_session(self, request: web.Request) -> None:
        """A path naming a session must name a known one (404); a root path's session is resolved by the call."""
        if "sid" in request.match_info:
            self.session(request.match_info["sid"])

    async def _agent_session(self, request: web.Request, hints: Mapping[str, Any]) -> GatewaySession:
        """The session an agent's call is for: the path's, or (a root path, ``auto_sessions``) the one keyed by the
        client's ``session_key`` hint, opened on first sight."""
        sid = request.match_info.get("sid")
        if sid is not None:
            return self.session(sid)
        key = hints.get("session_key")
        if not isinstance(key, str) or not key:
            raise GatewayError(
                400,
                "a call on a root path needs a session key: send the 'x-session-id' header (Codex sends its own in "
                "'x-codex-turn-metadata', Claude Code in 'X-Claude-Code-Session-Id'), or use the base URL "
                "<gateway>/sessions/<id>/v1 of a session opened with "
                "POST /sessions",
                code="session_key_missing",
            )
        session = self._sessions.get(self._auto.get(key, ""))
        if session is None:
            session = await self.open_session(metadata={"session_key": key})
            self._auto[key] = session.session_id
        return session

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request, self.agent_api_key)
        self._known_session(request)
        parsed = parse_responses_request(await self._body(request, optional=False))
        hints = header_hints(request.headers)
        session = await self._agent_session(request, hints)
        stored = self._stored.setdefault(session, StoredResponses())
        prior = stored.conversation(parsed.previous_response_id)
        call = parsed.chat_call(prior, hints)
        if parsed.dropped_tools:  # listed in the session's metadata (the samples' "gateway_session")
            dropped = session.metadata.setdefault("dropped_tools", [])
            dropped.extend(tool for tool in parsed.dropped_tools if tool not in dropped)
        key = request.headers.get("Idempotency-Key")
        response_id = f"resp_{secrets.token_hex(16)}"

        def store(answer: TurnAnswer) -> None:
            if parsed.store:
                stored.put(response_id, parsed.conversation(prior, answer))

        if parsed.stream:  # sent as the engine generates it (:mod:`fsm_rollout.gateway.live_stream`)
            return await stream_answer(
                request,
                lambda listener: session.chat(call, idempotency_key=key, listener=listener),
                self._answer_stream(call),
                ResponseEvents(parsed, response_id=response_id, model=self.runner.config.model),
                on_answer=store,
            )
        answer = await session.chat(call, idempotency_key=key)
        store(answer)
        return _json(response_object(answer, parsed, response_id=response_id, model=self.runner.config.model))
