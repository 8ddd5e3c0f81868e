"""How the engine client's JSON requests reach a server: the transport interface and its aiohttp implementation.

:class:`~fsm_rollout.engine.client.VLLMClient` speaks vLLM's endpoints over a :class:`Transport`, in the spirit of
httpx's ``transport=``: :class:`AiohttpTransport` for real servers, a recording transport that keeps every exchange
(:mod:`fsm_rollout.recording`), and a tape transport that answers from a recording (:mod:`fsm_rollout.replay`).
A transport posts one JSON body to a path and returns the decoded JSON answer (or the answer's text when it is not
JSON); errors are :class:`~fsm_rollout.errors.EngineError` subclasses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, runtime_checkable

import aiohttp
import orjson

from fsm_rollout.config import RetryPolicy
from fsm_rollout.engine.schema import error_message
from fsm_rollout.engine.schema.large_answers import loads_answer
from fsm_rollout.engine.token_stream import StreamRefused
from fsm_rollout.errors import EngineConnectionError, EngineHTTPError, EngineTimeoutError

_JSON_HEADERS = {"Content-Type": "application/json"}


@runtime_checkable
class Transport(Protocol):
    """Posts JSON to an engine. Implementations must be safe to share among all rollouts of one event loop."""

    @property
    def base_url(self) -> str:
        """The server (or router) the requests go to, for error messages and metadata."""
        ...

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        """POST ``payload`` as JSON to ``path``; the decoded JSON answer, or its text when it is not JSON."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (a no-op for transports that hold nothing)."""
        ...


class AiohttpTransport:
    """JSON over HTTP with one pooled ``aiohttp`` session and a retry policy for what is safe to retry.

    The session is created on first use inside the running event loop and closed by :meth:`close`. Retried:
    connection errors and the policy's statuses (render and generate have no side effects); never a timeout, since
    the server may still be working on the request. ``api_key`` is sent as ``Authorization: Bearer …`` on every
    request and appears in no error message.
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
        api_key: str | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session = session
        self._owns_session = session is None
        self._headers = dict(_JSON_HEADERS)
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    @property
    def base_url(self) -> str:
        return self._base_url

    streams = True
    """Generate requests can stream through this transport (:meth:`post_sse`)."""

    def session(self) -> aiohttp.ClientSession:
        """The pooled session (created on first use, inside the running event loop)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, trust_env=False, json_serialize=_dumps
            )
            self._owns_session = True
        return self._session

    async def close(self) -> None:
        """Close the pooled session if this transport created it."""
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        """POST ``payload`` as JSON and return the decoded JSON answer, retrying what is safe to retry.

        Raises :class:`EngineHTTPError` with the server's message for a non-retryable status (or a retryable one
        that persists), :class:`EngineConnectionError` when the server stays unreachable, and
        :class:`EngineTimeoutError` on timeout.
        """
        url = self._base_url + path
        data = orjson.dumps(payload)
        send_headers = {**self._headers, **headers} if headers else self._headers
        session = self.session()
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
                    try:  # image features make render answers megabytes of base64: see loads_answer
                        return loads_answer(raw)
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

    async def post_sse(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[Any]:
        """POST ``payload`` and yield each Server-Sent Event's ``data`` as it arrives (decoded JSON, or the text when
        it is not JSON, e.g. ``[DONE]``). Not retried: a stream may have delivered tokens already. Leaving the
        iteration early closes the connection, which a vLLM server reads as the client going away."""
        url = self._base_url + path
        send_headers = {**self._headers, **headers} if headers else self._headers
        try:
            async with self.session().post(url, data=orjson.dumps(payload), headers=send_headers) as response:
                if response.status >= 400:
                    raw = await response.read()
                    try:
                        message = error_message(orjson.loads(raw))
                    except orjson.JSONDecodeError:
                        message = raw.decode("utf-8", errors="replace")[:500]
                    raise EngineHTTPError(
                        f"POST {url} answered HTTP {response.status}: {message}",
                        status=response.status,
                        url=url,
                        body=raw.decode("utf-8", errors="replace"),
                    )
                if response.content_type == "application/json":  # the whole answer: a server that does not stream
                    raw = await response.read()
                    try:
                        answer: Any = loads_answer(raw)
                    except orjson.JSONDecodeError:
                        answer = raw.decode("utf-8", errors="replace")
                    raise StreamRefused(answer)
                async for data in _sse_data(response.content):
                    try:
                        yield orjson.loads(data)
                    except orjson.JSONDecodeError:
                        yield data.decode("utf-8", errors="replace")
        except TimeoutError as error:
            raise EngineTimeoutError(f"POST {url} timed out: {error or 'no answer in time'}") from error
        except aiohttp.ClientConnectionError as error:
            raise EngineConnectionError(f"POST {url} failed: {type(error).__name__}: {error}") from error


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Each ``data:`` line's payload, from the bytes as they arrive: every line already received is split at once
    (reading line by line costs a stream read per line, two per event, which dominates a token-per-chunk stream)."""
    partial: list[bytes] = []  # a line's start, when it spans reads (kept as parts: joined once, when it ends)
    async for chunk in content.iter_any():
        if b"\n" not in chunk:
            partial.append(chunk)
            continue
        if partial:
            chunk = b"".join([*partial, chunk])
            partial = []
        lines = chunk.split(b"\n")
        tail = lines.pop()
        if tail:
            partial.append(tail)
        for line in lines:
            if line.startswith(b"data:"):  # not blank separators, comments
                yield line[5:].strip()
    last = b"".join(partial)
    if last.startswith(b"data:"):  # a last line without its newline
        yield last[5:].strip()


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


__all__ = ["AiohttpTransport", "Transport"]
