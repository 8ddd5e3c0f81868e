"""Deprecated: the I/O tape moved to :mod:`fsm_rollout.recording` (format, writer, recorder, reader).

Every public name of :mod:`fsm_rollout.recording` is re-exported here; ``RecordingClient`` and ``RecordingTracer``
are gone (the recorder plugs in as a transport and as the rollout's hooks: see
:func:`fsm_rollout.recording.recorded_rollout`).
"""

from __future__ import annotations

import warnings

from fsm_rollout.recording import *  # noqa: F403  # the old module's names, from where they live now
from fsm_rollout.recording import __all__ as __all__

warnings.warn(
    "fsm_rollout.tape is deprecated: import from fsm_rollout.recording instead", DeprecationWarning, stacklevel=2
)
