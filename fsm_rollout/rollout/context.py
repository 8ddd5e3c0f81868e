"""The rollout's context: every datum its guards and actions read, as one record whose JSON is the resume state.

The machine's model is a :class:`RolloutContext`: guards and actions (:mod:`fsm_rollout.rollout.steps`) are
functions of it, and the driver keeps nothing the table's names read anywhere else. Its fields are of two kinds.
*Live* fields (``metadata=LIVE``) hold the objects of this process: the sample itself, the dependencies, the
environment, the error. Every other field is plain data, and :meth:`RolloutContext.to_json` writes all of them:
that JSON is a handed-back sample's ``metadata["resume_state"]``, and :meth:`RolloutContext.from_json` reads it
back (also the version-1 states written before the context existed). A field added without a JSON form fails the
round-trip test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.envs.step import StepResult, Turn
from fsm_rollout.errors import ResumeError
from fsm_rollout.rollout.gating import GatePoint
from fsm_rollout.runtime.admission import AdmissionPoint
from fsm_rollout.sample import Sample
from fsm_rollout.types import GeneratedTurn, RenderedPrompt, TokenIds
from fsm_rollout.weights.partial_turn import Span, turn_from_json, turn_to_json

LIVE: Mapping[str, bool] = {"live": True}
"""Field metadata of the context's live fields (objects of this process, not part of the resume state)."""

RESUME_STATE_VERSION = 3

_ADDED_IN_3 = frozenset(
    {"branch_start", "call_max_tokens", "fork_prompt", "history", "observation_features", "observation_image_hashes"}
)
"""Fields a version-2 state (written before forks, image observations and gateway calls) lacks: they take their
defaults, which are what such a rollout had."""
"""Version 2: the context's JSON, keys named as its fields. Version 1 (before the context) is still read."""
_OPTIONAL_IN_3: frozenset[str] = frozenset({"entering", "suspend_due", "hand_back_due"})
"""Fields added after version 3 was first written: a state without them takes their defaults, which are what the
rollout that wrote it had. (A state's ``env_done``/``env_truncated``, written before the step was typed, are
ignored: a rollout is resumed in ``suspended``, where the last step is no longer read.)"""

_LEGACY_KEYS = {"reason": "suspend_reason", "status": "status_before_hand_back"}
"""Version-1 keys whose field has another name now."""


@dataclass(frozen=True)
class Deps:
    """What guards and actions read besides the context's own data; fixed for the rollout's life."""

    config: RolloutConfig
    params: dict[str, Any]
    """The inference sampling parameters (the same dict the driver exposes as ``inference_params``)."""
    encoder: Any
    tokenizer: Any
    processor: Any
    gate: GatePoint
    """The rollout's side of its weight-update gate."""
    admission: AdmissionPoint | None = None
    """The rollout's side of its server's adaptive admission (None: fixed admission, nothing to wait for)."""

    def decode(self, token_ids: TokenIds) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text


@dataclass(eq=False)
class RolloutContext:
    """One rollout's data. The machine reads and writes ``state`` here (it is the machine's model)."""

    sample: Sample = field(metadata=LIVE)
    deps: Deps = field(metadata=LIVE)
    env: Any = field(default=None, metadata=LIVE)
    step: StepResult | None = field(default=None, metadata=LIVE)
    """What the environment's last step returned (or its ``reset``, when that was a step): the guards read its
    typed fields and the generate request its ``next_call``."""
    last_turn: Turn | None = field(default=None, metadata=LIVE)
    """The last turn as an environment that accepts turns receives it (``turn``'s text, tool calls and where it
    starts); rebuilt for the next turn, not part of the resume state."""
    error: BaseException | None = field(default=None, metadata=LIVE)
    closing: Any = field(default=None, metadata=LIVE)
    """An environment's async ``close()``, awaited by the driver once the rollout has ended."""

    state: str = "pending"
    sample_id: str = ""
    request_prefix: str = ""
    reason: str | None = None
    """The terminal state's reason."""
    stop_reason: str | None = None
    """The caller's reason for an ``abort`` (``cancelled``, ``weight_update``, ...)."""
    turn_index: int = 0
    turn_requests: int = 0
    """Generate requests sent for the turn in progress (more than one after a suspension)."""
    prompt_length: int | None = None
    budget: int | None = None
    rendered: RenderedPrompt | None = None
    image_hashes: tuple[str, ...] = ()
    response_token_ids: TokenIds = field(default_factory=list)
    turn: GeneratedTurn | None = None
    """The last turn generated (merged from its parts after a suspension)."""
    turn_spans: list[Span] = field(default_factory=list)
    """The weight-version spans of the turn just generated, over its own tokens."""
    turn_text: str = ""
    eos_due: bool = False
    observation_messages: list[dict[str, Any]] = field(default_factory=list)
    observation_tokens: TokenIds = field(default_factory=list)
    observation_features: dict[str, Any] | None = None
    """An image observation's features placed in the sequence, until appending merges them into ``rendered``."""
    observation_image_hashes: tuple[str, ...] = ()
    """The content hashes of the images of the observation being encoded (for the trace)."""
    call_max_tokens: int | None = None
    """The per-call ``max_tokens`` the environment asked for the turn in progress (a gateway agent's), if any."""
    partial_turn: list[GeneratedTurn] = field(default_factory=list)
    """The answers of the turn in progress that a suspension cut off (their tokens are the partial turn)."""
    streamed: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []), metadata=LIVE)
    """The token ids and logprobs the generate request in flight has streamed so far (an agent saw them): an
    abort because the agent went away keeps them (guard ``agent_disconnected``)."""
    suspensions: int = 0
    suspend_reason: str | None = None
    suspend_cut_request: bool = False
    start_epoch: int = 0
    """The gate's weight-update count when the response started."""
    status_before_hand_back: str | None = None
    env_closed: bool = False
    env_snapshot: Any = None
    """The environment's ``snapshot()`` at hand-back, given to ``restore`` when the rollout resumes."""
    env_snapshot_error: str | None = None
    failed_state: str | None = None
    failed_trigger: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    """The conversation so far as messages (prompt, assistant turns, observations), kept under the ``fork`` and
    ``per_turn`` history policies for the engine's re-render."""
    fork_prompt: RenderedPrompt | None = None
    """The re-render the ``fork`` edge opens the next sequence with, from the observation until the edge."""
    branch_start: int = 0
    """Where the current sequence's generated tokens start in ``response_token_ids`` (after its branches')."""
    suspend_due: bool = False
    """The generate activity's outcome: the weight-update gate closed (guard ``suspension_due``)."""
    hand_back_due: bool = False
    """The resume activity's outcome: the caller takes the sample back (guard ``hand_back_due``)."""
    entering: int | None = None
    """The edge (its index in the table) whose destination's activities are being awaited (scoring), if any."""

    @property
    def remaining_budget(self) -> int | None:
        """Response-side tokens still allowed, or None when unbounded."""
        if self.budget is None:
            return None
        return self.budget - self.sample.response_length

    def to_json(self) -> dict[str, Any]:
        """Every data field as plain JSON (the resume state)."""
        out: dict[str, Any] = {"version": RESUME_STATE_VERSION}
        for item in data_fields():
            out[item.name] = _ENCODE.get(item.name, _plain)(getattr(self, item.name))
        return out

    @classmethod
    def from_json(cls, state: Any, *, sample: Sample, deps: Deps, sample_id: str) -> RolloutContext:
        """The context a resume state describes, for ``sample``; a damaged or unknown state raises
        :class:`ResumeError` naming ``sample_id``."""
        if not isinstance(state, Mapping) or state.get("version") not in (1, 2, RESUME_STATE_VERSION):
            raise ResumeError(
                f"sample {sample_id}: metadata['resume_state'] is not a resume state of version {RESUME_STATE_VERSION}"
            )
        legacy = state["version"] == 1
        values = {(_LEGACY_KEYS.get(key, key) if legacy else key): value for key, value in state.items()}
        context = cls(sample=sample, deps=deps)
        try:
            for item in data_fields():
                if item.name in values:
                    setattr(context, item.name, _DECODE.get(item.name, _plain)(values[item.name]))
                elif (
                    not legacy
                    and item.name not in _OPTIONAL_IN_3
                    and not (state["version"] == 2 and item.name in _ADDED_IN_3)
                ):
                    raise KeyError(item.name)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ResumeError(
                f"sample {sample_id}: metadata['resume_state'] is damaged: {type(error).__name__}: {error}"
            ) from error
        return context


def data_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The context's fields that make up its JSON (all but the live ones)."""
    return _DATA_FIELDS


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rendered_to_json(rendered: RenderedPrompt | None) -> Any:
    if rendered is None:
        return None
    return {"token_ids": list(rendered.token_ids), "generate_body": rendered.generate_body}


def _rendered_from_json(data: Any) -> RenderedPrompt | None:
    if data is None:
        return None
    return RenderedPrompt(token_ids=[int(t) for t in data["token_ids"]], generate_body=dict(data["generate_body"]))


def _ints(value: Any) -> list[int]:
    return [int(item) for item in value]


_ENCODE: dict[str, Any] = {
    "rendered": _rendered_to_json,
    "turn": lambda turn: None if turn is None else turn_to_json(turn),
    "partial_turn": lambda parts: [turn_to_json(part) for part in parts],
    "turn_spans": lambda spans: [[version, start, end] for version, start, end in spans],
    "observation_messages": lambda messages: [dict(message) for message in messages],
    "history": lambda messages: [dict(message) for message in messages],
    "fork_prompt": _rendered_to_json,
}
_DECODE: dict[str, Any] = {
    "rendered": _rendered_from_json,
    "turn": lambda data: None if data is None else turn_from_json(data),
    "partial_turn": lambda parts: [turn_from_json(part) for part in parts],
    "turn_spans": lambda spans: [(str(version), int(start), int(end)) for version, start, end in spans],
    "image_hashes": lambda hashes: tuple(str(item) for item in hashes),
    "observation_image_hashes": lambda hashes: tuple(str(item) for item in hashes),
    "response_token_ids": _ints,
    "observation_tokens": _ints,
    "observation_messages": lambda messages: [dict(message) for message in messages],
    "history": lambda messages: [dict(message) for message in messages],
    "fork_prompt": _rendered_from_json,
    "branch_start": int,
    "turn_index": int,
    "turn_requests": int,
    "suspensions": int,
    "start_epoch": int,
    "prompt_length": _optional_int,
    "budget": _optional_int,
    "call_max_tokens": _optional_int,
    "entering": _optional_int,
    "eos_due": bool,
    "env_closed": bool,
    "suspend_cut_request": bool,
    "suspend_due": bool,
    "hand_back_due": bool,
    "state": str,
    "sample_id": str,
    "request_prefix": str,
}
_DATA_FIELDS = tuple(item for item in dataclasses.fields(RolloutContext) if not item.metadata.get("live"))


__all__ = ["LIVE", "RESUME_STATE_VERSION", "Deps", "RolloutContext", "data_fields"]
