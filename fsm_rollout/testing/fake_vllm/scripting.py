"""What a test gives the fake vLLM server and what it gets back: scripted turns in, recorded requests out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fsm_rollout.engine.schema import Finish

SESSION_HEADER = "x-session-id"
"""Header naming the script queue a generate request draws its turn from."""


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT: Any = _Omit()
"""A ``choice_extra`` or ``top_extra`` value that removes its key from the answer instead of setting it."""


@dataclass(frozen=True, kw_only=True)
class ScriptedTurn:
    """One answer of the fake model to one generate request.

    Give the output as ``text`` (encoded with ``add_special_tokens=False``) or as exact ``token_ids``, unless
    ``raw`` is set: then ``raw`` is sent verbatim as the JSON body (for schema-violation tests). A ``status``
    other than 200 answers with a vLLM-like error body (or with ``raw``, when set).

    ``finish=None`` lets the server decide like vLLM: the output is cut at the first stop string, stop token
    or EOS (the token is kept; "stop"; none counts within the request's ``min_tokens``) and capped to
    ``max_tokens`` ("length"), by :func:`fsm_rollout.engine.stop_strings.cut_at_stop`. A set ``finish`` overrides the
    reason but not the cuts. ``logprobs`` default to ``-0.01 * (i + 1)`` for the i-th returned token.

    ``delay`` waits before answering and ``hang`` never answers by itself; both end early, with
    ``finish_reason="abort"``, when the request is aborted (``/inference/v1/abort_requests`` or
    ``/pause?mode=abort``). Such an answer has no tokens, unless ``held_after`` says how many tokens of the
    (cut) output the engine had produced when the request began to wait: then it has those first tokens and
    their logprobs, and the turn can be continued. A later generate request of the same session (its
    ``x-session-id``, or none) whose ``token_ids`` are the aborted request's prompt plus those tokens gets the
    rest of the turn instead of the next scripted one, as greedy sampling would: the whole turn is cut (a stop
    string across the interruption ends it where it would have) with the continuation's ``max_tokens`` counted
    from its own first token, and the logprobs go on where the partial answer's ended. ``held_again_after``
    holds the continuations too: the i-th continuation of the turn waits like the turn (``hang`` or ``delay``)
    after producing ``held_again_after[i]`` more tokens, so one turn can be interrupted several times;
    continuations past its end answer without waiting.

    ``choice_extra`` is merged into ``choices[0]`` and ``top_extra`` into the top level of the answer; a value
    of :data:`OMIT` removes the key (e.g. ``choice_extra={"weight_versions": OMIT}``).
    """

    text: str | None = None
    token_ids: list[int] | None = None
    finish: Finish | None = None
    logprobs: list[float] | None = None
    delay: float = 0.0
    hang: bool = False
    raw: Any = None
    status: int = 200
    held_after: int | None = None
    held_again_after: tuple[int, ...] = ()
    choice_extra: Mapping[str, Any] = field(default_factory=dict)
    top_extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.raw is None and self.status == 200 and (self.text is None) == (self.token_ids is None):
            raise ValueError("ScriptedTurn needs exactly one of text= or token_ids= (unless raw= or status= is set)")
        if self.delay < 0:
            raise ValueError(f"ScriptedTurn.delay must be >= 0, got {self.delay}")


def check_turns(turns: Sequence[ScriptedTurn]) -> None:
    """Refuse a script with anything but :class:`ScriptedTurn` objects, with logprobs that do not fit, or with
    holds that cannot happen."""
    for turn in turns:
        if not isinstance(turn, ScriptedTurn):
            raise TypeError(f"script() takes ScriptedTurn objects, got {type(turn).__name__}")
        _check_holds(turn)
        if turn.token_ids is not None and turn.logprobs is not None and len(turn.logprobs) != len(turn.token_ids):
            raise ValueError(f"ScriptedTurn has {len(turn.logprobs)} logprobs for {len(turn.token_ids)} token ids")


def _check_holds(turn: ScriptedTurn) -> None:
    if turn.held_after is not None:
        if not _is_count(turn.held_after):
            raise ValueError(f"ScriptedTurn.held_after must be a non-negative int, got {turn.held_after!r}")
        if not turn.hang and turn.delay <= 0:
            raise ValueError("ScriptedTurn.held_after needs hang=True or delay > 0: only a waiting request is held")
        if turn.raw is not None or turn.status != 200:
            raise ValueError("ScriptedTurn.held_after needs a turn with output, not raw= or an error status")
    if not isinstance(turn.held_again_after, tuple) or not all(map(_is_count, turn.held_again_after)):
        raise ValueError(
            f"ScriptedTurn.held_again_after must be a tuple of non-negative ints, got {turn.held_again_after!r}"
        )
    if turn.held_again_after and turn.held_after is None:
        raise ValueError("ScriptedTurn.held_again_after needs held_after: only an interrupted turn is continued")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


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
