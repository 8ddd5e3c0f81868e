"""Internal: a lineage whose sequence ended over the model's context stays usable.

An agent whose conversation outgrew the context gets OpenAI's answer, 400 ``context_length_exceeded``, and may trim
its history and call again. The sequence that overflowed has ended (``failed`` when its prompt could not be
rendered or generated from, ``truncated`` when the rollout's budget ran out first), so the trimmed call starts a new
sequence of the same lineage (the session table's ``call`` edge from ``rollout_ended`` under ``over_context``). The
ended sequence, when it holds any tokens, is kept as a branch of the new one, so nothing trained is lost; one that
never got a prompt (its first call was over the context) holds nothing to train and is dropped.
"""

from __future__ import annotations

from fsm_rollout.gateway.openai_wire import GatewayError, context_overflow
from fsm_rollout.sample import Sample

__all__ = ["BUDGET_REASONS", "ended_over_context", "overflow_error"]

BUDGET_REASONS = frozenset(
    {"budget_exhausted", "insufficient_budget_for_next_turn", "insufficient_budget_for_stop_eos"}
)
"""The rollout's reasons for a sequence whose next turn has no room left in the context."""


def _error_message(sample: Sample) -> str:
    error = sample.metadata.get("rollout_error")
    return str(error.get("message") or "") if isinstance(error, dict) else ""


def ended_over_context(sample: Sample | None) -> bool:
    """The sequence ended because the conversation is over the context: out of budget, or an engine error saying
    so."""
    if sample is None:
        return False
    if sample.metadata.get("rollout_reason") in BUDGET_REASONS:
        return True
    return context_overflow(_error_message(sample)) is not None


def overflow_error(sample: Sample) -> GatewayError:
    """The 400 a call gets when its sequence ended over the context before answering it."""
    found = context_overflow(_error_message(sample))
    detail = found or f"no room is left for an answer ({sample.metadata.get('rollout_reason')})"
    return GatewayError(
        400,
        f"the conversation is over the model's context length: {detail} Trim the history and call again.",
        code="context_length_exceeded",
    )
