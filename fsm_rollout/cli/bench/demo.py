"""The demo part of the ``engine`` workload (``--only engine``): ``fsm-rollout run``'s demo against the embedded engine
decoding one request at a time and against it batching, each served as ``fsm-rollout run`` serves it.

Two engines serve the default model, each in a child process (``fsm-rollout serve``, the one-at-a-time one with
``--no-batching``), up at the same time; the demo (``fsm-rollout run --seed 7``, its 88 samples with images, or the
first 4 questions' 16 with ``quick``) runs against one, then the other, alternating (``repeats`` times each, the
batched one first in odd rounds), each run a process of its own as a user starts it. Figures: each side's tokens per
second, rollouts' wall and tokens generated, as the run's summary line gives them (the median run), their ratio, and
the determinism check: the demo with greedy decoding against each engine (identical tokens in every sample: 1, else
0; and the largest logprob gap over the tokens).
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


async def _demo(url: str, out: Path, *, quick: bool, greedy: bool = False) -> tuple[float, float, int]:
    """One demo run against ``url``: its tok/s, rollouts' wall seconds and tokens generated (from its summary)."""
    command = [sys.executable, "-m", "fsm_rollout.cli", "run", "--engine-url", url, "--seed", "7", "--quiet"]
    command += ["--out", str(out), *(["--limit", "4"] if quick else []), *(["--temperature", "0"] if greedy else [])]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), _RUN_S)
    found = _SUMMARY.search(stdout.decode())
    if process.returncode != 0 or found is None or found["done"] != found["total"]:
        raise RuntimeError(f"the demo run against {url} failed ({process.returncode}): {stderr.decode()[-2000:]}")
    return float(found["rate"]), float(found["wall"]), int(found["tokens"])


def _tokens_and_logprobs(path: Path) -> list[tuple[list[int], list[float]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["tokens"], row["rollout_log_probs"]) for row in rows]


async def _bench(quick: bool, repeats: int) -> dict[str, float]:
    from fsm_rollout.cli.engine_process import engine_process
    from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir

    model_dir = await asyncio.to_thread(default_model_dir)
    runs: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="fsm-rollout-bench-demo-") as scratch:
        folder = Path(scratch)
        async with (
            engine_process(model_dir, DEFAULT_MODEL_NAME) as batched_url,
            engine_process(model_dir, DEFAULT_MODEL_NAME, "--no-batching") as single_url,
        ):
            urls = {True: batched_url, False: single_url}
            for round_index in range(repeats):
                for batched in (True, False) if round_index % 2 == 0 else (False, True):
                    runs[batched].append(await _demo(urls[batched], folder / "sampled.jsonl", quick=quick))
            greedy = {}
            for batched in (True, False):
                path = folder / f"greedy-{batched}.jsonl"
                await _demo(urls[batched], path, quick=quick, greedy=True)
                greedy[batched] = _tokens_and_logprobs(path)
    figures: dict[str, float] = {}
    for batched, name in ((False, "demo_one_at_a_time"), (True, "demo_batched")):
        rates = [rate for rate, _, _ in runs[batched]]
        rate, wall, tokens = runs[batched][rates.index(statistics.median_low(rates))]
        figures[f"{name}_tok_s"] = rate
        figures[f"{name}_wall_s"] = wall
        figures[f"{name}_tokens"] = float(tokens)
    figures["demo_batched_over_one_at_a_time_tok_s"] = (
        figures["demo_batched_tok_s"] / figures["demo_one_at_a_time_tok_s"]
    )
    together, alone = greedy[True], greedy[False]
    figures["demo_greedy_identical"] = float([ids for ids, _ in together] == [ids for ids, _ in alone])
    figures["demo_greedy_max_logprob_gap"] = max(
        (
            abs(mine - theirs)
            for (_, values), (_, reference) in zip(together, alone, strict=True)
            for mine, theirs in zip(values, reference, strict=False)
        ),
        default=0.0,
    )
    return figures


def bench_demo(quick: bool) -> dict[str, Any]:
    """The demo part's figures (``quick``: 16 samples and one run each, else the whole demo and two runs each)."""
    return asyncio.run(_bench(quick, repeats=1 if quick else 2))
