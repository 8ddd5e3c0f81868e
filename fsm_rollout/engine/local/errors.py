"""The exceptions of the embedded engine (raised to its Python caller, never sent over HTTP)."""

from __future__ import annotations

from fsm_rollout.errors import RolloutError


class LocalEngineError(RolloutError, RuntimeError):
    """Base class of the embedded engine's errors."""


class ModelLoadError(LocalEngineError):
    """The model directory cannot be built or loaded (missing files, not a causal LM, bad max_model_len)."""


class WeightLoadError(LocalEngineError, ValueError):
    """New weights do not fit the model (unknown parameter names, wrong shapes) or cannot be read."""
