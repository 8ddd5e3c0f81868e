"""How an environment driven from outside (a gateway session) says why its episode ended.

An agent behind the gateway ends its session in ways an ordinary environment does not: it closes it, it goes
idle past the session's limit, or it rewrites the history the model saw. The session's ``step`` returns one of
these observations (with ``done=True``), and the lifecycle table's guards pick the edge and its reason from it.
They are plain JSON objects so that a tape records them like any observation and a replay takes the same edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["AGENT_END_KEY", "CLOSED", "HISTORY_REWRITTEN", "IDLE", "agent_end", "agent_ended"]

AGENT_END_KEY: Final = "fsm_rollout.agent_end"
CLOSED: Final = "session_closed"
IDLE: Final = "agent_timeout"
HISTORY_REWRITTEN: Final = "history_rewritten"
_KINDS = frozenset({CLOSED, IDLE, HISTORY_REWRITTEN})


def agent_end(kind: str) -> dict[str, Any]:
    """The observation that ends the episode for ``kind`` (one of :data:`CLOSED`, :data:`IDLE`,
    :data:`HISTORY_REWRITTEN`)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown agent end {kind!r}; expected one of {sorted(_KINDS)}")
    return {AGENT_END_KEY: kind}


def agent_ended(observation: Any, kind: str) -> bool:
    """Whether ``observation`` is the end of kind ``kind``."""
    return isinstance(observation, Mapping) and observation.get(AGENT_END_KEY) == kind
