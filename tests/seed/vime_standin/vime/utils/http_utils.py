"""Stand-in for ``vime.utils.http_utils.post`` (seed contract section 10), over aiohttp.

Deliberate deviation to keep tests fast: vime makes up to ``max_retries`` (60) attempts one second apart; this
stand-in makes at most ``MAX_ATTEMPTS`` attempts ``RETRY_SLEEP_S`` apart. Like vime it retries every failure
(connection errors, timeouts and any HTTP 4xx/5xx status) and re-raises the last one. vime's shared, pre-initialised
``httpx`` client is replaced by one short-lived aiohttp session per call (no proxies from the environment).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

MAX_ATTEMPTS = 3
RETRY_SLEEP_S = 0.01


async def _post_once(url: str, payload: Any, headers: dict[str, str] | None, total_s: float | None) -> Any:
    client_timeout = aiohttp.ClientTimeout(total=total_s)
    async with (
        aiohttp.ClientSession(timeout=client_timeout, trust_env=False) as session,
        session.post(url, json=payload, headers=headers) as response,
    ):
        response.raise_for_status()
        text = await response.text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # vime hands non-JSON bodies back as text


async def post(
    url: str,
    payload: Any,
    max_retries: int = 60,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 -- vime's signature
) -> Any:
    """POST ``payload`` as JSON and return the decoded answer, retrying any failure a few times."""
    attempts = max(1, min(max_retries, MAX_ATTEMPTS))
    last_error: Exception | None = None
    for attempt in range(attempts):
        try:
            return await _post_once(url, payload, headers, timeout)
        except Exception as error:
            last_error = error
            if attempt + 1 < attempts:
                await asyncio.sleep(RETRY_SLEEP_S)
    assert last_error is not None
    raise last_error
