"""``fsm_rollout.mismatch``: per-token weights and masks, per-sample K1/K3, the per-event table, and the errors
for input that does not fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsm_rollout import MismatchInputError, MismatchReport, Sample, mismatch

ROLLOUT = [-1.0, -0.5, -2.0]
TRAINER = [-1.0, -0.5 + math.log(3), -2.0 - math.log(4)]  # ratios p_train / p_rollout: 1, 3, 1/4


def sample(logprobs: list[float], mask: list[int] | None = None, **metadata: object) -> Sample:
    made = Sample(prompt="p", index=0, tokens=[0, 0, *range(len(logprobs))], response_length=len(logprobs))
    made.rollout_log_probs = list(logprobs)
    made.loss_mask = mask if mask is not None else [1] * len(logprobs)
    made.metadata.update(metadata)
    return made


def test_weights_masks_and_kl_estimates_follow_their_definitions() -> None:
    report = mismatch([sample(ROLLOUT)], [TRAINER], tis_cap=2.0, icepop=(0.5, 2.0))
    (tis,) = report.weights("tis")
    (mis,) = report.weights("mis")
    (icepop,) = report.weights("icepop")
    assert np.allclose(tis, [1.0, 2.0, 0.25])
    assert np.allclose(mis, [1.0, 0.0, 0.25])
    assert np.allclose(icepop, [1.0, 0.0, 0.0])
    assert [m.tolist() for m in report.mask("icepop")] == [[True, False, False]]
    (one,) = report.samples
    assert one.k1 == pytest.approx((math.log(3) - math.log(4)) / 3)
    r = [1.0, 1 / 3, 4.0]  # p_rollout / p_train
    assert one.k3 == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3)
    assert one.max_abs_delta == pytest.approx(math.log(4))
    assert one.tis_clipped_fraction == pytest.approx(1 / 3)
    assert one.icepop_masked_fraction == pytest.approx(2 / 3)
    assert report.to_dict()["samples"][0]["k3"] == pytest.approx(one.k3)


def test_untrained_positions_are_not_read_and_weigh_nothing() -> None:
    report = mismatch([sample([-1.0, 0.0, -1.0], mask=[1, 0, 1])], [[-1.0, float("nan"), -1.5]])
    assert report.tokens == 2
    assert report.weights("tis")[0].tolist()[1] == 0.0
    assert report.samples[0].k1 == pytest.approx(-0.25)


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ([[-1.0, -0.5]], "sequence 0, position 2: got 2 trainer logprobs for 3 response tokens"),
        ([[-1.0, float("nan"), -2.0]], "sequence 0, position 1: the trainer logprob is nan"),
        ([TRAINER, TRAINER], "got trainer logprobs for 2 sequences, training_sequences has 1"),
        ({0: TRAINER, 5: TRAINER}, "sequence 5: no such training sequence"),
        ({}, "sequence 0: no trainer logprobs given"),
    ],
)
def test_input_that_does_not_fit_names_the_sequence_and_position(trainer: object, message: str) -> None:
    with pytest.raises(MismatchInputError, match=message):
        mismatch([sample(ROLLOUT)], trainer)  # type: ignore[arg-type]


def test_an_unknown_sample_is_refused() -> None:
    with pytest.raises(MismatchInputError, match="item 1 is dict"):
        mismatch([sample(ROLLOUT), {"tokens": []}], [TRAINER, TRAINER])  # type: ignore[list-item]


def groups(report: MismatchReport, dimension: str) -> dict[str, tuple[int, float]]:
    """Each group's token count and max |delta| (rounded: the deltas are differences of decimals)."""
    return {g.label: (g.tokens, round(g.max_abs_delta, 9)) for g in report.events if g.dimension == dimension}


def test_events_group_tokens_by_what_they_went_through() -> None:
    rollout = [-1.0] * 8
    trainer = [-1.0, -1.1, -1.0, -1.0, -1.0, -1.3, -1.0, -1.0]
    spans = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 5, "end": 8}]
    image = [{"type": "image"}, {"type": "text", "text": "look"}]
    first = sample(
        rollout,
        mask=[1, 1, 1, 0, 0, 1, 1, 1],
        weight_version_spans=spans,
        start_weight_version="1",
        observations=[{"start": 3, "end": 5, "messages": [{"role": "user", "content": image}]}],
        # rows 0..2 prompt, response token p produced by row 2 + p - 1 + 1 (prompt of 2 tokens): turn 2 spans rows 6..8
        routed_expert_spans=[
            {"request_id": "a", "weight_version": "1", "start": 0, "end": 7},
            {"request_id": "b", "weight_version": "2", "start": 7, "end": 9},
        ],
    )
    forked = sample([-1.0, -1.0], branch=0)
    forked.index = 1
    later = sample([-1.0, -1.0], branch=1)
    later.index = 1
    forked.branches = []
    later.branches = [forked]
    report = mismatch([first, later], [trainer, [-1.0, -1.0], [-1.0, -1.5]], trainer_version=3, image_window=1)
    versions = groups(report, "version")
    assert versions["1 -> 3 (staleness 2)"] == (3, 0.1)
    assert versions["2 -> 3 (staleness 1)"] == (3, 0.3)
    assert {g.staleness for g in report.events if g.dimension == "version"} == {1, 2, None}
    assert groups(report, "resume")["after_resume"] == (3, 0.3)
    assert groups(report, "sequence") == {"first": (8, 0.3), "branch": (2, 0.5)}
    assert groups(report, "image")["near_image"] == (1, 0.3)
    assert groups(report, "routes")["routes_changed"] == (3, 0.3)
    assert groups(report, "routes")["routes_kept"] == (3, 0.1)
    worst = report.worst_event()
    assert worst is not None and worst.max_abs_delta == pytest.approx(0.5)


def test_a_batch_of_many_sequences_matches_the_per_sequence_figures() -> None:
    rng = np.random.default_rng(3)
    samples, trainer = [], []
    for index in range(50):
        length = int(rng.integers(0, 30))
        logprobs = (-rng.random(length)).tolist()
        samples.append(sample(logprobs, mask=rng.integers(0, 2, length).tolist()))
        samples[-1].index = index
        trainer.append((np.asarray(logprobs) + rng.normal(0, 0.2, length)).tolist())
    report = mismatch(samples, trainer)
    for one, made, train in zip(report.samples, samples, trainer, strict=True):
        delta = [t - r for t, r, m in zip(train, made.rollout_log_probs or [], made.loss_mask or [], strict=True) if m]
        assert one.tokens == len(delta)
        assert one.k1 == pytest.approx(float(np.mean(delta)) if delta else 0.0)
        assert one.max_abs_delta == pytest.approx(max(map(abs, delta), default=0.0))
