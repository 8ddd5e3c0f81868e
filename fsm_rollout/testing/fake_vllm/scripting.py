"""What a test gives the fake vLLM server and what it gets back: scripted turns in, recorded requests out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fsm_rollout.engine.schema import Finish

SESSION_HEADER = "x-session-id"
"""Header naming the script queue a generate request draws its turn from."""


@dataclass(frozen=True, kw_only=True)
class ScriptedTurn:
    """One answer of the fake model to one generate request.

    Give the output as ``text`` (encoded with ``add_special_tokens=False``) or as exact ``token_ids``, unless
    ``raw`` is set: then ``raw`` is sent verbatim as the JSON body (for schema-violation tests). A ``status``
    other than 200 answers with a vLLM-like error body (or with ``raw``, when set).

    ``finish=None`` lets the server decide like vLLM: the output is cut at the first stop string, stop token
    or EOS (the token is kept; "stop") and capped to ``max_tokens`` ("length"). A set ``finish`` overrides the
    reason but not the cuts. ``logprobs`` default to ``-0.01 * (i + 1)`` for the i-th returned token.

    ``delay`` waits before answering and ``hang`` never answers by itself; both end early, with
    ``finish_reason="abort"`` and no tokens, when the request is named by ``/inference/v1/abort_requests``.
    ``choice_extra`` is merged into ``choices[0]`` and ``top_extra`` into the top level of the answer.
    """

    text: str | None = None
    token_ids: list[int] | None = None
    finish: Finish | None = None
    logprobs: list[float] | None = None
    delay: float = 0.0
    hang: bool = False
    raw: Any = None
    status: int = 200
    choice_extra: Mapping[str, Any] = field(default_factory=dict)
    top_extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.raw is None and self.status == 200 and (self.text is None) == (self.token_ids is None):
            raise ValueError(
                "ScriptedTurn needs exactly one of text= or token_ids= (unless raw= or status= is set)"
            )
        if self.delay < 0:
            raise ValueError(f"ScriptedTurn.delay must be >= 0, got {self.delay}")


def check_turns(turns: Sequence[ScriptedTurn]) -> None:
    """Refuse a script with anything but :class:`ScriptedTurn` objects, or with logprobs that do not fit."""
    for turn in turns:
        if not isinstance(turn, ScriptedTurn):
            raise TypeError(f"script() takes ScriptedTurn objects, got {type(turn).__name__}")
        if (
            turn.token_ids is not None
            and turn.logprobs is not None
            and len(turn.logprobs) != len(turn.token_ids)
        ):
            raise ValueError(
                f"ScriptedTurn has {len(turn.logprobs)} logprobs for {len(turn.token_ids)} token ids"
            )


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it.

    ``body`` is the parsed JSON, the raw text when the body is not JSON, or None when it is empty;
    ``at`` is ``time.monotonic()`` on arrival.
    """

    path: str
    headers: dict[str, str]
    body: Any
    at: float


def recorded_body(raw: bytes) -> Any:
    """A request body as :class:`RecordedRequest` keeps it: the JSON, else the text, else None when empty."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", errors="replace")
