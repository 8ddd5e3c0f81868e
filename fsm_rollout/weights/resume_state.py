"""Where a handed-back sample keeps its resume state, and how a trainer forgets one it will not resume.

A suspended sample handed back to its caller (slime/vime's ``partial_rollout``; the table's ``hand_back`` edge)
carries its rollout's context as plain JSON in ``metadata["resume_state"]``
(:meth:`fsm_rollout.rollout.context.RolloutContext.to_json`). Nothing else is kept: the ``hand_back`` edge
snapshots the environment into that JSON and closes it, and a resume, in this process or another, rebuilds the
environment through the factory and hands it the snapshot (``restore(state)``). No pickle: everything is JSON.
"""

from __future__ import annotations

from typing import Any

RESUME_STATE_KEY = "resume_state"


def discard_suspended(sample: Any) -> None:
    """Forget a handed-back sample that will not be resumed: its resume state is removed (its environment was
    closed when it was handed back, so nothing else is held)."""
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata.pop(RESUME_STATE_KEY, None)


__all__ = ["RESUME_STATE_KEY", "discard_suspended"]
