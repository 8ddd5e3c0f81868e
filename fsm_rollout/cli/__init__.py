"""The ``fsm-rollout`` command line: one subcommand per module of this package.

Library modules hold no argument parsing: everything that reads command-line arguments lives in
:mod:`fsm_rollout.cli`. A subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``; it must
import cheaply (no torch or transformers at import time), since every subcommand module is imported to build the
parser.

Its modules are internal: the interface is the ``fsm-rollout`` command and :func:`main`; the modules behind
the subcommands may be renamed or split.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence

from fsm_rollout._version import __version__
from fsm_rollout.cli.common import HelpFormatter

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("fsm_rollout.cli.run", "roll a dataset out (default: the demo on the embedded CPU engine)"),
    "replay": ("fsm_rollout.cli.replay", "check a recorded run against today's machine and re-execute it offline"),
    "inspect": ("fsm_rollout.cli.inspect", "summarise a recorded run, or show one sample's timeline and text"),
    "report": ("fsm_rollout.cli.report", "write a recorded run as one self-contained web page"),
    "diagram": (
        "fsm_rollout.cli.diagram",
        "write the lifecycle diagrams (diagrams/) from the transition tables",
    ),
    "serve": ("fsm_rollout.cli.serve", "run the embedded CPU engine speaking vLLM's token-in/token-out API"),
    "bench": ("fsm_rollout.cli.bench", "measure the machine and the client against plain alternatives"),
    "gateway": (
        "fsm_rollout.cli.gateway",
        "serve OpenAI-compatible agent sessions, each a traced rollout trained token-exact",
    ),
}
"""Subcommand name → (module, one-line help)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="fsm-rollout",
        description="Multi-turn LLM/VLM rollouts for RL training as explicit, traced state machines.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fsm-rollout {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        subparser = subparsers.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        module.add_arguments(subparser)
        subparser.set_defaults(command_module=module)
    return parser


EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141
"""Ctrl-C, and a reader that went away (``inspect | head``): the codes a shell shows for SIGINT and SIGPIPE."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit code.

    A Ctrl-C that a subcommand does not handle itself ends it with one line and exit 130, and a closed stdout
    (the reader of a pipe stopped reading) quietly with 141, neither with a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        code: int = args.command_module.main(args)
        sys.stdout.flush()  # inside the try: a broken pipe surfaces here, not at the interpreter's exit
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # what is still buffered goes nowhere, rather than raising again when the interpreter flushes stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


def console_main() -> int:
    """The ``fsm-rollout`` console script and ``python -m fsm_rollout.cli``: :func:`main`, in a process that
    exits right after."""
    code = main()
    # The interpreter's last collections walk every object torch and transformers made, over a second on a loaded
    # machine and most of a Ctrl-C's budget; nothing in a process about to exit needs collecting. Only here, never
    # in main(), which a host process may call.
    gc.freeze()
    return code
