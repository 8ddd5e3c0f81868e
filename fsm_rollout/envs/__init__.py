"""Environments: the protocol and loader, the typed step, the worker pools, the built-in environments and the
inbound adapters.

* :mod:`fsm_rollout.envs.protocol`: the environment protocol a rollout steps, and loading environment modules by
  name or file path; :mod:`fsm_rollout.envs.pool`: the pools that run synchronous environment code off the loop.
* :mod:`fsm_rollout.envs.adapters`: environments of other libraries behind the protocol (import them from
  :mod:`fsm_rollout.adapters`).
* :mod:`fsm_rollout.envs.step`: what ``env.step`` is given and returns (:class:`StepResult`, :class:`Turn`).
* Built-in environments, each a module exposing ``build_env(*, sample, args)``: :mod:`fsm_rollout.envs.geo3k`,
  Geo3K-style geometry answers scored through a ``calc_score`` tool call (load it with
  ``--env fsm_rollout.envs.geo3k``), :mod:`~fsm_rollout.envs.calculator` and :mod:`~fsm_rollout.envs.grid`.
"""

from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult, Turn, accepts_turn, as_step_result

__all__ = ["EndReason", "NextCall", "Rewrite", "StepResult", "Turn", "accepts_turn", "as_step_result"]
