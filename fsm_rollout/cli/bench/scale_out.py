"""The ``scale_out`` workload (``--only scale-out``): one RolloutRunner against a RayRolloutPool of two workers on a
local Ray cluster, the same batch of three-turn samples against the canned server, and what the pool adds per
sample in the trainer's process (serialisation and actor calls).

The runner and the pool's workers run with the same config; each side runs a warm-up batch first (imports,
connection pools, the workers' start), then ``repeats`` timed batches, and the figures are the median run's.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from typing import Any

from fsm_rollout.cli.bench.params import PROMPT, SAMPLING, SCALE_TURNS, Settings

WORKERS = 2
ENV_PATH = "fsm_rollout.testing.envs"
"""Scripted environments: never done, so every sample runs ``SCALE_TURNS`` turns."""


def _config(url: str, settings: Settings) -> Any:
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    return RolloutConfig(engine_url=url, model="fake-model", max_turns=SCALE_TURNS, env_path=ENV_PATH,
                         tokenizer_path=str(qwen_tokenizer_dir()), loop_slice_ms=settings.loop_slice_ms,
                         tune_gc=settings.tune_gc)  # fmt: skip


def _samples(n: int) -> list[Any]:
    from fsm_rollout.sample import Sample

    return [Sample(prompt=PROMPT, index=i) for i in range(n)]


def _timed(done: list[Any], wall: float, cpu: float) -> dict[str, float]:
    failed = [sample for sample in done if sample.status.value != "truncated"]
    if failed:
        raise RuntimeError(f"bench: {len(failed)} sample(s) did not run their {SCALE_TURNS} turns: {failed[0]!r}")
    return {"wall_s": wall, "driver_cpu_s": cpu}


async def _runner_runs(url: str, settings: Settings, samples: int, repeats: int) -> list[dict[str, float]]:
    from fsm_rollout.runtime.runner import RolloutRunner

    runs = []
    async with RolloutRunner(_config(url, settings), sampling_params=SAMPLING) as runner:
        await runner.run_batch(_samples(min(samples, 100)), concurrency=samples)
        for _ in range(repeats):
            batch = _samples(samples)
            wall, cpu = time.perf_counter(), time.process_time()
            done = await runner.run_batch(batch, concurrency=samples)
            runs.append(_timed(done, time.perf_counter() - wall, time.process_time() - cpu))
    return runs


async def _pool_runs(url: str, settings: Settings, samples: int, repeats: int) -> list[dict[str, float]]:
    from fsm_rollout.distributed import RayRolloutPool

    runs = []
    with tempfile.TemporaryDirectory(prefix="fsm-ray-") as ray_dir:
        ray_init = {"num_cpus": WORKERS, "_temp_dir": ray_dir, "log_to_driver": False}
        async with RayRolloutPool(_config(url, settings), sampling_params=SAMPLING, num_workers=WORKERS,
                                  ray_init=ray_init) as pool:  # fmt: skip
            per_worker = -(-samples // WORKERS)
            await pool.run_batch(_samples(min(samples, 100)), concurrency=per_worker)
            for _ in range(repeats):
                batch = _samples(samples)
                wall, cpu = time.perf_counter(), time.process_time()
                done = await pool.run_batch(batch, concurrency=per_worker)
                runs.append(_timed(done, time.perf_counter() - wall, time.process_time() - cpu))
    return runs


def _serialise_us(samples: int) -> float:
    """A finished sample's round trip as the pool moves it: to_dict and from_dict out, and again back."""
    from fsm_rollout.sample import Sample

    finished = _samples(samples)
    for sample in finished:
        sample.tokens = list(range(120))
        sample.loss_mask = [1] * 90
        sample.rollout_log_probs = [-0.01] * 90
        sample.response_length = 90
    started = time.process_time()
    for sample in finished:
        Sample.from_dict(Sample.from_dict(sample.to_dict()).to_dict())
    return (time.process_time() - started) / samples * 1e6


def bench_scale_out(url: str, settings: Settings, samples: int, repeats: int) -> dict[str, float]:
    """The runner's and the pool's walls (median of ``repeats``), throughput ratio, the pool's CPU per sample in the
    trainer's process, and a sample's serialisation round trip."""
    runner = sorted(asyncio.run(_runner_runs(url, settings, samples, repeats)), key=lambda r: r["wall_s"])
    pool = sorted(asyncio.run(_pool_runs(url, settings, samples, repeats)), key=lambda r: r["wall_s"])
    one, two = runner[len(runner) // 2], pool[len(pool) // 2]
    return {
        "samples": float(samples),
        "turns_per_sample": float(SCALE_TURNS),
        "workers": float(WORKERS),
        "runner_wall_s": one["wall_s"],
        "runner_samples_per_s": samples / one["wall_s"],
        "pool_wall_s": two["wall_s"],
        "pool_samples_per_s": samples / two["wall_s"],
        "pool_wall_s_least": pool[0]["wall_s"],
        "pool_wall_s_greatest": pool[-1]["wall_s"],
        "runner_wall_s_least": runner[0]["wall_s"],
        "runner_wall_s_greatest": runner[-1]["wall_s"],
        "throughput_ratio": one["wall_s"] / two["wall_s"],
        "pool_driver_cpu_us_per_sample": two["driver_cpu_s"] / samples * 1e6,
        "runner_cpu_us_per_sample": one["driver_cpu_s"] / samples * 1e6,
        "serialise_round_trip_us_per_sample": _serialise_us(min(samples, 2_000)),
        "pool_wall_s_median_of_all": statistics.median(r["wall_s"] for r in pool),
    }
