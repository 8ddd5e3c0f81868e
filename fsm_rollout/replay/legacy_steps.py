"""Internal: environment steps as tapes of schema 2 and before recorded them, read as the typed step of today.

Before the step was typed (tape schema 3), a tape recorded a step as ``{"observation", "done"}`` (plus
``"truncated"`` when the info had it), and a gateway session spoke through its observations: a dict naming the
agent's end, or its call (new messages, sampling settings, a rewrite), and the first call's settings in the
sample's metadata. This module is the one place that still reads those keys, so that such tapes replay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult

__all__ = ["legacy_reset", "legacy_step"]

_END: Final = "fsm_rollout.agent_end"
_CALL: Final = "agent_call"


def legacy_step(observation: Any, done: bool, result: Mapping[str, Any]) -> Any:
    """The step an old tape's ``result`` describes (``observation`` already revived): a :class:`StepResult` for a
    gateway session's end or call, else the 3-tuple the rollout's adapter reads (a recorded ``truncated`` that is
    not a bool fails there, as it did)."""
    if isinstance(observation, Mapping):
        end = observation.get(_END)
        if end is not None:
            return StepResult(None, done=True, end=EndReason(end))
        call = observation.get(_CALL)
        if isinstance(call, Mapping):
            rewrite = call.get("rewrite")
            messages = list(call.get("messages") or ())
            return StepResult(
                messages,
                done=done,
                next_call=NextCall(
                    sampling=dict(call.get("sampling") or {}),
                    rewrite=None
                    if not isinstance(rewrite, Mapping)
                    else Rewrite(
                        tuple(messages),
                        None if rewrite.get("tools") is None else tuple(rewrite["tools"]),
                        str(rewrite.get("detail")),
                    ),
                ),
            )
    info = {"truncated": result["truncated"]} if "truncated" in result else {}
    return (observation, done, info)


def legacy_reset(metadata: Any) -> StepResult | None:
    """What an old gateway tape's first request carried: the first call's settings, from the sample's metadata."""
    call = metadata.get(_CALL) if isinstance(metadata, Mapping) else None
    if not isinstance(call, Mapping):
        return None
    return StepResult(None, next_call=NextCall(sampling=dict(call.get("sampling") or {})))
