"""Built-in environments, each a module exposing ``build_env(*, sample, args)``, and the typed step.

* :mod:`fsm_rollout.envs.step`: what ``env.step`` is given and returns (:class:`StepResult`, :class:`Turn`).
* :mod:`fsm_rollout.envs.geo3k`: Geo3K-style geometry answers scored through a ``calc_score`` tool call
  (load it with ``--env fsm_rollout.envs.geo3k``).
"""

from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult, Turn, accepts_turn, as_step_result

__all__ = ["EndReason", "NextCall", "Rewrite", "StepResult", "Turn", "accepts_turn", "as_step_result"]
