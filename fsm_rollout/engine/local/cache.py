"""Where fsm-rollout keeps its on-disk builds (the Qwen tokenizer, the tiny models, the default model).

The embedded engine, the test helpers and the CLI share this one root; it lives here, in the engine, because the
engine is the lowest layer that builds anything into it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Final

__all__ = ["CACHE_ENV_VAR", "cache_dir"]

CACHE_ENV_VAR: Final = "FSM_ROLLOUT_CACHE"
"""Environment variable overriding :func:`cache_dir`."""


def cache_dir() -> pathlib.Path:
    """Return the root directory for fsm-rollout's on-disk caches.

    ``$FSM_ROLLOUT_CACHE`` if it is set and non-empty, else ``~/.cache/fsm-rollout``. The directory
    is not created here.
    """
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return pathlib.Path(override).expanduser()
    return pathlib.Path.home() / ".cache" / "fsm-rollout"
