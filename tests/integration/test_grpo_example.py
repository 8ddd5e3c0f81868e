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


class RecordingGroups:
    """The runner, keeping the tokens of every group the screen runs."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.tokens: list[list[list[int]]] = []

    async def run_group(self, sample: Sample, n: int, *, seed: int) -> list[Sample]:
        group: list[Sample] = await self.runner.run_group(sample, n, seed=seed)
        self.tokens.append([list(member.tokens) for member in group])
        return group


async def screened(options: GRPOOptions, *, torch_threads: int) -> tuple[str, list[str], list[list[list[int]]]]:
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
    assert other[2] != first[2], "the run's seed did not reach the sampler"
