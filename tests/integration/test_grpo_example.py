"""The GRPO example as a guard against train/inference mismatch: two quick steps on the embedded engine.

The engine samples with the default model; the trainer recomputes every trainable token's logprob with the weights
that sampled it. A shifted token, a mask off by one or a re-tokenised turn would show as a gap far above float32
noise. After the first step the engine must serve the new weights under the new version: the second step's tokens
carry version "1" and their logprobs match the updated policy, which they could not if the engine still had the old
weights (the step moves them by far more than the bound).
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pytest

from fsm_rollout import Sample
from fsm_rollout.data.practice import practice_samples
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.examples.grpo import GRPOOptions, main, parse_args, runner_for, train
from fsm_rollout.examples.grpo_tiny import NearMissEnv, screen

pytestmark = pytest.mark.own_process  # its trainer's torch training is a lasting step up in the suite's process

GAP_MEAN_BOUND = 1e-5


class MemberRewardEnv(NearMissEnv):
    """The example's environment, with a reward that differs within every group (the member's position), so every
    step has advantages and the optimizer surely moves the weights."""

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        observation, done, _ = super().step(text)
        return observation, done, {"reward": float(self.sample.metadata["group_member"])}


def member_reward_env(*, sample: Sample, args: Any) -> MemberRewardEnv:
    return MemberRewardEnv(sample)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_two_steps_keep_the_logprob_gap_at_float32_noise(asynchronous: bool) -> None:
    out = io.StringIO()
    options = GRPOOptions(steps=2, groups=2, group_size=2, max_new_tokens=80, asynchronous=asynchronous,
                          candidates=3, screen_samples=2, env_factory=member_reward_env)  # fmt: skip
    run = await train(options, out=out)

    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("screen: 3 questions x 2 samples")
    assert lines[1].startswith("step   0") and lines[2].startswith("step   1")
    summary = json.loads(lines[-1])
    assert set(summary) == {"steps", "reward_first", "reward_last", "logprob_gap_mean", "logprob_gap_max", "minutes"}
    assert summary == run.summary and summary["steps"] == 2

    first, second = run.reports
    assert first.tokens > 0 and second.tokens > 0
    for report in run.reports:
        assert report.gap_mean <= GAP_MEAN_BOUND, report
    assert summary["logprob_gap_mean"] <= GAP_MEAN_BOUND
    assert run.weight_change > 1e-4, "the optimizer step did not change the weights"
    assert first.versions == ["0"]
    if asynchronous:
        # the second step's samples started under version 0 and were suspended for the update or had finished
        assert set(second.versions) <= {"0", "1"}
        assert second.stale_tokens > 0 or second.versions == ["1"]
    else:
        assert second.versions == ["1"], "the engine did not serve the new weight version"


def test_the_command_line_checks_its_numbers() -> None:
    options = parse_args(["--steps", "3", "--async", "--groups", "4", "--group-size", "2", "--lr", "0.01"])
    assert (options.steps, options.asynchronous, options.groups, options.group_size, options.learning_rate) == (
        3, True, 4, 2, 0.01,
    )  # fmt: skip
    assert (options.candidates, options.screen_samples, options.screen_finalists) == (16, 4, 6)
    assert parse_args(["--candidates", "0", "--screen-samples", "2"]).candidates == 0
    assert parse_args(["--screen-finalists", "0"]).screen_finalists == 0
    for bad in (["--steps", "0"], ["--screen-samples", "0"], ["--candidates", "-1"], ["--screen-finalists", "-1"]):
        with pytest.raises(SystemExit):
            main(bad)


def test_the_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--steps STEPS optimizer steps (default: 20)", "(default: 0.002)", "(default: adamw)",
                  "--max-staleness MAX_STALENESS", "(default: False)", "(default: None)"):  # fmt: skip
        assert shown in text, shown
    assert text.count("(default: ") == text.count("[--")  # every flag of the usage line but -h


def made_up_samples(trainer: Any) -> list[Sample]:
    """Three samples of the vocabulary's live ids, of different lengths (the batch pads two of them), with a
    response that holds an observation (loss mask 0) and one token of a zero row (the engine may sample one)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    live = trainer.vocabulary.rows
    zero_row = int(torch.nonzero(trainer.vocabulary.column[: trainer.vocabulary.vocab] == len(live))[0])
    samples = []
    for prompt_length, response_length in ((9, 7), (5, 4), (12, 10)):
        ids = live[torch.randint(len(live), (prompt_length + response_length,), generator=generator)].tolist()
        ids[prompt_length + 1] = zero_row
        mask = [1] * response_length
        mask[2:4] = [0, 0]
        spans = [{"version": "0", "start": 0, "end": response_length}]
        samples.append(Sample(prompt="q", tokens=ids, response_length=response_length, loss_mask=mask,
                              metadata={"weight_version_spans": spans}))  # fmt: skip
    return samples


def full_vocabulary_logprobs(policy: Any, sample: Sample, vocab: int) -> Any:
    """The trainable tokens' logprobs as the example computed them before it batched: one sample at a time, the
    whole LM head, a log-softmax over every id the tokenizer knows."""
    import torch

    positions = [position for position, bit in enumerate(sample.loss_mask or []) if bit == 1]
    tokens = torch.tensor([sample.tokens])
    before = torch.tensor([len(sample.tokens) - sample.response_length + p - 1 for p in positions])
    logits = policy.lm_head(policy.model(input_ids=tokens).last_hidden_state[0][before])[:, :vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[0, before + 1].unsqueeze(1)).squeeze(1)


def test_the_batched_live_rows_logprobs_and_gradient_are_the_full_vocabularys() -> None:
    """The trainer's logprobs (one padded batch, the LM head over the live rows) are the per-sample full-vocabulary
    ones up to float32 noise, and its gradient is the full-vocabulary loss's, computed in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsm_rollout.examples.grpo import TrainableTokens, Trainer, clipped_loss, token_logprobs

    trainer = Trainer(default_model_dir(), GRPOOptions())
    samples = made_up_samples(trainer)
    full = [full_vocabulary_logprobs(trainer.policy, sample, trainer.vocabulary.vocab).detach() for sample in samples]
    for sample, logprobs in zip(samples, full, strict=True):  # the engine's, off by up to 0.3: some ratios clip
        trainable = [position for position, bit in enumerate(sample.loss_mask or []) if bit]
        sample.rollout_log_probs = [0.0] * sample.response_length
        for index, position in enumerate(trainable):
            sample.rollout_log_probs[position] = float(logprobs[index]) + 0.15 * (index % 5 - 2)
    advantages = [1.0, -0.5, 0.0]
    tokens = TrainableTokens.of(samples, advantages)

    current = token_logprobs(trainer.policy, trainer.vocabulary, tokens)
    assert float((current.detach() - torch.cat(full)).abs().max()) < 1e-5
    assert bool(trainer.vocabulary.column[tokens.target].eq(len(trainer.vocabulary.rows)).any()), "no zero-row token"
    clipped_loss(current, tokens, 0.2).backward()  # type: ignore[no-untyped-call, unused-ignore]

    exact = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float64)
    total = len(tokens.target)
    for sample, advantage in zip(samples, advantages, strict=True):
        positions = [position for position, bit in enumerate(sample.loss_mask or []) if bit]
        logprobs = full_vocabulary_logprobs(exact, sample, trainer.vocabulary.vocab)
        rollout = torch.tensor([(sample.rollout_log_probs or [])[p] for p in positions], dtype=torch.float64)
        ratio = torch.exp(logprobs - rollout)
        clipped = ratio.clamp(0.8, 1.2) * advantage
        (-torch.minimum(ratio * advantage, clipped).sum() / total).backward()  # type: ignore[no-untyped-call, unused-ignore]
    matrix = exact.get_input_embeddings().weight.grad
    pairs = [(trainer.vocabulary.weight.grad, matrix[trainer.vocabulary.rows])]
    pairs += [(mine.grad, theirs.grad) for mine, theirs in zip(trainer.policy.parameters(), exact.parameters(),
                                                              strict=True) if mine.requires_grad]  # fmt: skip
    assert len(pairs) == 26
    for mine, theirs in pairs:
        assert float((mine.double() - theirs).norm() / theirs.norm()) < 2e-3, mine.shape


@pytest.mark.parametrize("train_live_rows", [True, False], ids=["live-rows", "frozen"])
def test_only_the_vocabulary_rows_in_use_learn(train_live_rows: bool) -> None:
    import torch

    from fsm_rollout.examples.grpo import Trainer

    trainer = Trainer(default_model_dir(), GRPOOptions(train_live_rows=train_live_rows))
    matrix = trainer.policy.get_input_embeddings().weight
    before = matrix.detach().clone()
    live = before.ne(0).any(dim=1)
    assert 0 < int(live.sum()) < len(live) // 2  # the default model: most rows are zero
    samples = made_up_samples(trainer)
    for sample in samples:  # the engine's logprobs, about: ratios of about 1
        logprobs = full_vocabulary_logprobs(trainer.policy, sample, trainer.vocabulary.vocab).tolist()
        sample.rollout_log_probs = [logprobs.pop(0) if bit else 0.0 for bit in sample.loss_mask or []]
    trainer.step(samples, [1.0, -1.0, 0.5])

    after = matrix.detach()
    assert torch.equal(after[~live], before[~live]), "a zero row moved: the engine would sample unused ids"
    assert torch.count_nonzero(after[~live]) == 0
    moved = (after[live] - before[live]).abs().max().item()
    assert (moved > 1e-4) if train_live_rows else (moved == 0.0)
    assert torch.equal(after[trainer.vocabulary.rows], trainer.vocabulary.weight.detach())
    pushed = trainer.updated_weights()
    assert ("model.embed_tokens.weight" in pushed) == train_live_rows
    assert all(torch.equal(value, trainer.policy.state_dict()[name]) for name, value in pushed.items())


class RecordingGroups:
    """The runner, keeping the tokens of every group the screen runs by the group's seed (groups run concurrently
    and finish in any order)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.tokens: dict[int, list[list[int]]] = {}

    async def run_group(self, sample: Sample, n: int, *, seed: int) -> list[Sample]:
        group: list[Sample] = await self.runner.run_group(sample, n, seed=seed)
        self.tokens[seed] = [list(member.tokens) for member in group]
        return group


async def screened(options: GRPOOptions, *, torch_threads: int) -> tuple[str, list[str], dict[int, list[list[int]]]]:
    """The screen's line, the labels it kept and every token it sampled, on an engine with ``torch_threads``."""
    model_dir = default_model_dir()
    candidates = practice_samples(options.candidates, seed=options.question_seed, kinds=options.kinds)
    out = io.StringIO()
    engine = LocalEngine(model_dir=model_dir, torch_threads=torch_threads)
    async with engine, runner_for(engine, model_dir, options) as runner:
        recording = RecordingGroups(runner)
        kept = await screen(recording, candidates, options, out=out)  # type: ignore[arg-type]
    return out.getvalue(), [str(sample.label) for sample in kept], recording.tokens


async def test_the_screen_keeps_what_the_seed_says_at_any_engine_thread_count() -> None:
    """Which questions the screen keeps is a function of the seed (and the served weights): every group it runs is
    seeded, and how many threads the engine's kernels use does not change a logit."""
    options = GRPOOptions(candidates=4, screen_samples=2, screen_finalists=2, max_new_tokens=40)
    first = await screened(options, torch_threads=1)
    assert first[0].startswith("screen: 4 questions x 2 samples and 2 x 4 more") and len(first[1]) == 2
    assert await screened(options, torch_threads=1) == first
    assert await screened(options, torch_threads=2) == first
    other = await screened(replace(options, seed=1), torch_threads=1)
    in_seed_order = [[tokens for _, tokens in sorted(run[2].items())] for run in (first, other)]
    assert in_seed_order[0] != in_seed_order[1], "the run's seed did not reach the sampler"
