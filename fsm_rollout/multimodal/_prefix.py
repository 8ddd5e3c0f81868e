"""The sample prefix every multimodal error message starts with."""

from __future__ import annotations

from typing import Any


def sample_prefix(sample_id: Any) -> str:
    """``"sample <id>: "``, or nothing when the sample is not known."""
    return "" if sample_id is None else f"sample {sample_id}: "
