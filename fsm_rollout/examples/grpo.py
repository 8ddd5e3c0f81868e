"""GRPO on the CPU: the embedded engine samples, a torch copy of the same tiny model learns, the weights go back.

Run it with ``python -m fsm_rollout.examples.grpo [--steps N] [--async]`` (``--help`` lists every flag and its default).
It is the loop a user of the library would write: groups of rollouts (``runner.run_group``), group-normalised
advantages, a clipped policy-gradient loss over the trainable tokens (``loss_mask == 1``) with importance ratios
against the engine's ``rollout_log_probs``, an optimizer step, and the new weights pushed inside
``runner.weight_update``. Before each step every trainable token's logprob is recomputed with the weights that
sampled it (read from the sample's weight-version spans): the gap to the engine's number is the train/inference
mismatch a shifted token, a wrong mask or a re-tokenised turn would show; it should be float32 noise. ``--async``
starts the next step's rollouts before this one trains, so the update lands while they are in flight (the runner
suspends and resumes them) and their older tokens are recomputed with a kept copy of the older weights.

What only the tiny model needs (the question screen, the vocabulary rows that may learn, the environment) is in
:mod:`fsm_rollout.examples.grpo_tiny`. Each step prints one line; the last line is a JSON object with ``steps``,
``reward_first``, ``reward_last``, ``logprob_gap_mean``, ``logprob_gap_max`` and ``minutes``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, training_sequences, weight_staleness
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.examples.grpo_cli import GRPOOptions, GRPORun, StepReport, parse_args
from fsm_rollout.examples.grpo_cli import summary as summarize
from fsm_rollout.examples.grpo_tiny import build_env, learn_live_vocabulary_rows, screen

__all__ = ["GRPOOptions", "GRPORun", "Trainer", "main", "parse_args", "train"]


def token_logprobs(model: Any, sample: Sample, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """log p(token) of the response tokens at ``positions`` under ``model`` (temperature 1), over the tokenizer's
    ``vocab`` ids only, as the embedded engine never samples the embedding's padding rows."""
    tokens = torch.tensor([sample.tokens], dtype=torch.long)
    before = torch.tensor([len(sample.tokens) - sample.response_length + p - 1 for p in positions], dtype=torch.long)
    logits = model.lm_head(model.model(input_ids=tokens).last_hidden_state[0][before]).float()[:, :vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[0, before + 1].unsqueeze(1)).squeeze(1)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's advantages: rewards centred on the group mean and scaled by its standard deviation (0 when flat)."""
    mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [0.0 if spread == 0 else (reward - mean) / (spread + 1e-6) for reward in rewards]


class Trainer:
    """The policy (a transformers copy of the served model), its optimizer, and frozen copies of recent versions."""

    def __init__(self, model_dir: Path, options: GRPOOptions) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = options
        self.vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))
        self.policy: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.policy.train()  # Qwen2 has no dropout: train mode computes what eval mode does
        learn_live_vocabulary_rows(self.policy, enabled=options.train_live_rows)
        trainable = [parameter for parameter in self.policy.parameters() if parameter.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(trainable, lr=options.learning_rate, momentum=0.9) if options.optimizer == "sgd"
            else torch.optim.AdamW(trainable, lr=options.learning_rate, weight_decay=0.0)
        )  # fmt: skip
        self.version, self.history = "0", ["0"]
        self._old: dict[str, Any] = {}  # version -> a frozen copy of the model with that version's weights

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.policy.state_dict().items()}

    def step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> tuple[list[float], int]:
        """One optimizer step; returns every trainable token's |rollout logprob - recomputed| and the stale tokens."""
        total = sum(sum(sample.loss_mask or []) for sample in samples) or 1
        gaps: list[float] = []
        stale = 0
        self.optimizer.zero_grad(set_to_none=True)
        for sample, advantage in zip(samples, advantages, strict=True):
            positions = [position for position, bit in enumerate(sample.loss_mask or []) if bit == 1]
            if not positions:
                continue
            rollout = torch.tensor([(sample.rollout_log_probs or [])[position] for position in positions])
            current = token_logprobs(self.policy, sample, positions, self.vocab)
            # the gap is taken with the weights that sampled each token: older versions from their frozen copies
            sampled_by = {p: str(span["version"]) for span in sample.metadata.get("weight_version_spans") or []
                          for p in range(span["start"], span["end"])}  # fmt: skip
            behind = [index for index, position in enumerate(positions) if sampled_by.get(position) != self.version]
            recomputed = current.detach().clone()
            for version in sorted({sampled_by[positions[index]] for index in behind}):
                indices = [index for index in behind if sampled_by[positions[index]] == version]
                with torch.no_grad():
                    recomputed[indices] = token_logprobs(
                        self._frozen(version), sample, [positions[index] for index in indices], self.vocab
                    )
            stale += len(behind)
            gaps.extend((recomputed - rollout).abs().tolist())
            if advantage != 0.0:  # the loss uses the current policy, with ratios against the rollout's logprobs
                ratio = torch.exp(current - rollout)
                clipped = ratio.clamp(1 - self.options.clip, 1 + self.options.clip)
                (-torch.minimum(ratio * advantage, clipped * advantage).sum() / total).backward()  # type: ignore[no-untyped-call, unused-ignore]
        torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.requires_grad], 1.0)
        if self.options.asynchronous:  # samples still in flight carry tokens of this version
            frozen = copy.deepcopy(self.policy).eval().requires_grad_(False)
            self._old = {self.version: frozen, **{v: m for v, m in self._old.items() if v in self.history[-2:]}}
        self.optimizer.step()
        self.version = str(int(self.version) + 1)
        self.history.append(self.version)
        return gaps, stale

    def _frozen(self, version: str) -> Any:
        if version not in self._old:
            raise RuntimeError(f"no weights kept for version {version}: the sample is staler than the trainer keeps")
        return self._old[version]


def sampling_params(options: GRPOOptions) -> dict[str, Any]:
    """Temperature 1 (the loss's logprobs are the sampler's), each turn ending at its tool call."""
    return {"max_new_tokens": options.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "stop": ["</tool_call>"],
            "no_stop_trim": True}  # fmt: skip


def runner_for(engine: LocalEngine, model_dir: Path, options: GRPOOptions) -> RolloutRunner:
    """The runner of the example's rollouts on ``engine`` (weight updates suspend rollouts in flight: ``abort``)."""
    config = RolloutConfig(
        engine_url=engine.url, model=engine.served_model_name, tokenizer_path=str(model_dir),
        image_merge_size=engine.image_merge_size, max_turns=options.max_turns, weight_update_strategy="abort",
    )  # fmt: skip
    return RolloutRunner(config, sampling_params=sampling_params(options), env_factory=options.env_factory or build_env)


async def rollout_step(runner: RolloutRunner, questions: Sequence[Sample], step: int, options: GRPOOptions
                       ) -> tuple[list[list[Sample]], float]:  # fmt: skip
    """One step's groups, ``options.groups`` questions taken in turn from the pool; and the wall time."""
    started = time.perf_counter()
    chosen = [questions[(step * options.groups + index) % len(questions)] for index in range(options.groups)]
    # a seed per group (its members add their position): the same run samples the same tokens, members differ
    seeds = [((options.seed * 100_003 + step) * 1_009 + index) * options.group_size for index in range(len(chosen))]
    groups = await asyncio.gather(*(runner.run_group(question, options.group_size, seed=seed)
                                    for question, seed in zip(chosen, seeds, strict=True)))  # fmt: skip
    return list(groups), time.perf_counter() - started


def training_batch(groups: Sequence[Sequence[Sample]], trainer: Trainer, options: GRPOOptions
                   ) -> tuple[list[Sample], list[float], int]:  # fmt: skip
    """The training sequences to learn from with their advantages, and how many rollouts were dropped as too stale.

    The advantage is the rollout's: a rollout that forked gives each of its sequences (``training_sequences``) the
    same one, so a rollout counts once in its group however many sequences it has."""
    samples, advantages, dropped = [], [], 0
    for group in groups:
        for sample, advantage in zip(group, group_advantages([s.reward or 0.0 for s in group]), strict=True):
            sequences = training_sequences([sample])
            staleness = max(weight_staleness(seq, trainer.version, history=trainer.history) for seq in sequences)
            if staleness > options.max_staleness:
                dropped += 1  # the trainer's choice: too far off-policy to learn from
            else:
                samples.extend(sequences)
                advantages.extend([advantage] * len(sequences))
    return samples, advantages, dropped


async def train(options: GRPOOptions, *, out: Any = sys.stdout) -> GRPORun:
    """Run the loop; print a line per step and the final JSON object to ``out``."""
    torch.manual_seed(options.seed)
    model_dir = options.model_dir if options.model_dir is not None else await asyncio.to_thread(default_model_dir)
    started = time.perf_counter()
    candidates = practice_samples(max(options.groups, options.candidates), seed=options.question_seed,
                                  kinds=options.kinds)  # fmt: skip
    reports: list[StepReport] = []
    trainer = await asyncio.to_thread(Trainer, model_dir, options)
    first_weights = trainer.weights()
    async with LocalEngine(model_dir=model_dir, served_model_name="policy") as engine:
        await engine.update_weight_version(trainer.version)
        async with runner_for(engine, model_dir, options) as runner:
            questions = await screen(runner, candidates, options, out=out)
            pending = asyncio.ensure_future(rollout_step(runner, questions, 0, options))
            for step in range(options.steps):
                groups, rollout_s = await pending
                if options.asynchronous and step + 1 < options.steps:  # in flight while this step trains
                    pending = asyncio.ensure_future(rollout_step(runner, questions, step + 1, options))
                trained_at = time.perf_counter()
                samples, advantages, dropped = training_batch(groups, trainer, options)
                # off the event loop, which keeps serving the rollouts in flight
                gaps, stale = await asyncio.to_thread(trainer.step, samples, advantages)
                report = StepReport.of(step, groups, gaps, stale=stale, dropped=dropped, rollout_s=rollout_s,
                                       started=trained_at)  # fmt: skip
                # the new weights reach the engine; samples in flight are suspended meanwhile
                suspensions_before = runner.metrics().suspensions
                async with runner.weight_update(version=trainer.version):
                    await engine.load_weights(trainer.weights(), version=trainer.version)
                report.suspended = runner.metrics().suspensions - suspensions_before
                reports.append(report)
                print(report.line(), file=out, flush=True)
                if not options.asynchronous and step + 1 < options.steps:
                    pending = asyncio.ensure_future(rollout_step(runner, questions, step + 1, options))
    summary = summarize(reports, time.perf_counter() - started)
    print(json.dumps(summary), file=out, flush=True)
    final = trainer.weights()
    change = max(float((final[name] - value).abs().max()) for name, value in first_weights.items())
    return GRPORun(summary, reports, change)


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(train(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
