"""GRPO on the CPU: the embedded engine samples, a torch copy of the same tiny model learns, the weights go back.

Run it with ``python -m fsm_rollout.examples.grpo [--steps N] [--async]``. It is written the way a user of the library
would write a trainer; the library appears only where such a trainer uses it (the engine, the runner, the weight
update, the staleness helper).

Before the first step it screens ``--candidates`` practice questions (a few samples each with the starting weights,
then more for the ``--screen-finalists`` best) and keeps the ``--groups`` the model solves most often but not always,
one per answer: a question it never or always solves gives groups of equal rewards and no gradient. Each step then
rolls out a group of ``--group-size`` samples for each of those questions in a Geo3K-style environment
(:class:`NearMissEnv`: the model answers with a ``calc_score`` tool call; a wrong answer gets ``Incorrect`` and
another attempt; the reward is the best attempt's: 1 for the right answer, else 0), normalises the rewards within
each group into advantages, and takes one optimizer step on a clipped policy-gradient loss over the trainable tokens
(``loss_mask == 1``), with importance ratios against the engine's ``rollout_log_probs``. The new weights then go to
the engine inside ``runner.weight_update``.

Before that step it recomputes every trainable token's logprob with the weights that sampled it: the gap between the
engine's number and the trainer's is the train/inference mismatch that a shifted token, a wrong mask or a
re-tokenised turn would show; it should be float32 noise.

``--async`` starts the next step's rollouts before the current step trains, so the weight update lands while they
are in flight: the runner suspends them (the ``abort`` strategy: their partial turns are kept and continue after the
update), they resume under the new version, and the trainer reads each sample's weight-version spans to recompute
old tokens with the old weights and to measure staleness.

Each step prints one line; the last line is a JSON object with ``steps``, ``reward_first``, ``reward_last``,
``logprob_gap_mean``, ``logprob_gap_max`` and ``minutes``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, weight_staleness
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.envs.geo3k import CORRECT_FEEDBACK, INCORRECT_FEEDBACK, answers_match, parse_number
from fsm_rollout.tool_calls import parse_tool_calls

__all__ = ["GRPOOptions", "GRPORun", "StepReport", "main", "train"]


@dataclass(frozen=True)
class GRPOOptions:
    """What one run does; the command-line flags set these."""

    steps: int = 20
    asynchronous: bool = False
    groups: int = 2
    group_size: int = 16
    max_turns: int = 2
    max_new_tokens: int = 100
    learning_rate: float = 2e-3
    optimizer: str = "adamw"
    clip: float = 0.2
    max_staleness: int = 1
    seed: int = 0
    question_seed: int = 2_024
    candidates: int = 16
    """Practice questions screened before the first step; the ``groups`` the starting model solves most often (but
    not always) become the pool. 0 or fewer than ``groups`` skips the screen: the pool is the first ``groups``."""
    screen_samples: int = 4
    """Samples per candidate in the screen."""
    screen_finalists: int = 6
    """Candidates with the best screen rates that get ``2 * screen_samples`` more samples before the pool is kept."""
    kinds: tuple[str, ...] = ("radius", "thirty_sixty", "vertical_angles", "isosceles", "right_angle", "straight_line")
    """Practice question kinds of the candidates: whole-number answers from a narrow range, so that the starting
    model is right now and then."""
    train_live_rows: bool = True
    """Train the vocabulary matrix's non-zero rows (the tokens the default model uses) besides the layers."""
    model_dir: Path | None = None
    env_factory: Any = None
    """``build_env(*, sample, args)`` of the environment (default: :class:`NearMissEnv`'s)."""


@dataclass
class StepReport:
    """What one step measured."""

    step: int
    reward: float
    gap_mean: float
    gap_max: float
    tokens: int
    samples: int
    samples_per_s: float
    seconds: float
    versions: list[str] = field(default_factory=list)
    stale_tokens: int = 0
    dropped: int = 0
    suspended: int = 0

    def line(self) -> str:
        text = (
            f"step {self.step:3d}  reward {self.reward:.3f}  logprob gap mean {self.gap_mean:.2e} max "
            f"{self.gap_max:.2e}  tokens {self.tokens}  {self.samples_per_s:.2f} samples/s  {self.seconds:.1f} s"
        )
        if self.suspended or self.stale_tokens or self.dropped:
            text += f"  suspended {self.suspended}  stale tokens {self.stale_tokens}  dropped {self.dropped}"
        return text + f"  versions {','.join(self.versions)}"


# --------------------------------------------------------------------------------------------------------------
# The environment


class NearMissEnv:
    """The Geo3K task, with optional partial credit for near misses.

    The model answers with a ``calc_score`` tool call, as in :mod:`fsm_rollout.envs.geo3k`, and gets the same
    feedback (``Correct``, or ``Incorrect`` and another attempt). An attempt earns 1 when its answer is right and,
    when it is a number within ``band`` (relative) of the label, ``share`` falling linearly to 0 at the band's edge;
    the sample's reward is its best attempt. A turn without a tool call ends the episode. The example gives no
    partial credit (``share=0``): the screen already keeps questions the model solves now and then, and any share
    makes near misses a place to rest, where the policy settles on a frequent answer close to the label.
    """

    def __init__(self, sample: Sample, band: float = 0.5, share: float = 0.0) -> None:
        self.sample = sample
        self.label = str(sample.label)
        self.band = band
        self.share = share

    def reset(self) -> None:
        self.sample.reward = 0.0

    def credit(self, answer: str) -> float:
        if answers_match(answer, self.label):
            return 1.0
        value, target = parse_number(answer.strip()), parse_number(self.label)
        if value is None or target is None or target == 0:
            return 0.0
        return self.share * max(0.0, 1.0 - abs(value - target) / (self.band * abs(target)))

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        calls = parse_tool_calls(text, read_unclosed=True).calls
        answer = calls[-1].arguments.get("answer") if calls else None
        best = float(self.sample.reward or 0.0)
        if not isinstance(answer, str | int | float) or isinstance(answer, bool):
            return "No calc_score call.", True, {"reward": best}
        credit = self.credit(str(answer))
        feedback = CORRECT_FEEDBACK if credit == 1.0 else INCORRECT_FEEDBACK
        return feedback, False, {"reward": max(best, credit)}

    def format_observation(self, observation: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": observation}]}

    def close(self) -> None:
        pass


def build_env(*, sample: Sample, args: Any) -> NearMissEnv:
    return NearMissEnv(sample)


# --------------------------------------------------------------------------------------------------------------
# The policy side


def trainable_positions(sample: Sample) -> list[int]:
    """Response positions the loss covers (the model's own tokens)."""
    return [position for position, bit in enumerate(sample.loss_mask or []) if bit == 1]


def token_logprobs(model: Any, sample: Sample, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """log p(token) of the response tokens at ``positions`` under ``model``: one forward pass over the sample's
    tokens, the logits of position ``p - 1`` scoring token ``p`` (temperature 1).

    Only the first ``vocab`` ids count: the embedded engine never samples the embedding's padding rows (ids the
    tokenizer does not know), so its logprobs are normalised over the tokenizer's ids and so are these.
    """
    tokens = torch.tensor([sample.tokens], dtype=torch.long)
    prompt_len = len(sample.tokens) - sample.response_length
    hidden = model.model(input_ids=tokens).last_hidden_state[0]
    before = torch.tensor([prompt_len + position - 1 for position in positions], dtype=torch.long)
    logits = model.lm_head(hidden[before]).float()[:, :vocab]
    targets = tokens[0, before + 1]
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def version_of_positions(sample: Sample) -> dict[int, str]:
    """The weight version that sampled each generated position, from ``metadata["weight_version_spans"]``."""
    versions: dict[int, str] = {}
    for span in sample.metadata.get("weight_version_spans") or []:
        for position in range(span["start"], span["end"]):
            versions[position] = str(span["version"])
    return versions


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's advantages: rewards centred on the group mean and scaled by its standard deviation (0 when flat)."""
    mean = statistics.fmean(rewards)
    spread = statistics.pstdev(rewards)
    return [0.0 if spread == 0 else (reward - mean) / (spread + 1e-6) for reward in rewards]


class Trainer:
    """The policy (a transformers copy of the served model), its optimizer, and the weights of earlier versions."""

    def __init__(self, model_dir: Path, options: GRPOOptions) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = options
        self.vocab = len(AutoTokenizer.from_pretrained(str(model_dir)))
        self.policy: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.policy.train()  # Qwen2 has no dropout: train mode computes what eval mode does
        embeddings = (self.policy.get_input_embeddings(), self.policy.get_output_embeddings())  # type: ignore[no-untyped-call, unused-ignore]
        # The vocabulary matrix (tied input/output) is 98% of the parameters and most of its rows are ids the task
        # never produces (all zero in the default model). Adam would move every one of them by about the learning
        # rate each step (it rescales even their vanishing gradients), which ruins the output distribution within a
        # few steps; so only the live rows learn: the others' gradient is zeroed, and Adam leaves a parameter whose
        # gradient has always been 0 where it is. A model without zero rows keeps its vocabulary matrix frozen.
        seen: set[int] = set()
        for module in embeddings:
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or id(weight) in seen:  # tied input/output: one matrix
                continue
            seen.add(id(weight))
            live = weight.detach().ne(0).any(dim=1, keepdim=True).to(weight.dtype)
            if bool(live.all()) or not options.train_live_rows:
                weight.requires_grad_(False)
            else:
                weight.register_hook(lambda grad, live=live: grad * live)  # type: ignore[no-untyped-call, unused-ignore]
        trainable = [parameter for parameter in self.policy.parameters() if parameter.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(trainable, lr=options.learning_rate, momentum=0.9)
            if options.optimizer == "sgd"
            else torch.optim.AdamW(trainable, lr=options.learning_rate, weight_decay=0.0)
        )
        self.version = "0"
        self.history = ["0"]
        self._old: dict[str, Any] = {}  # version -> a frozen copy of the model with that version's weights

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.policy.state_dict().items()}

    def step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> tuple[list[float], int]:
        """One optimizer step; returns every trainable token's |rollout logprob - recomputed| and the stale tokens.

        The gap is taken with the weights that sampled each token (older versions from their frozen copies); the
        loss uses the current policy, with ratios against the rollout's logprobs.
        """
        clip = self.options.clip
        total = sum(len(trainable_positions(sample)) for sample in samples) or 1
        gaps: list[float] = []
        stale = 0
        self.optimizer.zero_grad(set_to_none=True)
        for sample, advantage in zip(samples, advantages, strict=True):
            positions = trainable_positions(sample)
            if not positions:
                continue
            rollout = torch.tensor([(sample.rollout_log_probs or [])[position] for position in positions])
            current = token_logprobs(self.policy, sample, positions, self.vocab)
            sampled_by = version_of_positions(sample)
            behind = [index for index, position in enumerate(positions) if sampled_by.get(position) != self.version]
            recomputed = current.detach().clone()
            for version in sorted({sampled_by[positions[index]] for index in behind}):
                indices = [index for index in behind if sampled_by[positions[index]] == version]
                with torch.no_grad():
                    old_positions = [positions[index] for index in indices]
                    old = token_logprobs(self._frozen(version), sample, old_positions, self.vocab)
                recomputed[indices] = old
            stale += len(behind)
            gaps.extend((recomputed - rollout).abs().tolist())
            if advantage == 0.0:
                continue
            ratio = torch.exp(current - rollout)
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
            (-surrogate.sum() / total).backward()  # type: ignore[no-untyped-call, unused-ignore]
        torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.requires_grad], 1.0)
        if self.options.asynchronous:  # samples still in flight carry tokens of this version
            self._keep(self.version)
        self.optimizer.step()
        self.version = str(int(self.version) + 1)
        self.history.append(self.version)
        return gaps, stale

    def _keep(self, version: str) -> None:
        frozen = copy.deepcopy(self.policy)
        frozen.eval()
        for parameter in frozen.parameters():
            parameter.requires_grad_(False)
        self._old = {version: frozen, **{v: m for v, m in self._old.items() if v in self.history[-2:]}}

    def _frozen(self, version: str) -> Any:
        if version not in self._old:
            raise RuntimeError(f"no weights kept for version {version}: the sample is staler than the trainer keeps")
        return self._old[version]


# --------------------------------------------------------------------------------------------------------------
# The loop


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


async def screen(runner: RolloutRunner, candidates: Sequence[Sample], options: GRPOOptions, *, out: Any
                 ) -> list[Sample]:  # fmt: skip
    """The pool: the ``options.groups`` candidates with the highest mean reward below 1 over ``screen_samples``
    samples of the starting model (ties keep the candidates' order).

    A question the model never earns anything on, or always earns everything on, gives groups of equal rewards,
    hence zero advantages and no gradient; GRPO pipelines filter such prompts out, and so does this screen.
    """
    if options.candidates < options.groups or options.screen_samples < 1:
        return list(candidates[: options.groups])
    rewards = await _screen_rewards(runner, candidates, range(len(candidates)), options.screen_samples, options, 0)
    rates = [statistics.fmean(found) for found in rewards]
    first_mean = statistics.fmean(rates)

    def ranked(indices: Sequence[int]) -> list[int]:
        return sorted(indices, key=lambda index: (rates[index] >= 1.0, -rates[index], index))

    # A second look at the best few: with a handful of samples the top rates are mostly luck (one hit in four), and
    # a question picked for luck starts the run with little to climb from.
    finalists = ranked(range(len(candidates)))[: max(0, options.screen_finalists)]
    more = await _screen_rewards(runner, candidates, finalists, 2 * options.screen_samples, options, 1)
    for index, found in zip(finalists, more, strict=True):
        rewards[index] += found
        rates[index] = statistics.fmean(rewards[index])
    # the finalists first (their rates rest on more samples), then the rest
    order = ranked(finalists) + ranked([index for index in range(len(candidates)) if index not in finalists])
    # Questions of different kinds and answers: the tiny model tells kinds apart by their wording, and one answer
    # given everywhere would not earn on two questions at once. Each rule gives way when the candidates run out.
    kept: list[int] = []
    rules: tuple[Callable[[Sample], set[tuple[str, str]]], ...] = (_kind_and_answer, _answer, lambda sample: set())
    for parts_of in rules:
        taken = set().union(*(parts_of(candidates[index]) for index in kept))
        for index in order:
            parts = parts_of(candidates[index])
            if len(kept) < options.groups and index not in kept and not parts & taken:
                kept.append(index)
                taken |= parts
    kept.sort()
    print(f"screen: {len(candidates)} questions x {options.screen_samples} samples and {len(finalists)} x "
          f"{2 * options.screen_samples} more, mean reward "
          f"{first_mean:.3f}; kept {len(kept)} with mean reward "
          f"{statistics.fmean(rates[index] for index in kept):.3f}: "
          + ", ".join(f"{candidates[index].metadata.get('kind', '?')} {candidates[index].label} ({rates[index]:.2f})"
                      for index in kept), file=out, flush=True)  # fmt: skip
    return [candidates[index] for index in kept]


async def _screen_rewards(runner: RolloutRunner, candidates: Sequence[Sample], indices: Sequence[int], samples: int,
                         options: GRPOOptions, look: int) -> list[list[float]]:  # fmt: skip
    """The rewards of ``samples`` samples of each candidate in ``indices`` (a seed per candidate and look)."""
    seeds = [((options.seed * 100_003 + 77_777 + index) * 7 + look) * 1_009 for index in indices]
    groups = await asyncio.gather(*(runner.run_group(candidates[index], samples, seed=seed)
                                    for index, seed in zip(indices, seeds, strict=True)))  # fmt: skip
    return [[float(sample.reward or 0.0) for sample in group] for group in groups]


def _answer(sample: Sample) -> set[tuple[str, str]]:
    return {("answer", str(sample.label))}


def _kind_and_answer(sample: Sample) -> set[tuple[str, str]]:
    kind = sample.metadata.get("kind")
    return _answer(sample) | ({("kind", str(kind))} if kind is not None else set())


@dataclass
class GRPORun:
    """What :func:`train` returns: the final JSON object, every step's report, and how far the weights moved."""

    summary: dict[str, Any]
    reports: list[StepReport]
    weight_change: float
    """The largest absolute change of any parameter between the first and the last weights."""


async def train(options: GRPOOptions, *, out: Any = sys.stdout) -> GRPORun:
    """Run the loop; print a line per step and the final JSON object to ``out``."""
    random.seed(options.seed)
    torch.manual_seed(options.seed)
    model_dir = options.model_dir if options.model_dir is not None else await asyncio.to_thread(default_model_dir)
    started = time.perf_counter()
    trainer = await asyncio.to_thread(Trainer, model_dir, options)
    first_weights = trainer.weights()
    candidates = practice_samples(max(options.groups, options.candidates), seed=options.question_seed,
                                  kinds=options.kinds)  # fmt: skip
    sampling = {"max_new_tokens": options.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                "stop": ["</tool_call>"], "no_stop_trim": True}  # fmt: skip
    reports: list[StepReport] = []
    async with LocalEngine(model_dir=model_dir, served_model_name="policy") as engine:
        await engine.update_weight_version(trainer.version)
        config = RolloutConfig(
            engine_url=engine.url, model=engine.served_model_name, tokenizer_path=str(model_dir),
            image_merge_size=engine.image_merge_size, max_turns=options.max_turns, weight_update_strategy="abort",
        )  # fmt: skip
        envs = options.env_factory or build_env
        async with RolloutRunner(config, sampling_params=sampling, env_factory=envs) as runner:
            questions = await screen(runner, candidates, options, out=out)
            pending = asyncio.ensure_future(rollout_step(runner, questions, 0, options))
            for step in range(options.steps):
                groups, rollout_s = await pending
                if options.asynchronous and step + 1 < options.steps:
                    pending = asyncio.ensure_future(rollout_step(runner, questions, step + 1, options))
                report = await _train_step(trainer, groups, step, rollout_s, options)
                # the new weights reach the engine; in --async mode the next step's samples are suspended meanwhile
                suspensions_before = runner.metrics().suspensions
                async with runner.weight_update(version=trainer.version):
                    await engine.load_weights(trainer.weights(), version=trainer.version)
                report.suspended = runner.metrics().suspensions - suspensions_before
                reports.append(report)
                print(report.line(), file=out, flush=True)
                if not options.asynchronous and step + 1 < options.steps:
                    pending = asyncio.ensure_future(rollout_step(runner, questions, step + 1, options))
    gaps_mean = statistics.fmean(report.gap_mean for report in reports) if reports else 0.0
    summary = {
        "steps": len(reports),
        "reward_first": round(reports[0].reward, 4) if reports else None,
        "reward_last": round(reports[-1].reward, 4) if reports else None,
        "logprob_gap_mean": gaps_mean,
        "logprob_gap_max": max((report.gap_max for report in reports), default=0.0),
        "minutes": round((time.perf_counter() - started) / 60, 3),
    }
    print(json.dumps(summary), file=out, flush=True)
    final = trainer.weights()
    change = max(float((final[name] - value).abs().max()) for name, value in first_weights.items())
    return GRPORun(summary, reports, change)


async def _train_step(trainer: Trainer, groups: Sequence[Sequence[Sample]], step: int, rollout_s: float,
                      options: GRPOOptions) -> StepReport:  # fmt: skip
    started = time.perf_counter()
    samples: list[Sample] = []
    advantages: list[float] = []
    dropped = 0
    for group in groups:
        rewards = [float(sample.reward or 0.0) for sample in group]
        for sample, advantage in zip(group, group_advantages(rewards), strict=True):
            behind = weight_staleness(sample, trainer.version, history=trainer.history)
            if behind > options.max_staleness:  # the trainer's choice: too far off-policy to learn from
                dropped += 1
                continue
            samples.append(sample)
            advantages.append(advantage)
    # the step runs on a worker thread so that the event loop keeps serving the rollouts in flight
    gaps, stale = await asyncio.to_thread(trainer.step, samples, advantages)
    all_samples = [sample for group in groups for sample in group]
    versions = sorted({str(span["version"]) for sample in all_samples
                       for span in sample.metadata.get("weight_version_spans") or []}, key=int)  # fmt: skip
    seconds = rollout_s + time.perf_counter() - started
    return StepReport(
        step=step,
        reward=statistics.fmean(float(sample.reward or 0.0) for sample in all_samples),
        gap_mean=statistics.fmean(gaps) if gaps else 0.0,
        gap_max=max(gaps, default=0.0),
        tokens=sum(len(trainable_positions(sample)) for sample in all_samples),
        samples=len(all_samples),
        samples_per_s=len(all_samples) / rollout_s if rollout_s > 0 else 0.0,
        seconds=seconds,
        versions=versions,
        stale_tokens=stale,
        dropped=dropped,
    )


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> GRPOOptions:
    defaults = GRPOOptions()
    parser = argparse.ArgumentParser(prog="python -m fsm_rollout.examples.grpo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="roll out the next step while this one trains; the update lands mid-rollout",
    )
    parser.add_argument("--groups", type=int, default=defaults.groups, help="questions per step")
    parser.add_argument("--group-size", type=int, default=defaults.group_size, help="samples per question")
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns, help="attempts per sample")
    parser.add_argument(
        "--max-new-tokens", type=int, default=defaults.max_new_tokens, help="response budget per sample"
    )
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, help="AdamW learning rate")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer, help="optimizer")
    parser.add_argument("--clip", type=float, default=defaults.clip, help="ratio clip range")
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=defaults.max_staleness,
        help="drop samples whose oldest token is more versions behind than this",
    )
    parser.add_argument(
        "--kinds", default=",".join(defaults.kinds), help="comma-separated practice question kinds of the pool"
    )
    parser.add_argument(
        "--candidates", type=int, default=defaults.candidates, help="questions screened for the pool (0: no screen)"
    )
    parser.add_argument(
        "--screen-samples", type=int, default=defaults.screen_samples, help="samples per screened question"
    )
    parser.add_argument(
        "--screen-finalists", type=int, default=defaults.screen_finalists,
        help="best-screened questions that get twice --screen-samples more samples (0: none)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed, help="torch and Python seed")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="policy and served model (default: the embedded engine's default model)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "groups", "group_size", "max_turns", "max_new_tokens", "screen_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("candidates", "screen_finalists"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    return GRPOOptions(
        steps=args.steps, asynchronous=args.asynchronous, groups=args.groups, group_size=args.group_size,
        max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, learning_rate=args.lr, clip=args.clip,
        optimizer=args.optimizer,
        max_staleness=args.max_staleness, seed=args.seed, model_dir=args.model, candidates=args.candidates,
        screen_samples=args.screen_samples, screen_finalists=args.screen_finalists,
        kinds=tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip()),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(train(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
