"""What the GRPO example (:mod:`fsm_rollout.examples.grpo`) needs because its model is tiny.

A trainer of a real model would not copy these:

* :class:`NearMissEnv`: the Geo3K task as the example's environment (exact credit by default);
* :func:`screen`: the practice questions the starting model solves now and then, since the tiny model solves most
  questions never, and a group of equal rewards has no advantage and gives no gradient;
* :class:`LiveVocabulary`: only the vocabulary rows the default model uses may learn, held as a small parameter.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fsm_rollout import Sample
from fsm_rollout.envs.geo3k import CORRECT_FEEDBACK, INCORRECT_FEEDBACK, answers_match, parse_number
from fsm_rollout.tokens.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    import torch

    from fsm_rollout.runtime.runner import RolloutRunner

__all__ = [
    "DEFAULT_KINDS",
    "LiveVocabulary",
    "NearMissEnv",
    "ScreenSettings",
    "build_env",
    "screen",
]

DEFAULT_KINDS = ("radius", "thirty_sixty", "vertical_angles", "isosceles", "right_angle", "straight_line")
"""Practice question kinds screened by default: whole-number answers from a narrow range, so that the starting model
is right now and then."""


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
# The question screen


class ScreenSettings(Protocol):
    """The options the screen reads (:class:`fsm_rollout.examples.grpo.GRPOOptions` has them)."""

    @property
    def groups(self) -> int:
        """Questions to keep."""

    @property
    def candidates(self) -> int:
        """Questions screened; fewer than ``groups`` skips the screen."""

    @property
    def screen_samples(self) -> int:
        """Samples per candidate in the first look."""

    @property
    def screen_finalists(self) -> int:
        """Candidates with the best first-look rates that get ``2 * screen_samples`` more samples."""

    @property
    def seed(self) -> int:
        """The run's seed; every group of the screen gets its own sampling seed from it."""


async def screen(runner: RolloutRunner, candidates: Sequence[Sample], options: ScreenSettings, *, out: Any
                 ) -> list[Sample]:  # fmt: skip
    """The pool: the ``options.groups`` candidates with the highest mean reward below 1 over ``screen_samples``
    samples of the starting model (ties keep the candidates' order).

    A question the model never earns anything on, or always earns everything on, gives groups of equal rewards,
    hence zero advantages and no gradient; GRPO pipelines filter such prompts out, and so does this screen. Every
    group is seeded from ``options.seed``, so on one type of CPU the choice is a function of the seed. Across CPU
    types it may differ: torch's kernels (MKL's by CPU vendor and instruction set, ATen's by instruction set) sum in
    other orders, a logit's last bit changes, and a sampled rollout that draws one other token goes elsewhere.
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
                         options: ScreenSettings, look: int) -> list[list[float]]:  # fmt: skip
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


# --------------------------------------------------------------------------------------------------------------
# The vocabulary matrix


class LiveVocabulary:
    """The vocabulary matrix's non-zero rows as a parameter of their own (:attr:`weight`): the only rows that learn,
    and the LM head's logprobs computed from them as the embedded engine computes them.

    The vocabulary matrix (tied input/output) is 98% of the default model's parameters and most of its rows are ids
    the task never produces (all zero). Adam would move every one of them by about the learning rate each step (it
    rescales even their vanishing gradients), which ruins the output distribution within a few steps; so only the
    live rows learn. Held apart (about 220 rows of about 152k), they are all the backward pass, the gradient clip and
    the optimizer touch of the matrix, with the same AdamW arithmetic per row; a zero row is no parameter, so it
    stays zero. The model's own matrix is frozen and gets the live rows back after every optimizer step
    (:meth:`write_back`), which the engine's copy and a frozen copy of the model read.

    With ``enabled`` False, and for a model whose matrix has no zero rows or is not tied, :attr:`weight` does not
    learn and the matrix stays frozen. The LM head is taken to be the bias-free projection on the matrix (Qwen2's);
    for another head the logprob gap would show it. Make it before the optimizer.
    """

    def __init__(self, policy: Any, vocab: int, *, enabled: bool = True) -> None:
        import torch

        matrix = policy.get_output_embeddings().weight
        tied = matrix is policy.get_input_embeddings().weight
        policy.get_input_embeddings().weight.requires_grad_(False)
        matrix.requires_grad_(False)
        self.matrix: torch.Tensor = matrix
        self.vocab = vocab  # the tokenizer's ids; the rows above (padding) are never sampled
        self.rows = torch.nonzero(matrix.detach()[:vocab].ne(0).any(dim=1)).squeeze(1)
        self.zero_rows = vocab - len(self.rows)
        self.learns = enabled and tied and self.zero_rows > 0
        self.weight = torch.nn.Parameter(matrix.detach()[self.rows].clone(), requires_grad=self.learns)
        # id -> its row of ``weight``; a zero row -> one past the last (where ``embed`` and ``logprobs`` put a 0)
        self.column = torch.full((len(matrix),), len(self.rows), dtype=torch.long)
        self.column[self.rows] = torch.arange(len(self.rows))
        self._input = policy.get_input_embeddings()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids``: the rows of :attr:`weight` (and 0 for a zero row) while it learns, so
        that the gradient reaches it, else the model's own embedding."""
        import torch

        if not self.learns:
            return self._input(ids)  # type: ignore[no-any-return]
        table = torch.cat([self.weight, self.weight.new_zeros(1, self.weight.shape[1])])
        return torch.nn.functional.embedding(self.column[ids], table)

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) at temperature 1 over the tokenizer's ids, for final hidden states ``hidden`` (tokens,
        hidden size) and ``targets`` (tokens).

        The values are the engine's: torch's float32 log-softmax of the whole vocabulary's logits (every zero row's
        logit is exactly 0), bit for bit for the same logits. Each zero row adds a term below the running sum's last
        float32 bit, so a shorter or more exact sum over the live rows would differ from it in the fourth decimal;
        that pass needs no gradient, though. The gradient is the live rows' own: their log-sum-exp with the zero
        rows' mass as one term (``zero_rows * e^0``), the same softmax without a (tokens x vocabulary) graph.
        """
        import math

        import torch

        live = hidden @ self.weight.T
        padded = torch.cat([live, live.new_zeros(len(live), 1)], dim=1)  # a zero-row target's logit is 0
        zero_mass = torch.full((len(live), 1), math.log(self.zero_rows) if self.zero_rows else -math.inf)
        column = self.column[targets].unsqueeze(1)
        exact = padded.gather(1, column).squeeze(1) - torch.logsumexp(torch.cat([live, zero_mass], dim=1), dim=1)
        with torch.no_grad():
            logits = torch.zeros(self.vocab)  # one row at a time: a row (the whole vocabulary) stays in the cache
            engines = torch.empty(len(live))
            for index, (row, target) in enumerate(zip(live, targets.tolist(), strict=True)):
                logits[self.rows] = row
                engines[index] = torch.log_softmax(logits, dim=0)[target]
        return exact + (engines - exact).detach()

    def write_back(self) -> None:
        """Copy :attr:`weight` into the model's matrix (after an optimizer step)."""
        import torch

        if self.learns:
            with torch.no_grad():
                self.matrix[self.rows] = self.weight
