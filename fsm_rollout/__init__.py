"""fsm-rollout: multi-turn LLM/VLM rollouts for RL training as explicit, traced finite-state machines.

Each sample's lifecycle (``pending → rendered → generating → stepping → observing → …``, ending ``completed``,
``truncated``, ``aborted`` or ``failed``; ``suspended`` while a weight update runs) is a ``transitions`` machine
built from the table in :mod:`fsm_rollout.machine.lifecycle`; its callbacks talk to vLLM's token-in/token-out endpoints
and step the environment.

The names here are the library's public face: running rollouts (:class:`RolloutRunner`, :class:`RolloutConfig`,
:class:`Sample`, and :class:`RolloutService`, the surface the runner and the Ray pool share), the extension points
(an :class:`Environment` to step, which returns a :class:`StepResult` and may take a :class:`Turn`,
:class:`RolloutHooks` to observe, a :class:`Transport` to carry the engine client's requests), weight updates
(:class:`Suspender`), and the engines and pools to run against (:class:`LocalEngine`, :class:`RayRolloutPool`).
``LocalEngine`` and ``RayRolloutPool`` are imported on first use,
so ``import fsm_rollout`` loads neither the engine's server nor Ray, and never torch. Modules whose docstring starts
with "Internal:" (or that sit in a package whose docstring says its modules are internal) are the implementation:
their names may change without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm_rollout._version import __version__ as __version__
from fsm_rollout.config import RetryPolicy, RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.transport import AiohttpTransport, Transport
from fsm_rollout.envs.protocol import Environment
from fsm_rollout.envs.step import StepResult, Turn
from fsm_rollout.errors import RolloutError
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.rollout import Rollout
from fsm_rollout.rollout.handle import RolloutHandle
from fsm_rollout.runtime.metrics import MetricsSnapshot
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.runtime.service import RolloutService
from fsm_rollout.sample import Sample, Status, training_sequences
from fsm_rollout.tokens.template_probe import TemplateReport, choose_history_policy, probe_template
from fsm_rollout.trace import capture_transitions, get_tracer
from fsm_rollout.training import MismatchInputError, MismatchReport, TokenTree, mismatch, training_tree
from fsm_rollout.weights.suspension import Suspender, weight_staleness

if TYPE_CHECKING:
    from fsm_rollout.distributed import RayRolloutPool
    from fsm_rollout.engine.local import LocalEngine

__all__ = [
    "AiohttpTransport",
    "Environment",
    "LocalEngine",
    "MetricsSnapshot",
    "MismatchInputError",
    "MismatchReport",
    "RayRolloutPool",
    "RetryPolicy",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutHandle",
    "RolloutHooks",
    "RolloutRunner",
    "RolloutService",
    "Sample",
    "Status",
    "StepResult",
    "Suspender",
    "TemplateReport",
    "TokenTree",
    "Transport",
    "Turn",
    "VLLMClient",
    "capture_transitions",
    "choose_history_policy",
    "get_tracer",
    "mismatch",
    "probe_template",
    "training_sequences",
    "training_tree",
    "weight_staleness",
]

_LAZY = {"LocalEngine": "fsm_rollout.engine.local", "RayRolloutPool": "fsm_rollout.distributed"}
"""Public names imported on first use: the embedded engine's server and the Ray pool are heavier than the rest."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_rollout' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
