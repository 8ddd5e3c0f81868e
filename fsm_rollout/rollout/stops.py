"""The client's stop-string rule: where a turn continued after a suspension ends.

A turn cut by a suspension and continued is several answers; the engine looked for stop strings in each answer's
own text only, so the client looks again over the joined tokens. This is the one place the rollout does that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsm_rollout.engine.stop_strings import first_stop_string
from fsm_rollout.types import TokenIds


def stop_string_end(token_ids: TokenIds, params: Mapping[str, Any], decode: Callable[[TokenIds], str]) -> int | None:
    """The length of the shortest prefix of ``token_ids`` at which vLLM would have stopped on one of
    ``params["stop"]`` (None: it would not have), by the rule every server here uses, ``min_tokens`` floor included.
    """
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else [item for item in stop or () if isinstance(item, str)]
    min_tokens = params.get("min_tokens")
    floor = min_tokens if isinstance(min_tokens, int) and min_tokens > 0 else 0
    matched = first_stop_string(token_ids, stops, lambda ids: decode(list(ids)), min_tokens=floor)
    return None if matched is None else matched.end


__all__ = ["stop_string_end"]
