"""What several subcommands share."""

from __future__ import annotations

import os
import sys


def use_color(choice: str) -> bool:
    """Whether to print ANSI colours: ``always``, ``never``, or ``auto`` (a terminal, and no ``NO_COLOR``)."""
    if choice == "auto":
        return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return choice == "always"
