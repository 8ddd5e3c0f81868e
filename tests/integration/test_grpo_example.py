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
from typing import Any

import pytest

from fsm_rollout import Sample
from fsm_rollout.examples.grpo import GRPOOptions, GRPORun, main, parse_args, train
from fsm_rollout.examples.grpo_tiny import NearMissEnv

GAP_MEAN_BOUND = 1e-5


class MemberRewardEnv(NearMissEnv):
    """The example's environment, with a reward that differs within every group (the member's position), so every
    step has advantages and the optimizer surely moves the weights."""

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        observation, done, _ = super().step(text)
        return observation, done, {"reward": float(self.sample.metadata["group_member"])}


def member_reward_env(*, sample: Sample, args: Any) -> MemberRewardEnv:
    return MemberRewardEnv(sample)


class DrawRewardEnv(NearMissEnv):
    """The example's environment, with a reward that follows the sampled text (its length's parity), so a screen or a
    step on other tokens would show other rewards."""

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        observation, done, _ = super().step(text)
        return observation, done, {"reward": float(len(text) % 2)}


def draw_reward_env(*, sample: Sample, args: Any) -> DrawRewardEnv:
    return DrawRewardEnv(sample)


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
                  "--train-threads TRAIN_THREADS", "(default: False)", "(default: None)"):  # fmt: skip
        assert shown in text, shown
    assert text.count("(default: ") == text.count("[--")  # every flag of the usage line but -h
    assert parse_args(["--train-threads", "1"]).train_threads == 1
    with pytest.raises(SystemExit):
        parse_args(["--train-threads", "0"])


@pytest.mark.parametrize("train_live_rows", [True, False], ids=["live-rows", "frozen"])
def test_only_the_vocabulary_rows_in_use_learn(train_live_rows: bool) -> None:
    import torch

    from fsm_rollout.engine.local.default_model import default_model_dir
    from fsm_rollout.examples.grpo import Trainer

    trainer = Trainer(default_model_dir(), GRPOOptions(train_live_rows=train_live_rows))
    matrix = trainer.policy.get_input_embeddings().weight
    before = matrix.detach().clone()
    live = before.ne(0).any(dim=1)
    assert 0 < int(live.sum()) < len(live) // 2  # the default model: most rows are zero
    used = torch.nonzero(live).squeeze(1)[:12]
    # a loss that pulls on every row, the zero ones included (through the full-vocabulary softmax)
    logits = trainer.policy(input_ids=used.unsqueeze(0)).logits[0]
    loss = torch.log_softmax(logits, dim=-1)[:, int(used[0])].mean()
    trainer.optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
    trainer.optimizer.step()

    after = matrix.detach()
    assert torch.equal(after[~live], before[~live]), "a zero row moved: the engine would sample unused ids"
    assert torch.count_nonzero(after[~live]) == 0
    moved = (after[live] - before[live]).abs().max().item()
    assert (moved > 1e-4) if train_live_rows else (moved == 0.0)


async def test_a_seed_keeps_the_same_questions_and_trains_the_same_at_any_thread_count() -> None:
    """The screen's choice and the training are functions of the seed: every group is sampled with its own seed, and
    the trainer computes on a fixed torch thread count whatever the process's default is (how a float sum is split
    over threads changes its last bits, and a different bit in a logprob can draw a different token)."""
    import torch

    options = GRPOOptions(steps=2, groups=2, group_size=2, max_new_tokens=40, candidates=4, screen_samples=2,
                          screen_finalists=2, env_factory=draw_reward_env)  # fmt: skip
    before = torch.get_num_threads()
    runs: list[tuple[str, GRPORun]] = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)  # the process's default: what the trainer's thread would otherwise take
            out = io.StringIO()
            run = await train(options, out=out)
            runs.append((out.getvalue().splitlines()[0], run))
    finally:
        torch.set_num_threads(before)
    (screened, first), *others = runs
    assert screened.startswith("screen: 4 questions x 2 samples and 2 x 4 more")
    for line, run in others:
        assert line == screened
        assert [(r.reward, r.gap_mean, r.gap_max, r.tokens) for r in run.reports] == [
            (r.reward, r.gap_mean, r.gap_max, r.tokens) for r in first.reports
        ]
        assert run.weight_change == first.weight_change
