"""Internal: ``fsm-rollout run``'s options for which groups run: over-sampling and staleness pacing
(:mod:`fsm_rollout.runtime.sampling`, :mod:`fsm_rollout.runtime.staleness`)."""

from __future__ import annotations

import argparse


def add_group_options(group: argparse._ActionsContainer) -> None:
    """``--target-groups``, ``--oversample`` and ``--max-staleness``."""
    group.add_argument(
        "--target-groups",
        type=int,
        metavar="N",
        help="stop once N groups (a prompt's samples) are complete; the groups still running then end aborted "
        "(reason oversampled) and the groups never started are not run or written (default: every group)",
    )
    group.add_argument(
        "--oversample",
        type=int,
        default=0,
        metavar="M",
        help="with --target-groups N: start N + M groups, so that N complete sooner (the surplus is cut)",
    )
    group.add_argument(
        "--max-staleness",
        type=int,
        metavar="K",
        help="no group starts more than K weight versions ahead of what the trainer reported consumed (the "
        "runner's weight updates; a run with none never waits)",
    )
