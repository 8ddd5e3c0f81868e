"""The body of one Ray rollout worker: a :class:`~fsm_rollout.runtime.runner.RolloutRunner` in an async actor.

Everything crossing the actor boundary is data: the configuration as :func:`config_to_data` writes it, samples as
``Sample.to_dict()``, metrics as plain dicts. The worker loads its own tokenizer, environment module and HTTP pool
when it starts. This module imports no Ray: the pool makes the class an actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import ConfigError
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.sample import Sample

Finished = tuple[int, dict[str, Any]]
"""A finished sample as a worker sends it back: its position in the call's batch and ``Sample.to_dict()``."""
Report = tuple[list[Finished], dict[str, Any]]
"""What a worker sends as samples finish: the finished samples and its metrics right after them."""


def config_to_data(config: RolloutConfig) -> dict[str, Any]:
    """``config`` as plain data for another process (:meth:`RolloutConfig.to_dict`, with the API key); refuses
    what only the trainer's process can hold."""
    if config.reward_fn is not None:
        raise ConfigError(
            "RolloutConfig.reward_fn is a callable, which does not cross to Ray workers: set rewards in the "
            "environment (env_path) or on the samples the pool returns"
        )
    return config.to_dict(include_api_key=True)


def config_from_data(data: Mapping[str, Any]) -> RolloutConfig:
    """The config :func:`config_to_data` wrote (:meth:`RolloutConfig.from_dict`)."""
    return RolloutConfig.from_dict(data)


def worker_trace_path(trace: str | None, index: int) -> str | None:
    """Worker ``index``'s trace file: ``run.jsonl`` becomes ``run.worker<index>.jsonl`` (and its tape beside it), so
    workers never append to one file; ``None``, ``off`` and ``stdout`` stay as they are."""
    if trace is None or trace in ("off", "stdout", "-"):
        return trace
    path = Path(trace)
    return str(path.with_name(f"{path.stem}.worker{index}{path.suffix}"))


class RolloutWorker:
    """One worker of a :class:`~fsm_rollout.distributed.RayRolloutPool` (the body of its actor).

    Batches are numbered by the pool. An abort names the last batch it covers, and a batch of that number or
    lower that reaches the worker after the abort (Ray does not order an async actor's calls) is aborted as soon as
    its rollouts exist, so no sample the abort covered sends a request.
    """

    def __init__(self, config: Mapping[str, Any], sampling_params: Mapping[str, Any],
                 engine_urls: Sequence[str] | None) -> None:  # fmt: skip
        self._config = config_from_data(config)
        self._sampling_params = dict(sampling_params)
        self._engine_urls = list(engine_urls) if engine_urls else None
        self._runner: RolloutRunner | None = None
        self._aborted_through = -1
        self._abort_reason = "cancelled"
        self._batches: dict[int, list[Sample]] = {}
        """Each running batch's samples, by number (:meth:`abort_batch` ends them)."""

    @property
    def runner(self) -> RolloutRunner:
        if self._runner is None:
            raise RuntimeError("the rollout worker has not started")
        return self._runner

    async def start(self) -> dict[str, Any]:
        """Load the tokenizer and the environment module, open the HTTP pool; where the worker runs."""
        runner = RolloutRunner(self._config, sampling_params=self._sampling_params, engine_urls=self._engine_urls)
        await runner.__aenter__()
        self._runner = runner
        return {"pid": os.getpid()}

    async def stop(self) -> None:
        """Abort what is unfinished (reason ``shutdown``) and close the runner."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.__aexit__(None, None, None)

    async def run_batch(
        self,
        number: int,
        samples: Sequence[Mapping[str, Any]],
        sample_ids: Sequence[str | None],
        seeds: Sequence[int | None],
        concurrency: int,
    ) -> AsyncIterator[Report]:
        """Run the samples (``Sample.to_dict()`` data), at most ``concurrency`` at once, named and seeded by
        position; yields the finished ones as they finish (every sample that finished since the last yield, so a
        busy worker sends few messages), each time with the worker's metrics (:meth:`metrics`)."""
        records = [Sample.from_dict(data) for data in samples]
        self._batches[number] = records
        # the runner returns the very objects it was given: their identity tells each one's position
        positions = {id(sample): position for position, sample in enumerate(records)}
        stream = self.runner.stream(records, concurrency=concurrency, sample_ids=sample_ids, seeds=seeds)
        if number <= self._aborted_through:
            await self.runner.abort(self._abort_reason)
        finished: list[Finished] = []
        ready = asyncio.Event()
        ended = False

        async def collect() -> None:
            nonlocal ended
            try:
                async for sample in stream:
                    finished.append((positions[id(sample)], sample.to_dict()))
                    ready.set()
            finally:
                ended = True
                ready.set()

        collector = asyncio.ensure_future(collect())
        try:
            while not (ended and not finished):
                await ready.wait()
                ready.clear()
                if finished:
                    batch, finished[:] = list(finished), []
                    yield batch, self.metrics()
            await collector  # raises what the collector raised
        finally:
            collector.cancel()
            self._batches.pop(number, None)

    async def abort(self, reason: str, through: int) -> dict[str, Any]:
        """End every unfinished sample of batches up to ``through`` ``aborted`` with ``reason``; the metrics
        after."""
        if through > self._aborted_through:
            self._aborted_through, self._abort_reason = through, reason
        await self.runner.abort(reason)
        return self.metrics()

    async def abort_batch(self, number: int, reason: str) -> dict[str, Any]:
        """End batch ``number``'s unfinished samples ``aborted`` with ``reason`` (a pool's surplus group); the
        metrics after."""
        await self.runner.abort_samples(self._batches.get(number, ()), reason)
        return self.metrics()

    def consumed(self, version: int | str) -> None:
        """The trainer consumed weight version ``version`` (the runner's staleness pacing)."""
        self.runner.consumed(version)

    async def suspend(self, reason: str) -> dict[str, Any]:
        """Suspend the runner's rollouts; what it cost (``SuspendStats`` as a dict) and the metrics after."""
        await self.runner.suspend(reason)
        return {"suspension": dataclasses.asdict(self.runner.last_suspension), "metrics": self.metrics()}

    async def resume(self) -> dict[str, Any]:
        """Resume them; as :meth:`suspend` answers."""
        await self.runner.resume()
        return {"suspension": dataclasses.asdict(self.runner.last_suspension), "metrics": self.metrics()}

    async def set_weight_version(self, version: str) -> None:
        await self.runner.suspender.set_weight_version(version)

    def metrics(self) -> dict[str, Any]:
        return dataclasses.asdict(self.runner.metrics())
