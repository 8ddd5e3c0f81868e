"""Asking an engine, before any rollout, whether it answers and what it serves: ``GET /health`` and ``GET /v1/models``.

A command probes once at start-up so that an engine that is down, or refuses the API key, is one clear error
instead of every sample failing; the served models fill in what the user did not say (model name, tokenizer,
image merge size). Nothing here is retried: the probe reports the engine as it is now.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from fsm_rollout.engine.schema import HEALTH_PATH, MODELS_PATH, error_message, parse_model_list
from fsm_rollout.errors import EngineConnectionError, EngineHTTPError, EngineTimeoutError
from fsm_rollout.types import ServedModel

_NOT_SERVED = frozenset({404, 405})
"""Statuses of a server without ``/v1/models`` (some routers): the models are then unknown, not an error."""


async def probe_engine(
    base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0
) -> list[ServedModel] | None:
    """Check ``GET /health``, then list ``GET /v1/models``; None when the server has no models endpoint.

    Raises :class:`EngineConnectionError` when nothing answers, :class:`EngineTimeoutError` when no answer comes in
    ``timeout_s``, :class:`EngineHTTPError` for an error status (401 when the API key is missing or refused), and
    :class:`~fsm_rollout.errors.ModelListError` for a model list of the wrong shape. ``api_key`` is sent as
    ``Authorization: Bearer …`` and appears in no message.
    """
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False, headers=headers) as session:
        await _get(session, base + HEALTH_PATH)
        answer = await _get(session, base + MODELS_PATH, absent=_NOT_SERVED)
    return None if answer is None else parse_model_list(answer)


async def _get(session: aiohttp.ClientSession, url: str, *, absent: frozenset[int] = frozenset()) -> Any:
    """The decoded JSON answer (its text when not JSON; ``""`` when empty), or None for a status in ``absent``."""
    try:
        async with session.get(url) as response:
            raw = await response.read()
            status = response.status
    except TimeoutError as error:
        raise EngineTimeoutError(f"GET {url} timed out: {error or 'no answer in time'}") from error
    except aiohttp.ClientError as error:
        raise EngineConnectionError(f"GET {url} failed: {type(error).__name__}: {error}") from error
    if status in absent:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        body = orjson.loads(raw) if raw else text
    except orjson.JSONDecodeError:
        body = text
    if status >= 400:
        message = error_message(body) if isinstance(body, dict) else text[:500] or "(no body)"
        raise EngineHTTPError(f"GET {url} answered HTTP {status}: {message}", status=status, url=url, body=text)
    return body


__all__ = ["probe_engine"]
