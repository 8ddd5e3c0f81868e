"""The workloads' shared parameters: the scripted conversation, its latency, and the process-wide settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCALE_TURNS = 3
"""Turns per sample in the HTTP workloads (and in the machine's three-turn path)."""
LATENCY_S = 0.05
"""The canned server's delay before each answer."""
PROMPT = "Find x in the triangle."
ANSWER = "Let me compute the angle: x = 180 - 50 - 60 = 70."
SAMPLING: dict[str, Any] = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
WORKLOADS = (
    *("weight-update", "slow-env", "scale-out", "images", "engine", "tree", "admission", "oversample", "mismatch"),
    "streaming",
)
"""The workloads ``--only`` can run alone; the others share interleaved runs and always run together."""


@dataclass(frozen=True)
class Settings:
    """Pacing and collector tuning for the measured rollouts.

    Passed to every ``RolloutConfig`` the bench builds, so the figures do not depend on the library's defaults
    (which leave both off).
    """

    loop_slice_ms: float | None = 5.0
    tune_gc: bool = True
