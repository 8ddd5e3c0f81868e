"""The demo part of the ``engine`` workload (``--only engine``): ``fsm-rollout run``'s demo as it ran before batching
against as it runs now, each run a process of its own as a user starts it.

Before: ``fsm-rollout run --engine-in-process --no-batching``, the embedded engine in the run's own process decoding
one request at a time, as the demo ran before the engine batched (with every other change since). Now: ``fsm-rollout
run``, the engine batching in a child process. Each runs the demo (``--seed 7``: its 88 samples with images, or the
first 4 questions' 16 with ``quick``), alternating (``repeats`` times each, now first in odd rounds). Figures: each
side's tokens per second, rollouts' wall and tokens generated, as the run's summary line gives them (the median run),
their ratio, and the determinism check: the demo with greedy decoding on each side (identical tokens in every
sample: 1, else 0; and the largest logprob gap over the tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_SUMMARY = re.compile(
    r"(?P<done>\d+)/(?P<total>\d+) samples finished in (?P<wall>[\d.]+)s .*?(?P<tokens>\d+) tokens generated, "
    r"(?P<rate>\d+) tok/s\)"
)
_RUN_S = 900.0  # a bound for a loaded machine, not a timing


async def _demo(options: list[str], out: Path, *, quick: bool, greedy: bool = False) -> tuple[float, float, int]:
    """One demo run with ``options``: its tok/s, rollouts' wall seconds and tokens generated (from its summary)."""
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", *options, "--seed", "7", "--quiet", "--out", str(out)]
    command += [*(["--limit", "4"] if quick else []), *(["--temperature", "0"] if greedy else [])]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), _RUN_S)
    found = _SUMMARY.search(stdout.decode())
    if process.returncode != 0 or found is None or found["done"] != found["total"]:
        raise RuntimeError(f"the demo run {options} failed ({process.returncode}): {stderr.decode()[-2000:]}")
    return float(found["rate"]), float(found["wall"]), int(found["tokens"])


def _tokens_and_logprobs(path: Path) -> list[tuple[list[int], list[float]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["tokens"], row["rollout_log_probs"]) for row in rows]


SIDES = {"before": ["--engine-in-process", "--no-batching"], "now": []}


async def _bench(quick: bool, repeats: int) -> dict[str, float]:
    from fsm_rollout.engine.local.default_model import default_model_dir

    await asyncio.to_thread(default_model_dir)  # built once, before any timed run
    runs: dict[str, list[tuple[float, float, int]]] = {side: [] for side in SIDES}
    greedy: dict[str, list[tuple[list[int], list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="fsm-rollout-bench-demo-") as scratch:
        folder = Path(scratch)
        for round_index in range(repeats):
            for side in ("now", "before") if round_index % 2 == 0 else ("before", "now"):
                runs[side].append(await _demo(SIDES[side], folder / "sampled.jsonl", quick=quick))
        for side, options in SIDES.items():
            path = folder / f"greedy-{side}.jsonl"
            await _demo(options, path, quick=quick, greedy=True)
            greedy[side] = _tokens_and_logprobs(path)
    figures: dict[str, float] = {}
    for side in SIDES:
        rates = [rate for rate, _, _ in runs[side]]
        rate, wall, tokens = runs[side][rates.index(statistics.median_low(rates))]
        figures[f"demo_{side}_tok_s"] = rate
        figures[f"demo_{side}_wall_s"] = wall
        figures[f"demo_{side}_tokens"] = float(tokens)
    figures["demo_now_over_before_tok_s"] = figures["demo_now_tok_s"] / figures["demo_before_tok_s"]
    now, before = greedy["now"], greedy["before"]
    figures["demo_greedy_identical"] = float([ids for ids, _ in now] == [ids for ids, _ in before])
    figures["demo_greedy_max_logprob_gap"] = max(
        (
            abs(mine - theirs)
            for (_, values), (_, reference) in zip(now, before, strict=True)
            for mine, theirs in zip(values, reference, strict=False)
        ),
        default=0.0,
    )
    return figures


def bench_demo(quick: bool) -> dict[str, Any]:
    """The demo part's figures (``quick``: 16 samples and one run each, else the whole demo and two runs each)."""
    return asyncio.run(_bench(quick, repeats=1 if quick else 2))
