"""What an environment driven from outside (a gateway session) says through its observations.

An agent behind the gateway ends its session in ways an ordinary environment does not: it closes it, it goes
idle past the session's limit, or it rewrites the history the model saw. The session's ``step`` returns one of
these observations (with ``done=True``), and the lifecycle table's guards pick the edge and its reason from it.

An agent's call also carries its own sampling settings (``temperature``, ``max_tokens``, ...) for the turn it asks
for. The session's observation is then :func:`agent_call` (the new messages and those settings), and the first
call's settings are in the sample's ``metadata["agent_call"]``; the generate request reads them with
:func:`call_sampling`. All of these are plain JSON, so a tape records them like any observation and a replay sends
the same requests and takes the same edges.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "AGENT_CALL_KEY",
    "AGENT_END_KEY",
    "CLOSED",
    "HISTORY_REWRITTEN",
    "IDLE",
    "agent_call",
    "agent_end",
    "agent_ended",
    "call_sampling",
]

AGENT_END_KEY: Final = "fsm_rollout.agent_end"
AGENT_CALL_KEY: Final = "agent_call"
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


def agent_call(messages: list[dict[str, Any]], sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The observation of an agent's call: its new messages and its sampling settings for the next turn."""
    return {AGENT_CALL_KEY: {"messages": messages, "sampling": dict(sampling)}}


def call_sampling(observation: Any, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling settings the turn about to be generated was asked with: the last observation's when it is an
    agent's call, else (the first turn) the sample's ``metadata["agent_call"]``; empty for any other rollout."""
    source = observation.get(AGENT_CALL_KEY) if isinstance(observation, Mapping) else None
    if source is None and observation is None and isinstance(metadata, Mapping):
        source = metadata.get(AGENT_CALL_KEY)
    sampling = source.get("sampling") if isinstance(source, Mapping) else None
    return dict(sampling) if isinstance(sampling, Mapping) else {}
