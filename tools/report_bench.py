"""The report's figures: size and build time of a report, and how soon headless Chromium shows it.

``python -m tools.report_bench [--trace TRACE --results R] [--samples 10000]`` reports a recorded run (the
demo's, when given) and a synthetic run of ``--samples`` sample runs (trace and results, no tape). For each: the
tokenizer's load time (apart: it is the same for any run), the time to read and summarise the run (wall clock, and
CPU time, which a loaded machine inflates less), to write the page, the page's size, and in headless Chromium (the
median of ``--repeat`` loads) the first contentful paint and the time until the page is ready (the first frame with
the sample table painted).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(trace: Path, results: Path | None, output: Path, tokenizer: Any = None) -> dict[str, float]:
    """Build and write one report; seconds and size."""
    from fsm_rollout.report import build_report, write_report

    started, cpu = time.perf_counter(), time.process_time()
    data = build_report(trace, results=results, tokenizer=tokenizer)
    built, built_cpu = time.perf_counter(), time.process_time()
    write_report(data, output)
    written = time.perf_counter()
    return {
        "samples": len(data.details),
        "build_s": built - started,
        "build_cpu_s": built_cpu - cpu,
        "write_s": written - built,
        "size_mb": output.stat().st_size / 1e6,
    }


async def paint_times(page: Path, repeat: int) -> dict[str, float]:
    """Median first contentful paint (-1 when no load timed it) and time to ready over ``repeat`` loads, each in a
    fresh Chromium."""
    from tools.chromium import Chromium

    paints, readies = [], []
    for _ in range(repeat):
        async with Chromium() as browser:
            await browser.open(page.as_uri(), timeout_s=300)
            await browser.wait_for("document.body.dataset.ready", timeout_s=300)
            paint = await browser.evaluate(
                "(performance.getEntriesByName('first-contentful-paint')[0] || {startTime: null}).startTime"
            )
            if paint is not None:  # headless Chromium does not always time the first paint
                paints.append(float(paint))
            readies.append(float(await browser.evaluate("window.reportReadyMs")))
    return {"first_paint_ms": statistics.median(paints) if paints else -1.0, "ready_ms": statistics.median(readies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.report_bench", description=__doc__)
    parser.add_argument("--trace", type=Path, help="a recorded run's trace (its tape beside it), e.g. the demo's")
    parser.add_argument("--results", type=Path, help="that run's results file")
    parser.add_argument("--samples", type=int, default=10_000, help="sample runs of the synthetic run")
    parser.add_argument("--repeat", type=int, default=3, help="Chromium loads per page (the median is shown)")
    args = parser.parse_args(argv)
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="fsm-rollout-report-bench-") as scratch:
        directory = Path(scratch)
        if args.trace is not None:
            from fsm_rollout.recording import read_tape, tape_path_for
            from fsm_rollout.replay import load_recorded_tokenizer

            started = time.perf_counter()
            tape = tape_path_for(args.trace)
            tokenizer = load_recorded_tokenizer(read_tape(tape).samples) if tape.exists() else None
            loaded = time.perf_counter() - started
            figures = measure(args.trace, args.results, directory / "run.html", tokenizer)
            figures["tokenizer_s"] = loaded
            figures.update(asyncio.run(paint_times(directory / "run.html", args.repeat)))
            rows.append((f"{args.trace.name}", figures))
        from tools.report_synthetic import write_synthetic_run

        trace, results = write_synthetic_run(directory / "synthetic", args.samples)
        figures = measure(trace, results, directory / "synthetic.html")
        figures.update(asyncio.run(paint_times(directory / "synthetic.html", args.repeat)))
        rows.append((f"synthetic {args.samples}", figures))
    print(
        f"{'run':<20}{'samples':>8}{'build s':>9}{'cpu s':>7}{'write s':>9}{'size MB':>9}{'paint ms':>10}"
        f"{'ready ms':>10}"
    )
    for name, figures in rows:
        print(
            f"{name:<20}{figures['samples']:>8.0f}{figures['build_s']:>9.2f}{figures['build_cpu_s']:>7.2f}"
            f"{figures['write_s']:>9.2f}"
            f"{figures['size_mb']:>9.1f}{figures['first_paint_ms']:>10.0f}{figures['ready_ms']:>10.0f}"
            + (f"   (+ tokenizer load {figures['tokenizer_s']:.1f}s)" if "tokenizer_s" in figures else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
