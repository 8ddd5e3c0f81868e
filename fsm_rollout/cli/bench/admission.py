"""The ``admission`` workload (``--only admission``): fixed concurrency against adaptive admission on the embedded
engine, side by side in one run.

A mixed agent workload: groups of :data:`GROUP` samples per prompt, each sample :data:`TURNS` turns whose lengths
are drawn from 16 to 256 tokens (the agent's call sets ``max_tokens`` and biases the end-of-text tokens away, so a
turn is as long as drawn), and between turns a tool call drawn from 0 to 2 s (an async sleep) times
:data:`TOOL_SCALE`. Every draw is seeded by the sample, so each run gets the same workload.

Why the tools are scaled: adaptive admission pays off when samples waiting on tools would otherwise hold batch
slots, that is when a tool call lasts about as long as a turn's generation. The issue's 0 to 2 s are against a GPU
engine's turn; on this CPU engine a full batch generates a turn many times slower, so unscaled tool calls are a
small share of a sample's time and fixed concurrency at ``max_num_seqs`` already fills the batch. The scale keeps
the issue's ratio of tool time to generation time, not its seconds.

The configurations (fixed concurrency at the default, ``fsm-rollout run``'s ``--concurrency``; at each value of a
sweep; adaptive) run interleaved, A B C A B C ..., over :data:`REPEATS` repeats against one engine (default model,
``max_num_seqs`` :data:`MAX_NUM_SEQS`), so a slow spell of a shared machine hits all of them alike; each figure is
the median over the repeats, with its range. The engine's load is read in process by the adaptive controller (the
bench registers it, as an embedded engine in the runner's process can be).

Figures per configuration: samples per second and the engine's busy fraction (the share of the run's wall time with
at least one request in the running batch, sampled every 10 ms), beside its batch occupancy (mean running requests
over ``max_num_seqs``) and its mean waiting queue; then adaptive against the default and against the best fixed
value (by median samples per second), beside the ceiling: the best fixed value against the default. The sweep ends
with every sample in flight at once, which no admission policy can exceed, so that ratio bounds adaptive's against
the default on this engine.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from fsm_rollout.cli.bench.params import Settings
from fsm_rollout.envs.step import NextCall, StepResult

GROUP = 4
TURNS = 3
TURN_TOKENS = (16, 256)
TOOL_S = (0.0, 2.0)
TOOL_SCALE = 8.0
"""Tool calls last :data:`TOOL_S` times this (module docstring: a tool call about as long as a turn here)."""
REPEATS = 3
DEFAULT_CONCURRENCY = 16
"""``fsm-rollout run``'s ``--concurrency`` default."""
MAX_NUM_SEQS = 16
SAMPLE_EVERY_S = 0.01
PROMPTS = (
    "Find x in the triangle with angles 50 and 60 degrees.",
    "A rectangle is 7 by 3. What is its area?",
    "Find the hypotenuse of a right triangle with legs 6 and 8.",
    "What is the measure of each angle of a regular hexagon?",
)


class AgentEnv:
    """A tool-calling episode: turns of drawn lengths, tool calls of drawn latency (seeded by the sample)."""

    def __init__(self, rng: random.Random, end_ids: list[int]) -> None:
        self.rng = rng
        self.bias = {str(token): -100.0 for token in end_ids}
        self.turn = 0

    def _call(self) -> NextCall:
        return NextCall(sampling={"max_tokens": self.rng.randint(*TURN_TOKENS), "logit_bias": self.bias})

    def reset(self) -> StepResult:
        return StepResult(observation=None, next_call=self._call())

    async def step(self, text: str) -> StepResult:
        self.turn += 1
        if self.turn >= TURNS:
            return StepResult(observation=None, done=True, reward=1.0)
        await asyncio.sleep(self.rng.uniform(*TOOL_S) * TOOL_SCALE)
        return StepResult(observation=f"tool output {self.turn}: 42", next_call=self._call())

    def format_observation(self, observation: Any) -> Any:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        return None


class LoadSampler:
    """The engine's load every :data:`SAMPLE_EVERY_S` while a run lasts (read in process, not over HTTP)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.readings: list[tuple[int, int]] = []

    async def run(self) -> None:
        while True:
            load = self.engine.load()
            self.readings.append((load.running, load.waiting))
            await asyncio.sleep(SAMPLE_EVERY_S)

    def figures(self) -> dict[str, float]:
        count = max(1, len(self.readings))
        return {
            "busy_fraction": sum(running > 0 for running, _ in self.readings) / count,
            "batch_occupancy": sum(running for running, _ in self.readings) / count / MAX_NUM_SEQS,
            "mean_waiting": sum(waiting for _, waiting in self.readings) / count,
        }


async def _one_run(
    engine: Any, tokenizer: Any, settings: Settings, samples: int, *, admission: str, concurrency: int
) -> dict[str, float]:
    from fsm_rollout import RolloutConfig, Sample, Status
    from fsm_rollout.runtime.runner import RolloutRunner, group_members

    end_ids = sorted(
        {
            token
            for token in (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
            if isinstance(token, int) and token != tokenizer.unk_token_id
        }
    )
    config = RolloutConfig(
        engine_url=engine.url,
        model=engine.served_model_name,
        max_turns=TURNS,
        admission=admission,
        loop_slice_ms=settings.loop_slice_ms,
        tune_gc=settings.tune_gc,
        history_policy="append",
    )

    def build_env(*, sample: Any, args: Any) -> AgentEnv:
        return AgentEnv(random.Random(f"{sample.group_index}.{sample.metadata['group_member']}"), end_ids)

    batch: list[Any] = []
    ids: list[str | None] = []
    for index in range(samples // GROUP):
        copies, names = group_members(Sample(prompt=PROMPTS[index % len(PROMPTS)], index=index), GROUP)
        batch += copies
        ids += names
    sampling = {"max_new_tokens": 4096, "temperature": 1.0, "top_p": 1.0}
    sampler = LoadSampler(engine)
    async with RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer, env_factory=build_env) as runner:
        watching = asyncio.ensure_future(sampler.run())
        started = time.perf_counter()
        done = await runner.run_batch(batch, concurrency=concurrency, sample_ids=ids)
        wall = time.perf_counter() - started
        watching.cancel()
        window = runner.admission.controllers[engine.url].window if runner.admission is not None else 0
    failed = sum(sample.status == Status.FAILED for sample in done)
    if failed:
        raise RuntimeError(f"admission bench: {failed} samples failed ({done[0].metadata.get('rollout_error')})")
    return {"samples_per_s": len(done) / wall, "wall_s": wall, **sampler.figures(), "final_window": float(window)}


def _summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over the repeats, and the range (min, max) of samples per second."""
    summary = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    rates = [run["samples_per_s"] for run in runs]
    summary["samples_per_s_min"], summary["samples_per_s_max"] = min(rates), max(rates)
    return summary


async def _bench(samples: int, sweep: tuple[int, ...], repeats: int, settings: Settings) -> dict[str, float]:
    from fsm_rollout.engine.load import register_local, unregister_local
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import default_model_dir
    from fsm_rollout.tokens.tokenizers import load_tokenizer

    model_dir = await asyncio.to_thread(default_model_dir)
    tokenizer = await asyncio.to_thread(load_tokenizer, str(model_dir))
    figures: dict[str, float] = {
        "samples": float(samples),
        "max_num_seqs": float(MAX_NUM_SEQS),
        "repeats": float(repeats),
        "tool_scale": TOOL_SCALE,
    }
    configurations = [("fixed", concurrency) for concurrency in sweep] + [("adaptive", samples)]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {configuration: [] for configuration in configurations}
    async with LocalEngine(model_dir, max_num_seqs=MAX_NUM_SEQS) as engine:
        register_local(engine.url, engine.load)
        try:
            for _ in range(repeats):
                for admission, concurrency in configurations:
                    runs[admission, concurrency].append(
                        await _one_run(
                            engine, tokenizer, settings, samples, admission=admission, concurrency=concurrency
                        )
                    )
        finally:
            unregister_local(engine.url)
    fixed = {concurrency: _summary(runs["fixed", concurrency]) for concurrency in sweep}
    adaptive = _summary(runs["adaptive", samples])
    for concurrency, summary in fixed.items():
        for name, value in summary.items():
            if name != "final_window":
                figures[f"fixed_{concurrency}_{name}"] = value
    for name, value in adaptive.items():
        figures[f"adaptive_{name}"] = value
    best = max(sweep, key=lambda value: fixed[value]["samples_per_s"])
    default = fixed[DEFAULT_CONCURRENCY]["samples_per_s"]
    figures["best_fixed_concurrency"] = float(best)
    # the ceiling (module docstring)
    figures["ceiling_best_fixed_vs_default_fixed"] = fixed[best]["samples_per_s"] / default
    figures["adaptive_vs_default_fixed"] = adaptive["samples_per_s"] / default
    figures["adaptive_vs_best_fixed"] = adaptive["samples_per_s"] / fixed[best]["samples_per_s"]
    return figures


def bench_admission(quick: bool, settings: Settings) -> dict[str, float]:
    """The workload's figures (``quick``: 32 samples, a sweep of 8, 16 and 32, two repeats; else 64 samples, a sweep
    of 8 to 64 and :data:`REPEATS` repeats)."""
    if quick:
        return asyncio.run(_bench(32, (8, 16, 32), 2, settings))
    return asyncio.run(_bench(64, (8, 16, 32, 64), REPEATS, settings))


__all__ = ["bench_admission"]
