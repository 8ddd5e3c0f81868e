"""Environments and trainers you already have, through fsm-rollout: adapters from their protocols to ours.

Inbound (each returns an environment factory, a ``build_env``, for the runner, the CLI and the Ray pool):
:func:`gym_env`, :func:`skyrl_env`, :func:`trl_env`, :func:`verifiers_env` (with :func:`verifiers_samples`).
The foreign packages are imported when an adapter is used; a missing one is a
:class:`~fsm_rollout.errors.MissingExtraError` naming the extra that installs it. On the command line they are
``--env verifiers:NAME``, ``skyrl:NAME``, ``gym:ID`` and ``trl:MODULE:CLASS``.

Outbound: :func:`trl_rollout_func` makes fsm-rollout the rollout engine of TRL's ``GRPOTrainer``
(:mod:`fsm_rollout.adapters.trl_rollout`; :func:`env_reward` is the reward function that trains on the
environment's reward).
"""

from __future__ import annotations

from fsm_rollout.adapters.trl_rollout import env_reward, trl_rollout_func
from fsm_rollout.envs.adapters.gym import gym_env, gym_samples
from fsm_rollout.envs.adapters.skyrl import skyrl_env
from fsm_rollout.envs.adapters.trl import trl_env
from fsm_rollout.envs.adapters.verifiers import verifiers_env, verifiers_samples

__all__ = [
    "env_reward",
    "gym_env",
    "gym_samples",
    "skyrl_env",
    "trl_env",
    "trl_rollout_func",
    "verifiers_env",
    "verifiers_samples",
]
