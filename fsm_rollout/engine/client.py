"""The vLLM engine client: render, generate and abort, parsed strictly, over a pluggable transport."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp

from fsm_rollout.config import RetryPolicy, RolloutConfig
from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    PAUSE_MODES,
    PAUSE_PATH,
    RENDER_PATH,
    RESUME_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
    parse_generate_response,
    parse_render_response,
)
from fsm_rollout.engine.schema import server_request_ids as server_request_ids  # re-exported: callers import it here
from fsm_rollout.engine.token_stream import StreamAssembly, StreamRefused, TokenSink
from fsm_rollout.engine.transport import AiohttpTransport, Transport
from fsm_rollout.errors import ConfigError, EngineHTTPError, GenerationError, RenderError
from fsm_rollout.types import GeneratedTurn, RenderedPrompt

_log = logging.getLogger(__name__)


def refuses_stream_field(error: EngineHTTPError) -> bool:
    """Whether an HTTP error refuses a streamed generate's ``stream``/``stream_options`` fields (an older vLLM: 400
    or 422 naming the field, unknown or not supported)."""
    return error.status in (400, 422) and "stream" in error.body


_HTTP_DEFAULTS: dict[str, Any] = {
    "connect_timeout_s": 10.0,
    "request_timeout_s": 600.0,
    "retry": None,
    "max_connections": 0,
    "session": None,
    "api_key": None,
}


class VLLMClient:
    """Client of one vLLM server (or router) speaking the token-in/token-out endpoints over a transport.

    By default the transport is an :class:`~fsm_rollout.engine.transport.AiohttpTransport` for ``base_url`` (one
    pooled session, created on first use inside the running event loop and closed by :meth:`close` or ``async
    with``); pass ``transport=`` to send through anything else that implements
    :class:`~fsm_rollout.engine.transport.Transport` (recording, replay, tests). Share one client among all samples
    of a process.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        transport: Transport | None = None,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 600.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 0,
        session: aiohttp.ClientSession | None = None,
        api_key: str | None = None,
    ) -> None:
        options: dict[str, Any] = {
            "connect_timeout_s": connect_timeout_s,
            "request_timeout_s": request_timeout_s,
            "retry": retry,
            "max_connections": max_connections,
            "session": session,
            "api_key": api_key,
        }
        if transport is None:
            if base_url is None:
                raise TypeError("VLLMClient needs a base_url or a transport")
            transport = AiohttpTransport(base_url, **options)
        else:  # HTTP options beside a transport would be silently ignored (a key, a retry policy): refuse them
            given = sorted(name for name, value in options.items() if value != _HTTP_DEFAULTS[name])
            if given:
                raise TypeError(
                    f"VLLMClient(transport=...) takes no HTTP options ({', '.join(given)}): give them to the transport"
                )
        self.transport: Transport = transport
        self.stream_refused = False
        """The server met a streamed generate as one that cannot stream: answers come whole from then on."""

    @classmethod
    def from_config(cls, config: RolloutConfig, *, base_url: str | None = None) -> VLLMClient:
        """A client for ``base_url`` (default ``config.engine_url``) with the config's timeouts, retry policy and
        API key."""
        return cls(
            base_url or config.engine_url,
            connect_timeout_s=config.connect_timeout_s,
            request_timeout_s=config.request_timeout_s,
            retry=config.retry,
            api_key=config.api_key,
        )

    @property
    def base_url(self) -> str:
        """Where the transport sends requests."""
        return self.transport.base_url

    async def close(self) -> None:
        """Close the transport (its pooled session, if it created one)."""
        await self.transport.close()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        """POST ``payload`` as JSON through the transport (see :meth:`Transport.post_json`)."""
        return await self.transport.post_json(path, payload, headers=headers)

    async def render(self, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> RenderedPrompt:
        """Render a chat request into prompt token ids (``POST /v1/chat/completions/render``)."""
        answer = await self.transport.post_json(RENDER_PATH, payload, headers=headers)
        if isinstance(answer, str):
            raise RenderError(f"chat/render: answer is not JSON: {answer[:200]!r}")
        return parse_render_response(answer, str(payload.get("model", "")))

    async def generate(
        self,
        body: Mapping[str, Any],
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        top_logprobs: bool = False,
        sink: TokenSink | None = None,
    ) -> GeneratedTurn:
        """Generate one turn from token ids (``POST /inference/v1/generate``) and parse it strictly; with
        ``top_logprobs`` (the body asks for top candidates), each token's candidates too.

        With a ``sink``, and a transport that can stream (:attr:`streams`), the request is sent with ``"stream":
        true`` and each chunk's new tokens go to ``sink`` as they arrive (:mod:`fsm_rollout.engine.token_stream`);
        the turn returned is the one the whole answer would have been. Without, nothing changes."""
        answer: Any = None
        if sink is not None and self.streams:
            try:
                return parse_generate_response(
                    await self._streamed(body, headers, sink), request_id, top_logprobs=top_logprobs
                )
            except StreamRefused as refused:  # answered whole: the turn is the same, nothing is sent again
                self._whole_answers_from_now("answered a streamed generate with a plain JSON body")
                answer = refused.answer
            except EngineHTTPError as error:
                if not refuses_stream_field(error):
                    raise
                self._whole_answers_from_now(f"refused the stream field (HTTP {error.status})")
        if answer is None:
            answer = await self.transport.post_json(GENERATE_PATH, body, headers=headers)
        if isinstance(answer, str):
            raise GenerationError(f"vLLM generate answer is not JSON: {answer[:200]!r}")
        return parse_generate_response(answer, request_id, top_logprobs=top_logprobs)

    @property
    def streams(self) -> bool:
        """Whether generate requests can stream through this client's transport (one that says ``streams`` and has
        ``post_sse``: the aiohttp transport, and a recording one over it); else answers come whole."""
        transport = self.transport
        if self.stream_refused:
            return False
        return bool(getattr(transport, "streams", False)) and callable(getattr(transport, "post_sse", None))

    def _whole_answers_from_now(self, what: str) -> None:
        """The server cannot stream a generate (an older vLLM): its answers come whole from now on (one warning)."""
        if not self.stream_refused:
            _log.warning(
                "vLLM generate at %s %s: answers from this engine come whole from now on (no streaming)",
                getattr(self.transport, "base_url", "?"),
                what,
            )
        self.stream_refused = True

    async def _streamed(self, body: Mapping[str, Any], headers: Mapping[str, str] | None, sink: TokenSink) -> Any:
        assembly = StreamAssembly(sink)
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        stream = self.transport.post_sse(GENERATE_PATH, payload, headers=headers)  # type: ignore[attr-defined]
        async with contextlib.aclosing(stream):  # closed at once, not when collected: its connection goes back
            async for data in stream:
                assembly.feed(data)
                if assembly.done:
                    break
        return assembly.answer()

    async def abort(self, request_ids: Sequence[str], *, headers: Mapping[str, str] | None = None) -> None:
        """Ask the server to abort requests by id (``POST /inference/v1/abort_requests``).

        Each id is sent as given and as vLLM's internal id for token-in/token-out requests
        (``generate-tokens-<id>``, what vLLM 0.32 registers); the endpoint ignores ids it does not know.
        """
        ids = [alias for request_id in request_ids for alias in server_request_ids(request_id)]
        await self.transport.post_json(ABORT_PATH, {"request_ids": ids}, headers=headers)

    async def pause(self, mode: str = "keep") -> None:
        """Pause the engine's generation (``POST /pause?mode=...``): ``abort`` ends the requests in flight (they answer
        ``abort`` with their tokens so far), ``wait`` lets them finish, ``keep`` freezes them until :meth:`resume`.
        New requests wait at the engine until then. vLLM serves this with ``VLLM_SERVER_DEV_MODE=1``."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        await self.transport.post_json(f"{PAUSE_PATH}?mode={mode}", {})

    async def resume(self) -> None:
        """Resume the engine's generation after :meth:`pause` (``POST /resume``)."""
        await self.transport.post_json(RESUME_PATH, {})

    async def update_weight_version(self, version: str) -> None:
        """Set the weight version the engine labels the tokens it samples from now on (``POST
        /update_weight_version``); answers then carry it in ``choices[0].weight_versions``."""
        if not isinstance(version, str) or not version:
            raise ConfigError(f"a weight version is a non-empty string; got {version!r}")
        await self.transport.post_json(UPDATE_WEIGHT_VERSION_PATH, {"new_version": version})
