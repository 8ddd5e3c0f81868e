"""GRPO on the CPU: the embedded engine samples, a torch copy of the same tiny model learns, the weights go back.

Run it with ``python -m fsm_rollout.examples.grpo [--steps N] [--async]`` (``--help`` lists every flag and its default).
It is the loop a user of the library would write: groups of rollouts (``runner.run_group``), group-normalised
advantages, a clipped policy-gradient loss over the trainable tokens (``loss_mask == 1``) with importance ratios
against the engine's ``rollout_log_probs``, an optimizer step, and the new weights pushed inside
``runner.weight_update``. The trainer takes a step's samples in one right-padded forward and backward pass. Before
each step every trainable token's logprob is recomputed with the weights that sampled it (read from the sample's
weight-version spans): the gap to the engine's number is the train/inference mismatch a shifted token, a wrong mask
or a re-tokenised turn would show; it should be float32 noise. It is measured as a :class:`~fsm_rollout.MismatchReport`
(:func:`fsm_rollout.mismatch`): each step prints its K3 and its worst event group, and ``--correction tis|icepop``
weighs each token's loss with the report's TIS or IcePop weight (``none``: no correction). ``--tree``
trains from the step's token tree (:mod:`fsm_rollout.examples.grpo_tree`): a group's shared prompt goes through
the model once, not once per sample, with the same logprobs. ``--async``
starts the next step's rollouts before this one trains, so the update lands while they are in flight (the runner
suspends and resumes them) and their older tokens are recomputed with a kept copy of the older weights.

What only the tiny model needs (the question screen, the vocabulary rows that may learn and the LM head over them,
the environment) is in :mod:`fsm_rollout.examples.grpo_tiny`. Each step prints one line; the last line is a JSON
object with ``steps``, ``reward_first``, ``reward_last``, ``logprob_gap_mean``, ``logprob_gap_max`` and ``minutes``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsm_rollout import (
    MismatchReport,
    RolloutConfig,
    RolloutRunner,
    Sample,
    mismatch,
    training_sequences,
    weight_staleness,
)  # fmt: skip
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.examples.grpo_cli import GRPOOptions, GRPORun, StepReport, parse_args
from fsm_rollout.examples.grpo_cli import summary as summarize
from fsm_rollout.examples.grpo_tiny import LiveVocabulary, build_env, screen
from fsm_rollout.examples.grpo_tree import TreeTokens, tree_logprobs

__all__ = [
    "GRPOOptions", "GRPORun", "TrainableTokens", "Trainer", "clipped_loss", "main", "parse_args", "token_logprobs",
    "train",
]  # fmt: skip


@dataclass(frozen=True)
class TrainableTokens:
    """A step's trainable tokens (``loss_mask == 1``), one entry each, and their samples as one batch of token ids,
    right-padded (a causal model's outputs at the real positions do not see the padding after them)."""

    inputs: torch.Tensor  # (samples, longest sample) token ids
    row: torch.Tensor  # the token's sample (its row of ``inputs``)
    before: torch.Tensor  # the position whose logits give the token
    target: torch.Tensor  # the token's id
    rollout: torch.Tensor  # the engine's logprob of it
    advantage: torch.Tensor  # its sample's advantage
    version: list[str]  # the weight version that sampled it

    @classmethod
    def of(cls, samples: Sequence[Sample], advantages: Sequence[float]) -> TrainableTokens:
        inputs = torch.zeros((len(samples), max((len(s.tokens) for s in samples), default=1)), dtype=torch.long)
        row, before, rollout, advantage, version = [], [], [], [], []
        for index, (sample, sample_advantage) in enumerate(zip(samples, advantages, strict=True)):
            inputs[index, : len(sample.tokens)] = torch.tensor(sample.tokens)
            prompt = len(sample.tokens) - sample.response_length
            sampled_by = {p: str(span["version"]) for span in sample.metadata.get("weight_version_spans") or []
                          for p in range(span["start"], span["end"])}  # fmt: skip
            for position, bit in enumerate(sample.loss_mask or []):
                if bit == 1:
                    row.append(index)
                    before.append(prompt + position - 1)
                    rollout.append((sample.rollout_log_probs or [])[position])
                    advantage.append(sample_advantage)
                    version.append(sampled_by.get(position, ""))
        rows, befores = torch.tensor(row, dtype=torch.long), torch.tensor(before, dtype=torch.long)
        return cls(inputs, rows, befores, inputs[rows, befores + 1], torch.tensor(rollout), torch.tensor(advantage),
                   version)  # fmt: skip


def token_logprobs(policy: Any, vocabulary: LiveVocabulary, tokens: TrainableTokens,
                   which: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """log p(token) under ``policy`` (temperature 1) of the trainable tokens (those at indices ``which``; all by
    default): one forward pass over the samples that hold them, the LM head over the vocabulary's live rows."""
    which = torch.arange(len(tokens.target)) if which is None else which
    if not len(which):
        return torch.zeros(0)
    rows, row = torch.unique(tokens.row[which], return_inverse=True)
    inputs = tokens.inputs[rows]
    hidden = policy.model(inputs_embeds=vocabulary.embed(inputs)).last_hidden_state
    return vocabulary.logprobs(hidden[row, tokens.before[which]], tokens.target[which])


def clipped_loss(current: torch.Tensor, tokens: TrainableTokens, clip: float,
                 weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The clipped policy-gradient loss of ``current`` (the trainable tokens' logprobs under the policy), with
    importance ratios against the rollout's logprobs, each token's term times its mismatch correction ``weights``
    (none: 1), summed over the tokens of non-zero advantage and divided by the number of trainable tokens."""
    keep = tokens.advantage.ne(0)
    ratio = torch.exp(current[keep] - tokens.rollout[keep])
    advantage = tokens.advantage[keep]
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantage
    terms = torch.minimum(ratio * advantage, clipped)
    if weights is not None:
        terms = terms * weights[keep]
    return -terms.sum() / max(len(current), 1)


def trained_values(samples: Sequence[Sample], values: torch.Tensor) -> list[list[float]]:
    """Per-token ``values`` (one per trainable token, :class:`TrainableTokens` order) laid out per sequence over its
    response tokens, 0.0 where the loss mask is 0: what :func:`fsm_rollout.mismatch` reads."""
    flat, out, at = values.tolist(), [], 0
    for sample in samples:
        row = [0.0] * sample.response_length
        for position, bit in enumerate(sample.loss_mask or []):
            if bit == 1:
                row[position], at = flat[at], at + 1
        out.append(row)
    return out


def token_weights(samples: Sequence[Sample], report: MismatchReport, kind: str) -> torch.Tensor:
    """The report's ``kind`` weights of the trainable tokens, in :class:`TrainableTokens` order."""
    weights = report.weights(kind)  # type: ignore[arg-type]
    return torch.tensor([float(weights[index][position]) for index, sample in enumerate(samples)
                         for position, bit in enumerate(sample.loss_mask or []) if bit == 1])  # fmt: skip


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's advantages: rewards centred on the group mean and scaled by its standard deviation (0 when flat)."""
    mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [0.0 if spread == 0 else (reward - mean) / (spread + 1e-6) for reward in rewards]


class Trainer:
    """The policy (a transformers copy of the served model) with its vocabulary's live rows, its optimizer, and
    frozen copies of recent versions.

    A step is one batch, which suits the tiny model; a larger one would split it into micro-batches and add up their
    gradients (the loss is a sum over tokens)."""

    def __init__(self, model_dir: Path, options: GRPOOptions) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = options
        vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))
        self.policy: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.policy.train()  # Qwen2 has no dropout: train mode computes what eval mode does
        # only the vocabulary matrix's live rows learn, as a parameter of their own
        self.vocabulary = LiveVocabulary(self.policy, vocab, enabled=options.train_live_rows)
        self.trainable = [p for p in (*self.policy.parameters(), self.vocabulary.weight) if p.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(self.trainable, lr=options.learning_rate, momentum=0.9) if options.optimizer == "sgd"
            else torch.optim.AdamW(self.trainable, lr=options.learning_rate, weight_decay=0.0)
        )  # fmt: skip
        self.version, self.history = "0", ["0"]
        self.processed = (0, 0)  # the last step's tokens in the forward pass: flat rows, and what it ran
        self._old: dict[str, tuple[Any, LiveVocabulary]] = {}  # version -> frozen copies with that version's weights

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter and buffer."""
        return {name: value.detach().clone() for name, value in self.policy.state_dict().items()}

    def updated_weights(self) -> dict[str, torch.Tensor]:
        """The parameters an optimizer step changes, not copied: the engine copies them before its ``load_weights``
        returns."""
        return {name: value.detach() for name, value in self.policy.named_parameters()
                if value.requires_grad or (self.vocabulary.learns and value is self.vocabulary.matrix)}  # fmt: skip

    def step(self, samples: Sequence[Sample], advantages: Sequence[float],
             rollouts: Sequence[Sample] | None = None) -> tuple[MismatchReport, int]:  # fmt: skip
        """One optimizer step on ``samples``, the training sequences of ``rollouts`` (default: the samples, when
        none forked); returns the mismatch between the engine's logprobs and the recomputed ones, and the stale
        tokens."""
        tokens = TrainableTokens.of(samples, advantages)
        tree = TreeTokens.of(samples, rollouts, self.options.tree_max_tokens) if self.options.tree else None
        ran = tree.tree_tokens if tree is not None else int(tokens.inputs.numel())
        self.processed = (sum(len(sample.tokens) for sample in samples), ran)

        def logprobs(policy: Any, vocabulary: LiveVocabulary, which: torch.Tensor | None = None) -> torch.Tensor:
            if tree is None:  # the right-padded rows
                return token_logprobs(policy, vocabulary, tokens, which)
            return tree_logprobs(policy, vocabulary, tree, which)  # shared prefixes computed once

        learns = bool(tokens.advantage.ne(0).any())  # else no gradient, and the optimizer moves nothing
        self.optimizer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(learns):
            current = logprobs(self.policy, self.vocabulary)
        # the gap is taken with the weights that sampled each token: older versions from their frozen copies
        recomputed = current.detach().clone()
        behind = [index for index, version in enumerate(tokens.version) if version != self.version]
        for version in sorted({tokens.version[index] for index in behind}):
            which = torch.tensor([index for index in behind if tokens.version[index] == version])
            with torch.no_grad():
                recomputed[which] = logprobs(*self._frozen(version), which)
        report = mismatch(rollouts if rollouts is not None else samples, trained_values(samples, recomputed),
                          trainer_version=self.version, engine="embedded")  # fmt: skip
        correction = self.options.correction
        weights = None if correction == "none" else token_weights(samples, report, correction)
        if learns:  # the loss uses the current policy, with ratios against the rollout's logprobs
            loss = clipped_loss(current, tokens, self.options.clip, weights)
            loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        if self.options.asynchronous:  # samples still in flight carry tokens of this version
            frozen = copy.deepcopy((self.policy, self.vocabulary))
            self._old = {self.version: frozen, **{v: m for v, m in self._old.items() if v in self.history[-2:]}}
        self.optimizer.step()
        self.vocabulary.write_back()
        self.version = str(int(self.version) + 1)
        self.history.append(self.version)
        return report, len(behind)

    def _frozen(self, version: str) -> tuple[Any, LiveVocabulary]:
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
                   ) -> tuple[list[Sample], list[float], int, list[Sample]]:  # fmt: skip
    """The training sequences to learn from with their advantages, how many rollouts were dropped as too stale, and
    the rollouts kept (whose ``training_sequences`` the sequences are).

    The advantage is the rollout's: a rollout that forked gives each of its sequences (``training_sequences``) the
    same one, so a rollout counts once in its group however many sequences it has."""
    samples, advantages, dropped, kept = [], [], 0, []
    for group in groups:
        for sample, advantage in zip(group, group_advantages([s.reward or 0.0 for s in group]), strict=True):
            sequences = training_sequences([sample])
            staleness = max(weight_staleness(seq, trainer.version, history=trainer.history) for seq in sequences)
            if staleness > options.max_staleness:
                dropped += 1  # the trainer's choice: too far off-policy to learn from
            else:
                samples.extend(sequences)
                advantages.extend([advantage] * len(sequences))
                kept.append(sample)
    return samples, advantages, dropped, kept


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
                samples, advantages, dropped, kept = training_batch(groups, trainer, options)
                # off the event loop, which keeps serving the rollouts in flight
                gaps, stale = await asyncio.to_thread(trainer.step, samples, advantages, kept)
                report = StepReport.of(step, groups, gaps, stale=stale, dropped=dropped, rollout_s=rollout_s,
                                       started=trained_at)  # fmt: skip
                # the new weights reach the engine; samples in flight are suspended meanwhile
                suspensions_before = runner.metrics().suspensions
                async with runner.weight_update(version=trainer.version):
                    await engine.load_weights(trainer.updated_weights(), version=trainer.version)
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
