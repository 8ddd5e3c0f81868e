"""Raw HTTP to the embedded engine, for the tests that check its wire answers (shared by the engine's test files)."""

from __future__ import annotations

from typing import Any

import aiohttp

from fsm_rollout.engine.local import LocalEngine

GENERATE = "/inference/v1/generate"


async def post(
    http: aiohttp.ClientSession, engine: LocalEngine, path: str, body: Any = None, **query: str
) -> tuple[int, Any]:
    """POST ``body`` (``{}`` when None) with ``query`` parameters; the status and the decoded answer (or None)."""
    async with http.post(engine.url + path, json=body if body is not None else {}, params=query) as response:
        raw = await response.read()
        return response.status, (await response.json(content_type=None)) if raw else None


async def generate(
    http: aiohttp.ClientSession, engine: LocalEngine, token_ids: list[int], request_id: str = "req", **sampling: Any
) -> dict[str, Any]:
    """``choices[0]`` of a generate request that must succeed (logprobs on, EOS ignored unless ``sampling`` says)."""
    params = {"temperature": 1.0, "logprobs": 1, "ignore_eos": True, **sampling}
    status, body = await post(
        http, engine, GENERATE, {"token_ids": token_ids, "sampling_params": params, "request_id": request_id}
    )
    assert status == 200, body
    choice: dict[str, Any] = body["choices"][0]
    return choice


def logprob_values(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of a choice."""
    return [entry["logprob"] for entry in choice["logprobs"]["content"]]
