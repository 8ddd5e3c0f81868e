"""The ``slow-env`` workload: samples whose environment step takes 50 ms, run inline, in the worker pool, and as a
coroutine, against the canned server, side by side with the same batch whose steps take no time.

An inline synchronous step blocks the event loop: every other sample waits, the loop lags by the whole step and the
batch takes ``samples x turns x 50 ms``, so that case runs with fewer samples (its figures scale linearly). With
``env_executor="thread"`` (one worker per sample) or an async step the steps overlap: the loop keeps turning and the
batch takes about ``turns x 50 ms`` beyond the sleep-free batch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fsm_rollout.cli.bench.params import PROMPT, SAMPLING, Settings
from fsm_rollout.cli.bench.rollouts import LoopMonitor

STEP_S = 0.05
TURNS = 2
INLINE_SAMPLES = 40
"""The inline case blocks the loop for every step: 1,000 samples would take 100 s."""


class _SleepingEnv:
    """Two turns; ``step`` takes ``STEP_S`` as the case says: blocking its thread, or awaiting."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.turns = 0

    def reset(self) -> None:
        self.turns = 0

    def _result(self) -> tuple[str, bool, dict[str, Any]]:
        self.turns += 1
        return "Try again.", self.turns >= TURNS, {}

    def step(self, text: str) -> Any:
        if self.mode == "async":
            return self._step_async()
        if self.mode != "none":
            time.sleep(STEP_S)
        return self._result()

    async def _step_async(self) -> tuple[str, bool, dict[str, Any]]:
        await asyncio.sleep(STEP_S)
        return self._result()

    def format_observation(self, observation: Any) -> dict[str, str]:
        return {"role": "user", "content": str(observation)}

    def close(self) -> None:
        """Nothing to release."""


def _run(url: str, tokenizer: Any, settings: Settings, samples: int, mode: str) -> dict[str, float]:
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample

    executor = "thread" if mode == "thread" else "inline"
    config = RolloutConfig(
        engine_url=url,
        model="fake-model",
        max_turns=TURNS + 1,
        env_executor=executor,
        env_max_workers=max(samples, 1),
        loop_slice_ms=settings.loop_slice_ms,
        tune_gc=settings.tune_gc,
    )

    async def main() -> dict[str, float]:
        client = VLLMClient.from_config(config)
        monitor = LoopMonitor()
        rollouts = [
            Rollout(
                Sample(prompt=PROMPT, index=i),
                config=config,
                sampling_params=SAMPLING,
                client=client,
                tokenizer=tokenizer,
                env_factory=lambda **_: _SleepingEnv(mode),
            )
            for i in range(samples)
        ]
        monitor.start()
        wall = time.perf_counter()
        results = await asyncio.gather(*(rollout.run() for rollout in rollouts), return_exceptions=True)
        wall = time.perf_counter() - wall
        await monitor.stop()
        await client.close()
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise RuntimeError(f"bench: {len(errors)} rollout(s) failed, first: {errors[0]!r}")
        return {
            "samples": float(samples),
            "wall_s": wall,
            "loop_lag_p99_ms": monitor.lag_p99_ms(),
            "loop_lag_max_ms": max(monitor.lags, default=0.0) * 1000.0,
        }

    return asyncio.run(main())


def bench_slow_environments(url: str, tokenizer: Any, settings: Settings, samples: int) -> dict[str, float]:
    """The four cases' walls and loop lags, and each overlapping case's wall beyond the sleep-free batch."""
    figures: dict[str, float] = {
        "samples": float(samples),
        "turns": float(TURNS),
        "step_ms": STEP_S * 1000.0,
        "inline_samples": float(min(samples, INLINE_SAMPLES)),
    }
    # The pool starts its threads on the first batch that needs them (each start waits for the new thread): that
    # batch is reported apart as "cold", and the figures are a later batch's, as a trainer's pool is after one step.
    cold = _run(url, tokenizer, settings, samples, "thread")
    figures["thread_cold_wall_s"] = cold["wall_s"]
    figures["thread_cold_loop_lag_p99_ms"] = cold["loop_lag_p99_ms"]
    for mode, count in (
        ("none", samples),
        ("thread", samples),
        ("async", samples),
        ("inline", min(samples, INLINE_SAMPLES)),
    ):
        for name, value in _run(url, tokenizer, settings, count, mode).items():
            if name != "samples":
                figures[f"{mode}_{name}"] = value
    for mode in ("thread", "async"):
        figures[f"{mode}_wall_beyond_sleep_free_s"] = figures[f"{mode}_wall_s"] - figures["none_wall_s"]
    figures["inline_serial_wall_s_at_samples"] = figures["inline_wall_s"] / figures["inline_samples"] * samples
    return figures
