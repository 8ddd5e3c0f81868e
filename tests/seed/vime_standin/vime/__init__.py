"""Test-only stand-in for the parts of vime that the seed rollout imports (see ``tests/seed/``).

Written from ``shared/docs/seed-contract.md`` (sections 2, 4, 5, 10 and 11) as an independent oracle: nothing in
this package imports ``fsm_rollout``.
"""
