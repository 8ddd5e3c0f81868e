"""What the adapter tests share: a recorded run on the fake engine, then its replay and its ``inspect`` text."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, get_tracer
from fsm_rollout.replay import replay_async
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0}


async def run_recorded(
    tokenizer: Any,
    tmp_path: Path,
    env_factory: Any,
    samples: Sequence[Sample],
    turns: Sequence[ScriptedTurn],
    **config: Any,
) -> list[Sample]:
    """Run ``samples`` one at a time against the fake engine answering ``turns``, with a trace and a tape."""
    async with FakeVLLMServer(tokenizer) as server:
        server.script(list(turns))
        values: dict[str, Any] = {
            "engine_url": server.url,
            "model": server.model,
            "max_turns": 4,
            "check_invariants": True,
            "trace": str(tmp_path / "run.jsonl"),
            "record": True,
        }
        values.update(config)
        async with RolloutRunner(
            RolloutConfig(**values), sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=env_factory
        ) as runner:
            done = await runner.run_batch(list(samples), concurrency=1)
    get_tracer(str(tmp_path / "run.jsonl")).close()
    return list(done)


async def replay_counts(tokenizer: Any, tmp_path: Path) -> dict[str, int]:
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.exit_code == 0, report.render(verbose=True)
    return dict(report.counts())


async def inspect_text(tmp_path: Path, sample_id: str = "0") -> str:
    """What ``fsm-rollout inspect`` prints for one sample of the run."""
    from fsm_rollout.cli import main

    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return main(["inspect", str(tmp_path / "run.jsonl"), "--sample", sample_id, "--color", "never"])

    assert await asyncio.to_thread(run) == 0
    return out.getvalue()
