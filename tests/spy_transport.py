"""A transport that passes every request through to the engine's own and keeps each generate exchange, so a test can
check what the engine was sent and what it answered (the gateway, thinking-model and harness tests)."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsm_rollout.engine.transport import Transport


@dataclass(frozen=True)
class Generate:
    """One generate request as sent (a deep copy: the sample's token list it was built from grows afterwards), the
    engine's answer, the request's headers and the seconds the answer took."""

    payload: dict[str, Any]
    answer: Any
    headers: dict[str, str]
    seconds: float


class GenerateSpy:
    """Wraps ``inner`` (set it as an engine client's ``transport``); :attr:`seen` lists the generate exchanges."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.seen: list[Generate] = []

    @property
    def base_url(self) -> str:
        return self.inner.base_url

    async def close(self) -> None:
        await self.inner.close()

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        started = time.perf_counter()
        answer = await self.inner.post_json(path, payload, headers=headers)
        if path.endswith("/generate"):
            self.seen.append(
                Generate(copy.deepcopy(dict(payload)), answer, dict(headers or {}), time.perf_counter() - started)
            )
        return answer
