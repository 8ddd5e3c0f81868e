"""One sample's multi-turn rollout, as parts.

- :mod:`~fsm_rollout.rollout.context`: the one record guards and actions read; its JSON is the resume state.
- :mod:`~fsm_rollout.rollout.steps`: the table's guards and actions, functions of the context; the machine.
- :mod:`~fsm_rollout.rollout.activities`: the I/O the states name (render, generate, step, encode, resume).
- :mod:`~fsm_rollout.rollout.gating`: where the weight-update gate is met, around the generate request.
- :mod:`~fsm_rollout.rollout.cancel`: the one cancel scope, with abort and timeout as separate causes.
- :mod:`~fsm_rollout.rollout.stops`: the client-side stop-string search of a continued turn.
- :mod:`~fsm_rollout.rollout.events`: a transition's trace fields.
- :mod:`~fsm_rollout.rollout.view`: the read-only view hooks get.
- :mod:`~fsm_rollout.rollout.setup`: start checks, default names, restoring from a resume state.
- :mod:`~fsm_rollout.rollout.driver`: :class:`Rollout`, the driver.
- :mod:`~fsm_rollout.rollout.handle`: :class:`~fsm_rollout.rollout.handle.RolloutHandle`, a started rollout's handle.

The table itself is :mod:`fsm_rollout.machine.lifecycle`.

Its modules are internal: import from this package (or :mod:`fsm_rollout`).
"""

from fsm_rollout.rollout.driver import Rollout
from fsm_rollout.rollout.setup import (
    check_startable,
    default_request_prefix,
    default_sample_id,
    observation_encoder_for,
)

__all__ = [
    "Rollout",
    "check_startable",
    "default_request_prefix",
    "default_sample_id",
    "observation_encoder_for",
]
