"""The ``mismatch`` workload (``--only mismatch``): certify the train/inference mismatch on the embedded engine, and
time :func:`fsm_rollout.mismatch`.

* The certification run: the GRPO example's rollouts (practice questions, groups, temperature 1) on the embedded
  engine with the default model; then a trainer's recomputation of every trained token's logprob with the same
  model in torch (:class:`fsm_rollout.examples.grpo.Trainer`'s forward and LM head), and
  :func:`fsm_rollout.mismatch` of the two. It runs twice: without a weight update, and with one landing mid-run
  (the same weights under version 1, so the runner suspends and resumes the rollouts in flight and their later
  tokens carry the new version): the resumed turns are reported apart, with their staleness. Each run prints its
  event table; the figures are K3 and max ``|Δ|`` overall, on tokens before a resume and after one. The goal: K3
  ≤ 1e-6 on turns without a resume.
* The speed: :func:`fsm_rollout.mismatch` on 10,000 sequences of 1,000 response tokens (``quick``: 2,000), with
  weight-version and routed-expert spans, wall and CPU time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from fsm_rollout import MismatchReport, Sample, mismatch, training_sequences


def synthetic_batch(count: int, length: int, *, seed: int = 0) -> tuple[list[Sample], list[list[float]]]:
    """``count`` sequences of ``length`` response tokens (two turns around an observation, a resume between two
    weight versions, routes from two requests) and trainer logprobs near the rollout's."""
    rng = np.random.default_rng(seed)
    first, second = length * 2 // 5, length // 2
    cut = second + length // 10
    samples, trainer = [], []
    for index in range(count):
        sample = Sample(index=index, group_index=index // 8, tokens=[1] * (50 + length), response_length=length)
        sample.loss_mask = [1] * first + [0] * (second - first) + [1] * (length - second)
        rollout = rng.normal(-1.0, 0.5, length)
        sample.rollout_log_probs = rollout.tolist()
        sample.metadata = {
            "start_weight_version": "3",
            "weight_version_spans": [{"version": "3", "start": 0, "end": cut}, {"version": "4", "start": cut,
                                                                               "end": length}],
            "routed_expert_spans": [{"request_id": "a", "start": 0, "end": 50 + cut},
                                    {"request_id": "b", "start": 50 + cut, "end": 50 + length}],
        }  # fmt: skip
        samples.append(sample)
        trainer.append((rollout + rng.normal(0.0, 0.01, length)).tolist())
    return samples, trainer


def speed_figures(quick: bool) -> dict[str, float]:
    samples, trainer = synthetic_batch(2_000 if quick else 10_000, 1_000)
    wall, cpu = time.perf_counter(), time.process_time()
    mismatch(samples, trainer, trainer_version="5")
    return {
        "speed_sequences": float(len(samples)),
        "speed_mismatch_s": time.perf_counter() - wall,
        "speed_mismatch_cpu_s": time.process_time() - cpu,
    }


async def _rollouts(update: bool, quick: bool) -> tuple[list[Sample], str]:
    """The demo's groups on the embedded engine; with ``update``, a weight update (same weights, version 1) lands
    once the first turns are done, while the others are in flight."""
    from fsm_rollout.data.practice import practice_samples
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import default_model_dir
    from fsm_rollout.examples.grpo import GRPOOptions, runner_for

    options = GRPOOptions(max_new_tokens=48 if quick else 96)
    model_dir = default_model_dir()
    questions = practice_samples(2 if quick else 4, seed=7)
    weights = engine_weights(model_dir) if update else {}
    async with LocalEngine(model_dir=model_dir, served_model_name="policy") as engine:
        await engine.update_weight_version("0")
        async with runner_for(engine, model_dir, options) as runner:
            batch = asyncio.gather(*(runner.run_group(question, 4, seed=100 + index)
                                     for index, question in enumerate(questions)))  # fmt: skip
            if not update:
                return [s for group in await batch for s in group], "0"
            # a bench, not a test: poll until the first turns are done, the others in flight
            while runner.metrics().turns < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            async with runner.weight_update(version="1"):
                await engine.load_weights(weights, version="1")
            return [s for group in await batch for s in group], "1"


def engine_weights(model_dir: Any) -> dict[str, Any]:
    """The default model's parameters, as a trainer would push them (unchanged)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: value.detach() for name, value in model.named_parameters()}


def recompute(rollouts: list[Sample], trainer_version: str) -> MismatchReport:
    """The trainer's logprobs of every trained token (the default model in torch) against the engine's."""
    import torch

    from fsm_rollout.engine.local.default_model import default_model_dir
    from fsm_rollout.examples.grpo import GRPOOptions, TrainableTokens, Trainer, token_logprobs, trained_values

    trainer = Trainer(default_model_dir(), GRPOOptions())
    sequences = training_sequences(rollouts)
    tokens = TrainableTokens.of(sequences, [0.0] * len(sequences))
    with torch.no_grad():
        values = token_logprobs(trainer.policy, trainer.vocabulary, tokens)
    return mismatch(rollouts, trained_values(sequences, values), trainer_version=trainer_version, engine="embedded")


def print_events(title: str, report: MismatchReport) -> None:
    print(f"[mismatch: {title}] {report.tokens} trained tokens, K3 {report.k3:.3e}, max |Δ| {report.max_abs_delta:.3e}")
    print(f"  {'dimension':<16}{'group':<28}{'tokens':>8}{'K3':>12}{'max |Δ|':>12}{'staleness':>11}")
    for group in report.events:
        staleness = "" if group.staleness is None else str(group.staleness)
        print(f"  {group.dimension:<16}{group.label:<28}{group.tokens:>8}{group.k3:>12.3e}{group.max_abs_delta:>12.3e}"
              f"{staleness:>11}")  # fmt: skip


def _resume(report: MismatchReport, label: str) -> tuple[float, float, float]:
    found = [g for g in report.events if g.dimension == "resume" and g.label == label]
    return (float(found[0].tokens), found[0].k3, found[0].max_abs_delta) if found else (0.0, 0.0, 0.0)


def certification_figures(quick: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, update in (("plain", False), ("update", True)):
        rollouts, version = asyncio.run(_rollouts(update, quick))
        report = recompute(rollouts, version)
        print_events("with a weight update mid-run" if update else "no weight update", report)
        before, after = _resume(report, "before_resume"), _resume(report, "after_resume")
        figures.update({
            f"{name}_tokens": float(report.tokens), f"{name}_k3": report.k3,
            f"{name}_max_abs_delta": report.max_abs_delta,
            f"{name}_no_resume_tokens": before[0], f"{name}_no_resume_k3": before[1],
            f"{name}_resumed_tokens": after[0], f"{name}_resumed_k3": after[1],
            f"{name}_resumed_max_abs_delta": after[2],
        })  # fmt: skip
    return figures


def bench_mismatch(quick: bool) -> dict[str, float]:
    """Every figure of the workload (see the module's docstring)."""
    return {**speed_figures(quick), **certification_figures(quick)}


__all__ = ["bench_mismatch", "certification_figures", "speed_figures", "synthetic_batch"]
