"""The vLLM HTTP client: render, generate and abort over one pooled aiohttp session, with a safe retry policy."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from fsm_rollout.config import RetryPolicy, RolloutConfig
from fsm_rollout.engine.schema import (
    ABORT_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    error_message,
    parse_generate_response,
    parse_render_response,
)
from fsm_rollout.engine.schema import server_request_ids as server_request_ids  # re-exported: callers import it here
from fsm_rollout.errors import (
    EngineConnectionError,
    EngineHTTPError,
    EngineTimeoutError,
    GenerationError,
    RenderError,
)
from fsm_rollout.types import GeneratedTurn, RenderedPrompt

_JSON_HEADERS = {"Content-Type": "application/json"}


class VLLMClient:
    """Client of one vLLM server (or router) speaking the token-in/token-out endpoints.

    One client holds one pooled ``aiohttp`` session, created on first use inside the running event loop and
    closed by :meth:`close` (or ``async with``). Share one client among all samples of a process.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 600.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session = session
        self._owns_session = session is None

    @classmethod
    def from_config(cls, config: RolloutConfig) -> VLLMClient:
        """A client for ``config.engine_url`` with the config's timeouts and retry policy."""
        return cls(
            config.engine_url,
            connect_timeout_s=config.connect_timeout_s,
            request_timeout_s=config.request_timeout_s,
            retry=config.retry,
        )

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, trust_env=False, json_serialize=_dumps
            )
            self._owns_session = True
        return self._session

    async def close(self) -> None:
        """Close the pooled session if this client created it."""
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        """POST ``payload`` as JSON and return the decoded JSON answer, retrying what is safe to retry.

        Raises :class:`EngineHTTPError` with the server's message for a non-retryable status (or a retryable one
        that persists), :class:`EngineConnectionError` when the server stays unreachable, and
        :class:`EngineTimeoutError` on timeout (not retried: the server may still be working on the request).
        """
        url = self.base_url + path
        data = orjson.dumps(payload)
        send_headers = {**_JSON_HEADERS, **headers} if headers else _JSON_HEADERS
        session = self._get_session()
        attempt = 1
        while True:
            try:
                async with session.post(url, data=data, headers=send_headers) as response:
                    raw = await response.read()
                    status = response.status
            except TimeoutError as error:
                raise EngineTimeoutError(f"POST {url} timed out: {error or 'no answer in time'}") from error
            except aiohttp.ClientConnectionError as error:
                if attempt >= self.retry.max_attempts:
                    raise EngineConnectionError(
                        f"POST {url} failed after {attempt} attempt(s): {type(error).__name__}: {error}"
                    ) from error
            else:
                if status < 400:
                    try:
                        return orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        return raw.decode("utf-8", errors="replace")
                if status not in self.retry.retry_statuses or attempt >= self.retry.max_attempts:
                    text = raw.decode("utf-8", errors="replace")
                    try:
                        message = error_message(orjson.loads(raw))
                    except orjson.JSONDecodeError:
                        message = text[:500]
                    raise EngineHTTPError(
                        f"POST {url} answered HTTP {status} (attempt {attempt}): {message}",
                        status=status,
                        url=url,
                        body=text,
                    )
            await asyncio.sleep(self.retry.delay(attempt))
            attempt += 1

    async def render(
        self, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> RenderedPrompt:
        """Render a chat request into prompt token ids (``POST /v1/chat/completions/render``)."""
        answer = await self.post_json(RENDER_PATH, payload, headers=headers)
        if isinstance(answer, str):
            raise RenderError(f"chat/render: answer is not JSON: {answer[:200]!r}")
        return parse_render_response(answer, str(payload.get("model", "")))

    async def generate(
        self, body: Mapping[str, Any], *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> GeneratedTurn:
        """Generate one turn from token ids (``POST /inference/v1/generate``) and parse it strictly."""
        answer = await self.post_json(GENERATE_PATH, body, headers=headers)
        if isinstance(answer, str):
            raise GenerationError(f"vLLM generate answer is not JSON: {answer[:200]!r}")
        return parse_generate_response(answer, request_id)

    async def abort(self, request_ids: Sequence[str], *, headers: Mapping[str, str] | None = None) -> None:
        """Ask the server to abort requests by id (``POST /inference/v1/abort_requests``).

        Each id is sent as given and as vLLM's internal id for token-in/token-out requests
        (``generate-tokens-<id>``, what vLLM 0.32 registers); the endpoint ignores ids it does not know.
        """
        ids = [alias for request_id in request_ids for alias in server_request_ids(request_id)]
        await self.post_json(ABORT_PATH, {"request_ids": ids}, headers=headers)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()
