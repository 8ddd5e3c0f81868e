"""What ``fsm-rollout run`` checks before it runs a sample: its options.

Each problem is one line naming the flag and the value; the command prints it and exits 2 with nothing run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

# ---------------------------------------------------------------------------------------------------- options

_NUMERIC_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("limit", lambda value: value >= 0, "must be 0 or more"),
    ("max_turns", lambda value: value >= 1, "must be at least 1"),
    ("max_new_tokens", lambda value: value >= 1, "must be at least 1"),
    ("max_context_len", lambda value: value >= 1, "must be at least 1"),
    ("concurrency", lambda value: value >= 1, "must be at least 1"),
    ("temperature", lambda value: math.isfinite(value) and value >= 0, "must be a number >= 0"),
    ("top_p", lambda value: 0 < value <= 1, "must be in (0, 1]"),
    ("image_merge_size", lambda value: value >= 1, "must be at least 1"),
    ("loop_slice_ms", lambda value: math.isfinite(value) and value >= 0,
     "must be a positive number of milliseconds, or 0 to turn pacing off"),
)
"""``run``'s numeric options (their ``dest``), what a valid value is, and how the rule reads."""


def option_problem(args: argparse.Namespace) -> str | None:
    """The first invalid option of ``run`` as ``--flag value: dest rule``, or None when all are valid."""
    for dest, valid, rule in _NUMERIC_RULES:
        value = getattr(args, dest, None)
        if value is not None and not valid(value):
            return f"--{dest.replace('_', '-')} {_shown(value)}: {dest} {rule}"
    for url in getattr(args, "engine_url", None) or ():
        if not url.startswith(("http://", "https://")):
            return f"--engine-url {url}: engine_url must be an http(s) URL such as http://127.0.0.1:8000"
    return None


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)
