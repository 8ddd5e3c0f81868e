"""Environments and trainers you already have, through fsm-rollout: adapters from their protocols to ours.

Inbound (each returns an environment factory, a ``build_env``, for the runner, the CLI and the Ray pool):
:func:`gym_env`, :func:`skyrl_env`, :func:`trl_env`, :func:`verifiers_env`
(with :func:`verifiers_samples`). The foreign packages are imported when an adapter is
used; a missing one is a :class:`~fsm_rollout.errors.MissingExtraError` naming the extra that installs it.

Outbound: :func:`fsm_rollout.adapters.trl_rollout.trl_rollout_func` makes fsm-rollout the rollout engine of TRL's
``GRPOTrainer`` (not imported here: it builds on the runner, which loads the inbound adapters). On the command line
the inbound adapters are ``--env verifiers:NAME``, ``skyrl:NAME``, ``gym:ID`` and ``trl:MODULE:CLASS``.
"""

from __future__ import annotations

from fsm_rollout.adapters.gym import gym_env, gym_samples
from fsm_rollout.adapters.skyrl import skyrl_env
from fsm_rollout.adapters.trl import trl_env
from fsm_rollout.adapters.verifiers import verifiers_env, verifiers_samples

__all__ = [
    "gym_env",
    "gym_samples",
    "skyrl_env",
    "trl_env",
    "verifiers_env",
    "verifiers_samples",
]
