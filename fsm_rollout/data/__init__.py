"""Datasets shipped with the package.

* :mod:`fsm_rollout.data.demo`: Geo3K-style geometry questions with figures drawn at load time, for a first run
  of ``fsm-rollout run`` with the built-in Geo3K environment.
* :mod:`fsm_rollout.data.figures`: the Pillow drawings of the demo's figures.
* :mod:`fsm_rollout.data.practice`: practice questions of the demo's kinds with fresh numbers, never demo items.

The embedded engine's default model is trained on conversations about practice questions, which the engine ships a
copy of; the maintainers' ``tools/default_model_data.py`` writes that copy.

Its modules are internal, except :mod:`~fsm_rollout.data.demo` and :mod:`~fsm_rollout.data.practice`, which
examples and tests import by name.
"""
