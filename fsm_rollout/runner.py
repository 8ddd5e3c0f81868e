"""RolloutRunner: moved to :mod:`fsm_rollout.runtime.runner`; this import path keeps working."""

from __future__ import annotations

from fsm_rollout.runtime.runner import NOT_STARTED as NOT_STARTED
from fsm_rollout.runtime.runner import RolloutRunner as RolloutRunner
from fsm_rollout.runtime.runner import group_members as group_members
from fsm_rollout.runtime.runner import group_seeds as group_seeds
