"""Programs a user of the library would write, run with ``python -m fsm_rollout.examples.<name>``."""
