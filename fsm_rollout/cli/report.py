"""``fsm-rollout report``: a recorded run as one self-contained web page.

What the page shows and the exit codes are in :data:`EPILOG` (printed by ``--help`` and in the README); the work is
:mod:`fsm_rollout.report`'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_UNUSABLE = 0, 2

EPILOG = """\
Writes one HTML file with its CSS and script inline: it loads nothing from anywhere and opens from file://. It
shows the run summary (statuses and reasons, turns, tokens, throughput, rewards per group with zero-variance
groups flagged, forks and suspensions), where the time went (waiting for a concurrency slot apart from each
state's own work), the lifecycle diagram with the run's counts, and a table of samples to filter and sort; a
click opens a sample: its timeline and the edge that ended it, its conversation, and its token strip (trained and
masked tokens, logprobs, weight versions, inserted EOS, images; hover a token for its id and text). The tape beside
the trace gives the conversation and tokens; the trace alone gives timelines, reasons and counts. --replay adds
the verdicts and first divergences of `fsm-rollout replay --json > replay.json`. With --results the page shows
each group's token tree (node spans and the sequences sharing them); --mismatch FILE (trainer logprobs, one JSON
line per training sequence: a list, or {"logprobs": [...], "step": N}) adds K3 per step and per rollout event, the
worst sequences first, and each sample's tokens coloured by |Δlogprob|.

Exit codes: 0 written; 2 unusable input (missing file, not a trace, another schema version, a bad results or
replay file)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout report``."""
    parser.epilog = EPILOG
    parser.add_argument("trace", type=Path, metavar="TRACE", help="the transition trace (JSONL), or a tape")
    parser.add_argument("--tape", type=Path, metavar="FILE", help="the I/O tape (default: beside the trace)")
    parser.add_argument("--results", type=Path, metavar="R", help="the results file `run` wrote (rewards, groups)")
    parser.add_argument(
        "--replay", type=Path, metavar="REPLAY.json", help="the output of `fsm-rollout replay --json` for this run"
    )
    parser.add_argument(
        "--mismatch",
        type=Path,
        metavar="FILE",
        help="trainer logprobs (JSONL, one line per training sequence of --results): adds the mismatch section",
    )
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer for token texts (default: the one the recording used)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="where to write the page (default: TRACE with .html)"
    )


def default_output(trace: Path) -> Path:
    """``run.jsonl`` → ``run.html``."""
    return trace.with_suffix(".html") if trace.suffix != ".html" else trace.with_name(trace.name + ".html")


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout report``."""
    from fsm_rollout.errors import RolloutError
    from fsm_rollout.report import build_report, write_report

    started = time.perf_counter()
    try:
        data = build_report(
            args.trace,
            tape=args.tape,
            results=args.results,
            replay=args.replay,
            tokenizer=args.tokenizer,
            mismatch=args.mismatch,
        )
    except RolloutError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    output = write_report(data, args.output or default_output(args.trace))
    for note in data.notes:
        print(f"note: {note}", file=sys.stderr)
    size = output.stat().st_size
    print(
        f"report: {output} ({len(data.details)} sample runs, {size / 1e6:.1f} MB, "
        f"{time.perf_counter() - started:.1f}s); open it in a browser"
    )
    return EXIT_OK
