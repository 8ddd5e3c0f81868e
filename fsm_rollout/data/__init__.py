"""Datasets shipped with the package.

* :mod:`fsm_rollout.data.demo`: Geo3K-style geometry questions with figures drawn at load time, for a first run
  of ``fsm-rollout run`` with the built-in Geo3K environment.
* :mod:`fsm_rollout.data.figures`: the Pillow drawings of the demo's figures.

Its modules are internal, except :mod:`~fsm_rollout.data.demo` and :mod:`~fsm_rollout.data.practice`, which
examples and tests import by name.
"""
