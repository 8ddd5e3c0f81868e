"""``python -m fsm_rollout.cli``: the ``fsm-rollout`` command without the console script."""

from __future__ import annotations

from fsm_rollout.cli import console_main

raise SystemExit(console_main())
