"""Internal: the inbound adapters and their ``--env`` names; import them from :mod:`fsm_rollout.adapters`.

The adapters run environments of other libraries behind the rollout's environment protocol; the names are
``verifiers:NAME``, ``skyrl:NAME``, ``gym:ID`` and ``trl:MODULE:CLASS``.

Its modules are internal. They live apart from :mod:`fsm_rollout.adapters` because
:func:`fsm_rollout.envs.protocol.load_env_factory`, which the runner uses, resolves the ``--env`` names here, while
:mod:`fsm_rollout.adapters` also exports the outbound adapters, which build on the runner: in one package the
imports would go round in a circle.
"""
