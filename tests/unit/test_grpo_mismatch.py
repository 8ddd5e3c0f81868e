"""The GRPO example's mismatch guard: the recomputed logprobs reach ``fsm_rollout.mismatch`` laid out per sequence,
and ``--correction`` weighs each token's loss with the report's weights."""

from __future__ import annotations

import math

import pytest
import torch

from fsm_rollout import Sample, mismatch
from fsm_rollout.examples.grpo import TrainableTokens, clipped_loss, parse_args, token_weights, trained_values


def sample(rollout: list[float], mask: list[int]) -> Sample:
    made = Sample(prompt="p", index=0, tokens=[1, 2, *range(3, 3 + len(rollout))], response_length=len(rollout))
    made.rollout_log_probs, made.loss_mask = rollout, mask
    return made


def test_correction_flag() -> None:
    assert parse_args([]).correction == "none"
    assert parse_args(["--correction", "icepop"]).correction == "icepop"
    with pytest.raises(SystemExit):
        parse_args(["--correction", "bogus"])


def test_recomputed_logprobs_become_per_token_weights_in_training_order() -> None:
    samples = [sample([-1.0, 0.0, -2.0], [1, 0, 1]), sample([-0.5], [1])]
    # trainable tokens in order: (0, 0), (0, 2), (1, 0); ratios p_train / p_rollout 1, 3, 1/4
    recomputed = torch.tensor([-1.0, -2.0 + math.log(3), -0.5 - math.log(4)], dtype=torch.float64)
    laid_out = trained_values(samples, recomputed)
    assert laid_out[0][1] == 0.0 and len(laid_out[1]) == 1
    report = mismatch(samples, laid_out)
    assert token_weights(samples, report, "tis").tolist() == pytest.approx([1.0, 2.0, 0.25])
    assert token_weights(samples, report, "icepop").tolist() == pytest.approx([1.0, 0.0, 0.0])


def test_the_loss_takes_the_weights() -> None:
    samples = [sample([-1.0, -1.0], [1, 1])]
    tokens = TrainableTokens.of(samples, [1.0])
    current = torch.tensor([-1.0, -1.0])
    plain = clipped_loss(current, tokens, 0.2)
    assert float(clipped_loss(current, tokens, 0.2, torch.tensor([2.0, 2.0]))) == pytest.approx(2 * float(plain))
    assert float(clipped_loss(current, tokens, 0.2, torch.tensor([1.0, 0.0]))) == pytest.approx(float(plain) / 2)
