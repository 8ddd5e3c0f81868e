"""Building a rollout: what a sample must be to start, how it is named, and its context restored from a resume state."""

from __future__ import annotations

import uuid
from typing import Any

from fsm_rollout.errors import ResumeError, SampleStateError
from fsm_rollout.rollout.context import Deps, RolloutContext
from fsm_rollout.sample import Sample, Status
from fsm_rollout.tokens.chat import ObservationEncoder
from fsm_rollout.weights.resume_state import RESUME_STATE_KEY

_ENCODERS: dict[int, ObservationEncoder] = {}


def observation_encoder_for(tokenizer: Any) -> ObservationEncoder:
    """The process-wide observation encoder of a tokenizer (its dummy prefixes are cached there)."""
    encoder = _ENCODERS.get(id(tokenizer))
    if encoder is None or encoder.tokenizer is not tokenizer:
        encoder = ObservationEncoder(tokenizer)
        _ENCODERS[id(tokenizer)] = encoder
    return encoder


def default_sample_id(sample: Sample) -> str:
    """How a rollout names its sample unless told otherwise: the sample's index, else a random id."""
    return str(sample.index) if sample.index is not None else uuid.uuid4().hex[:12]


def default_request_prefix(sample: Sample) -> str:
    """The prefix of a rollout's generate request ids unless told otherwise: the session id, else a random one."""
    return sample.session_id or f"fsm-{uuid.uuid4().hex}"


def check_startable(sample: Sample) -> None:
    """A rollout starts only from a pending sample without response data (the seed's preconditions), or from a
    sample handed back suspended (``metadata["resume_state"]``), which resumes."""
    if isinstance(sample.metadata, dict) and RESUME_STATE_KEY in sample.metadata:
        return
    if sample.status != Status.PENDING:
        raise SampleStateError(
            f"sample {sample.index!r}: a rollout requires a pending sample, got status {Status(sample.status).value!r}"
        )
    if sample.metadata is not None and not isinstance(sample.metadata, dict):
        raise SampleStateError(
            f"sample {sample.index!r}: metadata must be a dict or None, got {type(sample.metadata).__name__}"
        )
    if sample.response or sample.response_length or sample.loss_mask or sample.rollout_log_probs:
        raise SampleStateError(
            f"sample {sample.index!r}: the rollout does not accept pre-existing response state (response, "
            "response_length, loss_mask or rollout_log_probs is set)"
        )


def restore(state: Any, *, sample: Sample, deps: Deps, sample_id: str) -> RolloutContext:
    """The context of a handed-back sample, ``suspended`` where it stopped; the sample gets back its status from
    before the hand-back and loses its resume state. Raises :class:`ResumeError` before changing the sample when it
    cannot resume (the environment left no snapshot to rebuild it from)."""
    ctx = RolloutContext.from_json(state, sample=sample, deps=deps, sample_id=sample_id)
    if ctx.state != "suspended" or ctx.rendered is None:
        raise ResumeError(f"sample {sample_id}: the resume state is not of a suspended rollout ({ctx.state})")
    if ctx.env_snapshot is None:
        why = ctx.env_snapshot_error or "no environment snapshot was taken"
        raise ResumeError(
            f"sample {sample_id}: cannot resume: {why}; the environment must implement "
            "snapshot() -> dict and restore(state)"
        )
    ctx.env_closed = False
    status = ctx.status_before_hand_back
    sample.status = Status(status) if status is not None else Status.PENDING
    sample.metadata.pop("rollout_reason", None)
    del sample.metadata[RESUME_STATE_KEY]
    return ctx


__all__ = [
    "check_startable",
    "default_request_prefix",
    "default_sample_id",
    "observation_encoder_for",
    "restore",
]
