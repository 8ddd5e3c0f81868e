"""The machine: the lifecycle table (:mod:`~fsm_rollout.machine.lifecycle`), the lean ``transitions`` machine
built from it, and the diagrams drawn from it. The rollout that drives it is :mod:`fsm_rollout.rollout`."""
