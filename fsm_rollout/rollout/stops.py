"""The client's stop-string rule: where a turn continued after a suspension ends.

A turn cut by a suspension and continued is several answers; the engine looked for stop strings in each answer's
own text only, so the client looks again over the joined tokens. This is the one place the rollout does that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsm_rollout.types import TokenIds


def stop_string_end(token_ids: TokenIds, params: Mapping[str, Any], decode: Callable[[TokenIds], str]) -> int | None:
    """The length of the shortest prefix of ``token_ids`` whose text holds one of ``params["stop"]`` (None: none
    does).

    As vLLM, a stop string only counts once it ends past the text of the first ``params["min_tokens"]`` tokens.
    """
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else [item for item in stop or () if isinstance(item, str) and item]
    if not stops or not token_ids:
        return None
    min_tokens = params.get("min_tokens")
    floor = len(decode(token_ids[:min_tokens])) if isinstance(min_tokens, int) and min_tokens > 0 else 0

    def holds_stop(length: int) -> bool:
        text = decode(token_ids[:length])
        return any(text.find(item, max(0, floor + 1 - len(item))) != -1 for item in stops)

    if not holds_stop(len(token_ids)):
        return None
    low, high = 1, len(token_ids)  # holding a stop string only grows with the prefix: binary search
    while low < high:
        middle = (low + high) // 2
        if holds_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low


__all__ = ["stop_string_end"]
