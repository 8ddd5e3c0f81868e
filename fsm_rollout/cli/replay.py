"""``fsm-rollout replay``: check a recorded run against today's lifecycle and re-execute it offline from its tape.

What the command does and its exit codes are in :data:`EPILOG` (printed by ``--help`` and in the README); the work
is :func:`fsm_rollout.replay.replay`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsm_rollout.cli.common import use_color
from fsm_rollout.machine import lifecycle

EXIT_UNUSABLE = 2

EPILOG = """\
Checks every sample's logged path against today's transition table and, when the run was recorded
(`fsm-rollout run --trace run.jsonl --record` writes `run.tape.jsonl`), re-executes each sample through today's
code with the engine and the environment answered from the tape. Only the tokenizer is needed locally: the
recorded one, or --tokenizer PATH.

Exit codes: 0 every sample identical (or legal, when only checked); 1 a divergence, or an illegal, unfinished or
damaged path; 2 unusable input (missing file, not a trace, another schema version, no tokenizer, nothing
selected)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout replay``."""
    parser.epilog = EPILOG
    parser.add_argument(
        "trace",
        type=Path,
        metavar="TRACE",
        help="the transition trace (JSONL); its tape is read from beside it (X.jsonl -> X.tape.jsonl). "
        "A tape alone works too",
    )
    parser.add_argument("--tape", type=Path, metavar="FILE", help="the I/O tape (default: beside the trace)")
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="local tokenizer path or name (default: the one the recording used)"
    )
    parser.add_argument(
        "--check-only", action="store_true", help="only check the paths against today's table; do not re-execute"
    )
    parser.add_argument("--sample", action="append", metavar="ID", help="only this sample id (repeatable)")
    parser.add_argument(
        "--status",
        action="append",
        choices=[*sorted(lifecycle.TERMINAL), "unfinished"],
        help="only samples that ended so in the recording (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every sample, not only the failing ones")
    parser.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the verdicts (default: when printing to a terminal)",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout replay``."""
    import orjson

    from fsm_rollout.errors import RolloutError
    from fsm_rollout.replay import replay

    try:
        report = replay(
            args.trace,
            tape=args.tape,
            tokenizer=args.tokenizer,
            sample_ids=args.sample,
            statuses=args.status,
            execute=not args.check_only,
        )
    except (RolloutError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    if not report.samples and (args.sample or args.status):
        print("error: no recorded sample matches --sample/--status", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.json:
        print(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(report.render(color=use_color(args.color), verbose=args.verbose))
    return report.exit_code
