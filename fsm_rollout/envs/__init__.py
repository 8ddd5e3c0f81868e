"""Built-in environments, each a module exposing ``build_env(*, sample, args)``.

* :mod:`fsm_rollout.envs.geo3k`: Geo3K-style geometry answers scored through a ``calc_score`` tool call
  (load it with ``--env fsm_rollout.envs.geo3k``).
"""
