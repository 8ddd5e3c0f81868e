"""A suspended rollout as plain JSON (``sample.metadata["resume_state"]``), and the rollout rebuilt from it.

The state is the machine context a rollout needs to go on from ``suspended``: the turn, the budget, the rendered
prompt's generate body, the response tokens so far, the partial turn (the answers a suspension cut off), and the
environment. Within one process the environment object itself is kept aside and handed to the rollout that
resumes (so a live environment is resumed as it is); in another process the environment is rebuilt by the factory
and given its ``snapshot()`` through ``restore(state)``. No pickle: everything is JSON.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fsm_rollout.errors import ResumeError
from fsm_rollout.partial_turn import turn_from_json, turn_to_json
from fsm_rollout.sample import Status
from fsm_rollout.types import RenderedPrompt

if TYPE_CHECKING:
    from fsm_rollout.rollout import Rollout

RESUME_STATE_KEY = "resume_state"
RESUME_STATE_VERSION = 1

_LIVE_ENVIRONMENTS: dict[str, Any] = {}
"""Environments of suspended samples handed back in this process, by resume token, until the sample resumes (or
:func:`discard_suspended` closes them)."""


def capture_resume_state(rollout: Rollout) -> dict[str, Any]:
    """The suspended rollout's resume state; its environment is kept aside for a resume in this process."""
    if rollout.state != "suspended" or rollout.rendered is None:
        raise ResumeError(f"sample {rollout.sample_id}: only a suspended rollout has a resume state "
                          f"(it is {rollout.state})")
    token = uuid.uuid4().hex
    env = rollout.env
    snapshot = None
    snapshot_error = None
    take_snapshot = getattr(env, "snapshot", None)
    if callable(take_snapshot):
        try:
            snapshot = take_snapshot()
        except Exception as error:  # only a resume in another process needs it: say why it cannot happen there
            snapshot_error = f"{type(error).__name__}: {error}"
    else:
        snapshot_error = f"{type(env).__name__} has no snapshot()"
    if env is not None:
        _LIVE_ENVIRONMENTS[token] = env
    status = rollout.status_before_hand_back
    return {
        "version": RESUME_STATE_VERSION,
        "token": token,
        "state": rollout.state,
        "reason": rollout.suspend_reason,
        "sample_id": rollout.sample_id,
        "request_prefix": rollout.request_prefix,
        "status": None if status is None else status.value,
        "turn_index": rollout.turn_index,
        "turn_requests": rollout.turn_requests,
        "suspensions": rollout.suspensions,
        "prompt_length": rollout.prompt_length,
        "budget": rollout.budget,
        "rendered": {"token_ids": list(rollout.rendered.token_ids), "generate_body": rollout.rendered.generate_body},
        "image_hashes": list(rollout.image_hashes),
        "response_token_ids": list(rollout.response_token_ids),
        "partial_turn": [turn_to_json(part) for part in rollout.partial_parts],
        "env_snapshot": snapshot,
        "env_snapshot_error": snapshot_error,
    }


def restore_resume_state(rollout: Rollout, state: Any) -> None:
    """Put a freshly built rollout where the resume state says its sample stopped (``suspended``)."""
    sample_id = rollout.sample_id
    if not isinstance(state, dict) or state.get("version") != RESUME_STATE_VERSION:
        raise ResumeError(f"sample {sample_id}: metadata['resume_state'] is not a resume state of version "
                          f"{RESUME_STATE_VERSION}")
    token = str(state.get("token"))
    if token not in _LIVE_ENVIRONMENTS:  # not suspended in this process: the environment comes from its snapshot
        if state.get("env_snapshot") is None:
            why = state.get("env_snapshot_error") or "no environment snapshot was taken"
            raise ResumeError(f"sample {sample_id}: cannot resume outside the process that suspended it: {why}; "
                              "the environment must implement snapshot() -> dict and restore(state)")
        rollout.env_snapshot = state["env_snapshot"]
    try:
        rendered = state["rendered"]
        rollout.rendered = RenderedPrompt(token_ids=[int(t) for t in rendered["token_ids"]],
                                          generate_body=dict(rendered["generate_body"]))
        rollout.state = "suspended"
        rollout.sample_id = str(state["sample_id"])
        rollout.request_prefix = str(state["request_prefix"])
        rollout.turn_index = int(state["turn_index"])
        rollout.turn_requests = int(state["turn_requests"])
        rollout.suspensions = int(state["suspensions"])
        rollout.suspend_reason = state.get("reason")
        rollout.prompt_length = None if state["prompt_length"] is None else int(state["prompt_length"])
        rollout.budget = None if state["budget"] is None else int(state["budget"])
        rollout.image_hashes = tuple(str(h) for h in state["image_hashes"])
        rollout.response_token_ids = [int(t) for t in state["response_token_ids"]]
        rollout.partial_parts = [turn_from_json(part) for part in state["partial_turn"]]
        status = state.get("status")
    except (KeyError, TypeError, ValueError) as error:
        raise ResumeError(f"sample {sample_id}: metadata['resume_state'] is damaged: {type(error).__name__}: "
                          f"{error}") from error
    rollout.sample.status = Status(status) if status is not None else Status.PENDING
    rollout.sample.metadata.pop("rollout_reason", None)
    rollout.env = _LIVE_ENVIRONMENTS.pop(token, None)


def discard_suspended(sample: Any) -> None:
    """Forget a handed-back sample that will not be resumed: its environment (kept for a resume in this process)
    is closed and its resume state removed."""
    metadata = getattr(sample, "metadata", None)
    state = metadata.pop(RESUME_STATE_KEY, None) if isinstance(metadata, dict) else None
    env = _LIVE_ENVIRONMENTS.pop(str(state.get("token")), None) if isinstance(state, dict) else None
    close = getattr(env, "close", None)
    if callable(close):
        close()


__all__ = ["RESUME_STATE_KEY", "capture_resume_state", "discard_suspended", "restore_resume_state"]
