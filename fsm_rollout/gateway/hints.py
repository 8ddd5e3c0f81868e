"""What a client's headers say about a call beyond its messages: the hints of :attr:`ChatCall.hints`.

Keys (each present only when the client said it):

* ``session_key``: the client's own session id (``x-session-id``, any dialect; Codex's ``session_id`` in
  ``x-codex-turn-metadata``; Claude Code's ``X-Claude-Code-Session-Id``). Auto sessions are keyed by it;
* ``lineage_key``: the chain within the session (Codex's ``thread_id``);
* ``parent_lineage_key``: the chain that spawned this one (Codex's ``parent_thread_id`` or
  ``x-codex-parent-thread-id``);
* ``agent``: the agent's name (Codex's ``agent_name``, else ``x-openai-subagent``);
* ``request_kind``: what the call is for (Codex's ``request_kind``);
* ``window``: the context window (``x-codex-window-id``, else the metadata's ``window_id`` or ``context_window_id``).

Harness headers are read leniently: a missing, malformed or oddly typed value is left out, never an error, since a
harness's metadata is its own and changes between versions. Hints never reach the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["header_hints"]

_CODEX_METADATA = "x-codex-turn-metadata"
_MAX_HEADER = 16 * 1024  # a header longer than this is not a harness's metadata: ignored rather than parsed


def _text(value: Any) -> str | None:
    """A hint value: a non-empty string (a number is taken as its text), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _codex_metadata(raw: str | None) -> Mapping[str, Any]:
    if not raw or len(raw) > _MAX_HEADER:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, Mapping) else {}


def header_hints(headers: Mapping[str, str]) -> dict[str, Any]:
    """The hints of a call's headers (``headers`` as aiohttp gives them: looked up case-insensitively)."""
    hints: dict[str, Any] = {}
    codex = _codex_metadata(headers.get(_CODEX_METADATA))

    def put(key: str, *values: Any) -> None:
        for value in values:
            text = _text(value)
            if text is not None:
                hints[key] = text
                return

    # an explicit x-session-id is the operator's grouping: it wins over a harness's own id
    put("session_key", headers.get("x-session-id"), codex.get("session_id"), headers.get("x-claude-code-session-id"))
    put("lineage_key", codex.get("thread_id"))
    put("parent_lineage_key", codex.get("parent_thread_id"), headers.get("x-codex-parent-thread-id"))
    put("agent", codex.get("agent_name"), headers.get("x-openai-subagent"))
    put("request_kind", codex.get("request_kind"))
    put("window", headers.get("x-codex-window-id"), codex.get("window_id"), codex.get("context_window_id"))
    return hints
