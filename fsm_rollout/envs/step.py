"""The typed channel between a rollout and its environment: what ``step`` is given and what it returns.

``env.step`` returns a :class:`StepResult`: the observation, whether the episode is done, and typed fields for
what used to ride in ``info`` or in the observation itself: the ``reward``, a ``truncated`` episode (cut short, as
by a time limit), an :class:`EndReason` for an environment driven from outside (a gateway agent that closed its
session or went idle), and a :class:`NextCall` for what the next generate request must carry (an agent's sampling
settings, a rewritten history). The lifecycle table's guards read these fields; nothing is decoded from the
observation. The old 3-tuple ``(observation, done, info)`` is still accepted: :func:`as_step_result` is the one
place that reads it (``info["reward"]`` and ``info["truncated"]`` become the typed fields).

An environment whose class sets ``accepts_turn = True`` gets a :class:`Turn` in ``step`` (the turn's text, tokens,
logprobs, finish and tool calls) instead of the decoded text alone. ``reset`` may return a :class:`StepResult`
whose ``next_call`` the first generate request carries (other return values of ``reset`` are ignored, as before).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_rollout.errors import EnvironmentContractError
from fsm_rollout.tokens.tool_calls import ToolCall

__all__ = ["EndReason", "NextCall", "Rewrite", "StepResult", "Turn", "accepts_turn", "as_step_result"]


class EndReason(enum.StrEnum):
    """Why an environment driven from outside ended the episode (the reason of the terminal edge)."""

    SESSION_CLOSED = "session_closed"
    """The agent closed its session (the sample ends ``completed``)."""
    AGENT_TIMEOUT = "agent_timeout"
    """The agent was idle past its session's limit (the sample ends ``truncated``, its data kept)."""


@dataclass(frozen=True)
class Rewrite:
    """An agent's call that rewrote the history the model saw: the whole conversation it sent, its tools (None:
    none) and where it first differs (``detail``, kept on the closed branch as ``history_rewritten``, or as
    ``compacted`` when ``compacted``: the agent replaced earlier turns by a summary, and the fork's reason says so)."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    detail: str = ""
    compacted: bool = False


@dataclass(frozen=True)
class NextCall:
    """What the next generate request must carry: the sampling settings an agent's call asked for (``temperature``,
    ``top_p``, ``seed``, ``stop``, ``max_tokens``, ``top_logprobs``, ``frequency_penalty``, ``presence_penalty``,
    ``logit_bias``, and vLLM's ``structured_outputs``) and, for a call that rewrote the history, the
    :class:`Rewrite` the rollout renders and forks on."""

    sampling: Mapping[str, Any] = field(default_factory=dict)
    rewrite: Rewrite | None = None
    token_sink: Callable[[list[int], list[float]], None] | None = field(default=None, compare=False, repr=False)
    """Called with the turn's tokens (and their logprobs) as the engine streams them; the turn itself is the same
    with or without it. Never recorded: a replay sends the call without streaming."""


@dataclass(frozen=True)
class StepResult:
    """One environment step. ``end`` implies ``done``; ``truncated`` with ``done`` ends the sample ``truncated``
    (reason ``env_truncated``) instead of ``completed``; a ``reward`` that is not None becomes ``sample.reward``."""

    observation: Any
    done: bool = False
    reward: Any = None
    truncated: bool = False
    end: EndReason | None = None
    next_call: NextCall | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.truncated, bool):
            raise EnvironmentContractError(
                f"a step's truncated must be a bool, got {type(self.truncated).__name__} {self.truncated!r}"
            )
        if self.end is not None and not self.done:
            raise EnvironmentContractError(f"a step that ends the episode ({self.end}) must be done")

    def to_json(self, encode: Callable[[Any], Any] = lambda value: value) -> dict[str, Any]:
        """The step as plain JSON (``encode`` turns its free values, observation, reward and info, into JSON)."""
        call = self.next_call
        return {
            "observation": encode(self.observation),
            "done": self.done,
            "reward": encode(self.reward),
            "truncated": self.truncated,
            "end": None if self.end is None else self.end.value,
            "next_call": None if call is None else _call_to_json(call),
            "info": encode(dict(self.info)),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], decode: Callable[[Any], Any] = lambda value: value) -> StepResult:
        """The step :meth:`to_json` wrote (``decode`` revives its free values)."""
        call = data.get("next_call")
        info = decode(data.get("info"))
        return cls(
            decode(data.get("observation")),
            done=bool(data.get("done")),
            reward=decode(data.get("reward")),
            truncated=bool(data.get("truncated")),
            end=None if data.get("end") is None else EndReason(data["end"]),
            next_call=None if call is None else _call_from_json(call),
            info=info if isinstance(info, Mapping) else {},
        )


def _call_to_json(call: NextCall) -> dict[str, Any]:
    rewrite = call.rewrite
    return {
        "sampling": dict(call.sampling),
        "rewrite": None
        if rewrite is None
        else {
            "messages": [dict(message) for message in rewrite.messages],
            "tools": None if rewrite.tools is None else [dict(tool) for tool in rewrite.tools],
            "detail": rewrite.detail,
            # written only when set: the tapes of sessions without compactions read as before
            **({"compacted": True} if rewrite.compacted else {}),
        },
    }


def _call_from_json(data: Mapping[str, Any]) -> NextCall:
    rewrite = data.get("rewrite")
    return NextCall(
        sampling=dict(data.get("sampling") or {}),
        rewrite=None
        if rewrite is None
        else Rewrite(
            messages=tuple(dict(message) for message in rewrite["messages"]),
            tools=None if rewrite.get("tools") is None else tuple(dict(tool) for tool in rewrite["tools"]),
            detail=str(rewrite.get("detail") or ""),
            compacted=bool(rewrite.get("compacted")),
        ),
    )


@dataclass(frozen=True)
class Turn:
    """One generated turn, as an environment that sets ``accepts_turn = True`` receives it in ``step``.

    ``text`` is what ``step(text)`` would have been given (the decode of ``token_ids``, special tokens kept);
    ``finish_reason`` is the engine's (``stop``, ``length``, ``abort``); ``tool_calls`` are the calls read from the
    text; ``top_logprobs`` are each token's top candidates when the request asked for them, else None;
    ``prompt_tokens`` is how many tokens the request that generated it carried (where the turn starts in the
    sample's tokens).
    """

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_tokens: int = 0


def accepts_turn(env: Any) -> bool:
    """Whether ``env`` declared (``accepts_turn = True``) that its ``step`` takes a :class:`Turn`."""
    return getattr(env, "accepts_turn", False) is True


def as_step_result(result: Any) -> StepResult:
    """``env.step``'s result as a :class:`StepResult`: one as it is, or the old 3-tuple ``(observation, done,
    info)``, whose ``info["reward"]`` and ``info["truncated"]`` (a bool) become the typed fields. Anything else
    raises :class:`~fsm_rollout.errors.EnvironmentContractError`."""
    if isinstance(result, StepResult):
        return result
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvironmentContractError(
            "env.step must return a StepResult or a 3-tuple (observation, done, info), got "
            + type(result).__name__
            + (f" of length {len(result)}" if isinstance(result, tuple) else "")
        )
    observation, done, info = result
    done = bool(done)
    if not isinstance(info, Mapping):
        return StepResult(observation, done=done)
    truncated = info.get("truncated", False)
    if not isinstance(truncated, bool):
        raise EnvironmentContractError(
            f"env.step's info['truncated'] must be a bool, got {type(truncated).__name__} {truncated!r}"
        )
    return StepResult(observation, done=done, reward=info.get("reward"), truncated=truncated, info=info)
