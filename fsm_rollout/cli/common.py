"""What several subcommands share: colour choice and the options for the process-wide settings."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_LOOP_SLICE_MS = 5.0
"""The commands pace rollouts by default; the library leaves pacing to the caller."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default, and descriptions and epilogs printed as written.

    A default is appended to an option's help unless the help already says it or there is nothing to say (no
    value, a flag that is off, an empty list).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if "%(default)" in help_text or "(default:" in help_text or default is None or default is False:
            return help_text
        if isinstance(default, list | tuple) and not default:
            return help_text
        return super()._get_help_string(action)


def use_color(choice: str) -> bool:
    """Whether to print ANSI colours: ``always``, ``never``, or ``auto`` (a terminal, and no ``NO_COLOR``)."""
    if choice == "auto":
        return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return choice == "always"


def add_process_settings(group: argparse._ActionsContainer) -> None:
    """``--loop-slice-ms`` and ``--no-tune-gc``: the process-wide settings a command turns on unless told not to.

    ``group`` is a parser or an argument group. ``--no-defer-full-gc`` is the former name of ``--no-tune-gc``.
    """
    group.add_argument(
        "--loop-slice-ms",
        type=float,
        default=DEFAULT_LOOP_SLICE_MS,
        metavar="MS",
        help="event-loop time per iteration that rollouts' CPU work aims to stay within; "
        "0 turns pacing off (default: %(default)s)",
    )
    group.add_argument(
        "--no-tune-gc",
        action="store_true",
        help="leave Python's garbage collector on its default schedule while rollouts run",
    )
    group.add_argument(
        "--no-defer-full-gc", dest="no_tune_gc", action="store_true", help=argparse.SUPPRESS
    )  # its former name, so existing scripts still run
