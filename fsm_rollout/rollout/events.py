"""The fields of a transition's trace event (also what hooks that want events and the tape receive)."""

from __future__ import annotations

from typing import Any

from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout.context import RolloutContext
from fsm_rollout.rollout.history import fork_reason


def event_fields(
    ctx: RolloutContext, trigger: str, src: str, dwell_ms: float, *, suspended_since: float | None, now: float
) -> dict[str, Any]:
    """The event of ``trigger`` having moved the rollout from ``src`` to ``ctx.state``."""
    fields: dict[str, Any] = {
        "trigger": trigger,
        "src": src,
        "dst": ctx.state,
        "turn": ctx.turn_index,
        "response_length": ctx.sample.response_length,
        "remaining_budget": ctx.remaining_budget,
        "dwell_ms": round(dwell_ms, 3),
    }
    if ctx.state in lifecycle.TERMINAL:
        fields["reason"] = ctx.reason
    admission = ctx.deps.admission
    if admission is not None and admission.waited_ms is not None:  # this edge waited for the engine's admission
        fields["admission_ms"] = admission.take_waited()
    if trigger == "render":
        fields["prompt_tokens"] = ctx.prompt_length
        fields["image_hashes"] = list(ctx.image_hashes)
    elif trigger == "step" and ctx.turn is not None:
        fields["generated_tokens"] = len(ctx.turn.token_ids)
        fields["finish"] = ctx.turn.finish
        fields["eos_inserted"] = ctx.state == "stepping" and ctx.eos_due
    elif trigger == "generate" and src == "observing":
        fields["observation_tokens"] = len(ctx.observation_tokens)
        if ctx.observation_image_hashes:
            fields["observation_image_hashes"] = list(ctx.observation_image_hashes)
    elif trigger == "fork" and ctx.state == "rendered":
        fields["reason"] = fork_reason(ctx)
        fields["branch"] = len(ctx.sample.branches)
        fields["prompt_tokens"] = ctx.prompt_length
    elif trigger == "suspend":
        fields["suspend_reason"] = ctx.suspend_reason
        fields["cut_request"] = ctx.suspend_cut_request
        fields["partial_tokens"] = sum(len(part.token_ids) for part in ctx.partial_turn)
    elif trigger == "resume":
        fields["partial_tokens"] = sum(len(part.token_ids) for part in ctx.partial_turn)
        if suspended_since is not None:
            fields["suspended_ms"] = round((now - suspended_since) * 1000.0, 3)
        version = ctx.deps.gate.weight_version
        if version is not None:
            fields["weight_version"] = version
    elif trigger == "hand_back":
        fields["suspend_reason"] = ctx.suspend_reason
        fields["partial_tokens"] = sum(len(part.token_ids) for part in ctx.partial_turn)
    elif trigger == "abort" and ctx.reason == lifecycle.AGENT_DISCONNECTED:
        kept = ctx.sample.metadata.get("disconnected_turn") or {}
        fields["kept_tokens"] = kept.get("end", 0) - kept.get("start", 0)
    elif trigger == "fail":
        fields["failed_trigger"] = ctx.failed_trigger
        fields["error_type"] = type(ctx.error).__name__
        fields["error"] = str(ctx.error)[:500]
    return fields


__all__ = ["event_fields"]
