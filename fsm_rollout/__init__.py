"""fsm-rollout: multi-turn LLM/VLM rollouts for RL training as explicit, traced finite-state machines.

Each sample's lifecycle (``pending → rendered → generating → stepping → observing → …``, ending ``completed``,
``truncated``, ``aborted`` or ``failed``; ``suspended`` while a weight update runs) is a ``transitions`` machine
built from the table in :mod:`fsm_rollout.lifecycle`; its callbacks talk to vLLM's token-in/token-out endpoints and
step the environment.
"""

from fsm_rollout.config import RetryPolicy, RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.errors import RolloutError
from fsm_rollout.rollout import Rollout
from fsm_rollout.runner import RolloutRunner
from fsm_rollout.sample import Sample, Status
from fsm_rollout.suspension import Suspender, weight_staleness
from fsm_rollout.trace import capture_transitions, get_tracer

__all__ = [
    "RetryPolicy",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutRunner",
    "Sample",
    "Status",
    "Suspender",
    "VLLMClient",
    "capture_transitions",
    "get_tracer",
    "weight_staleness",
]
__version__ = "0.2.0"
