"""The ``oversample`` workload (``--only oversample``): wall time to N complete groups with 25 % over-sampling
against none, on the embedded engine, both in one run.

A long-tail agent workload: groups of :data:`GROUP` samples per prompt; most samples take one or two short turns
with quick tool calls, and one in :data:`TAIL_ONE_IN` is a straggler whose tool calls take seconds (a slow sandbox,
a retried API). Every draw is seeded by the sample, so each run gets the same workload. A group is complete when
its slowest member is, so one straggler holds its whole group back. Without over-sampling the batch is the N groups
wanted and ends when the last of them completes; with ``oversample=N/4`` the batch starts N + N/4 groups
(``run_batch(target_groups=N, oversample=M)``) and ends once N are complete, the surplus ending ``aborted`` with
reason ``oversampled``. Both run against one engine, one after the other, every group in flight at once.

Figures: each run's wall time to N complete groups, the groups the over-sampled run cut, and the ratio of the two
walls (none over over-sampled: above 1 is time saved).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from fsm_rollout.cli.bench.admission import PROMPTS
from fsm_rollout.cli.bench.params import Settings
from fsm_rollout.envs.step import NextCall, StepResult

GROUP = 4
TURN_TOKENS = (4, 16)
QUICK_TOOL_S = (0.0, 0.3)
SLOW_TOOL_S = (4.0, 8.0)
TAIL_ONE_IN = 16


class TailEnv:
    """One or two turns with tool calls; a straggler's tool calls are slow (all drawn from the sample's seed)."""

    def __init__(self, rng: random.Random, end_ids: list[int]) -> None:
        self.rng = rng
        self.bias = {str(token): -100.0 for token in end_ids}
        self.turns = rng.randint(1, 2)
        self.tool_s = SLOW_TOOL_S if rng.randrange(TAIL_ONE_IN) == 0 else QUICK_TOOL_S
        self.turn = 0

    def _call(self) -> NextCall:
        return NextCall(sampling={"max_tokens": self.rng.randint(*TURN_TOKENS), "logit_bias": self.bias})

    def reset(self) -> StepResult:
        return StepResult(observation=None, next_call=self._call())

    async def step(self, text: str) -> StepResult:
        await asyncio.sleep(self.rng.uniform(*self.tool_s))
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult(observation=None, done=True, reward=1.0)
        return StepResult(observation=f"tool output {self.turn}: 42", next_call=self._call())

    def format_observation(self, observation: Any) -> Any:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        return None


async def _one_run(engine: Any, tokenizer: Any, settings: Settings, groups: int, oversample: int) -> dict[str, float]:
    from fsm_rollout import RolloutConfig, Sample, Status
    from fsm_rollout.runtime.runner import RolloutRunner, group_members
    from fsm_rollout.runtime.sampling import SampledBatch

    end_ids = sorted(
        {
            token
            for token in (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
            if isinstance(token, int) and token != tokenizer.unk_token_id
        }
    )
    config = RolloutConfig(engine_url=engine.url, model=engine.served_model_name, max_turns=3,
                           loop_slice_ms=settings.loop_slice_ms, tune_gc=settings.tune_gc,
                           history_policy="append")  # fmt: skip

    def build_env(*, sample: Any, args: Any) -> TailEnv:
        return TailEnv(random.Random(f"{sample.group_index}.{sample.metadata['group_member']}"), end_ids)

    batch: list[Any] = []
    ids: list[str | None] = []
    for index in range(groups + oversample):
        copies, names = group_members(Sample(prompt=PROMPTS[index % len(PROMPTS)], index=index), GROUP)
        batch += copies
        ids += names
    sampling = {"max_new_tokens": 1024, "temperature": 1.0, "top_p": 1.0}
    async with RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer, env_factory=build_env) as runner:
        started = time.perf_counter()
        done = await runner.run_batch(batch, concurrency=len(batch), sample_ids=ids, target_groups=groups,
                                      oversample=oversample)  # fmt: skip
        wall = time.perf_counter() - started
    assert isinstance(done, SampledBatch)
    if done.kept_groups != groups or any(sample.status == Status.FAILED for sample in done):
        raise RuntimeError(f"oversample bench: {done.kept_groups} of {groups} groups complete, or samples failed")
    return {"wall_s": wall, "surplus_groups": float(done.surplus_groups)}


async def _bench(groups: int, settings: Settings) -> dict[str, float]:
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import default_model_dir
    from fsm_rollout.tokens.tokenizers import load_tokenizer

    model_dir = await asyncio.to_thread(default_model_dir)
    tokenizer = await asyncio.to_thread(load_tokenizer, str(model_dir))
    extra = max(1, groups // 4)
    async with LocalEngine(model_dir, max_num_seqs=(groups + extra) * GROUP) as engine:
        none = await _one_run(engine, tokenizer, settings, groups, 0)
        over = await _one_run(engine, tokenizer, settings, groups, extra)
    return {
        "groups": float(groups),
        "oversample_groups": float(extra),
        "none_wall_s": none["wall_s"],
        "oversampled_wall_s": over["wall_s"],
        "oversampled_surplus_groups": over["surplus_groups"],
        "none_vs_oversampled_wall": none["wall_s"] / over["wall_s"],
    }


def bench_oversample(quick: bool, settings: Settings) -> dict[str, float]:
    """The workload's figures (``quick``: 8 groups and 2 more; else 16 and 4 more)."""
    return asyncio.run(_bench(8 if quick else 16, settings))


__all__ = ["bench_oversample"]
