"""``mismatch()`` reads its input in one pass over the batch: the report is the one the sequence-by-sequence
reading and the original arithmetic give, bit for bit, whatever form the trainer's logprobs come in (lists, tuples,
arrays, a mapping, a 2-D array, one flat array, a tensor) and whatever the samples hold (forks, no logprobs, no
loss mask, empty responses, values the one-pass reading refuses)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fsm_rollout import MismatchInputError, MismatchReport, Sample, mismatch, training_sequences
from fsm_rollout.training.mismatch_inputs import flat_inputs, per_sequence_inputs


def batch(seed: int, *, same_length: int | None = None) -> tuple[list[Sample], list[list[float]]]:
    """Rollouts (some forked), with and without logprobs and loss masks; the trainer's values near the rollout's."""
    rng = np.random.default_rng(seed)
    rollouts, trainer = [], []
    for index in range(40):
        chain = []
        for branch in range(int(rng.integers(1, 4))):
            length = same_length if same_length is not None else int(rng.integers(0, 25))
            sample = Sample(index=index, group_index=index // 4, tokens=[1] * (3 + length), response_length=length)
            kind = index % 5
            if kind != 1:
                sample.rollout_log_probs = (-rng.random(length)).tolist() if kind != 2 else [-0.5] * length
            if kind != 3:
                mask = rng.integers(0, 2, length).tolist()
                sample.loss_mask = mask if kind != 4 else [bool(m) for m in mask]
            sample.metadata["branch"] = branch
            chain.append(sample)
        last = chain[-1]
        last.branches = chain[:-1]
        rollouts.append(last)
    for sequence in training_sequences(rollouts):
        rollout = np.asarray(sequence.rollout_log_probs or [0.0] * sequence.response_length)
        trainer.append((rollout + rng.normal(0, 0.3, rollout.shape[0])).tolist())
    return rollouts, trainer


def reference(samples: list[Sample], trainer: list[Any]) -> dict[str, Any]:
    """The figures the original code computed: sequence-by-sequence reading, then its arithmetic."""
    sequences = training_sequences(samples)
    lengths = np.asarray([s.response_length for s in sequences], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    train, rollout, trained = per_sequence_inputs(sequences, list(trainer), lengths)
    delta = np.where(trained, train - rollout, 0.0)
    ratio = np.exp(delta)
    k3 = np.expm1(-delta) + delta
    clipped = trained & (ratio > 2.0)
    masked = trained & ((ratio < 0.5) | (ratio > 2.0))
    samples_out = []
    for number in range(len(sequences)):
        part = slice(int(offsets[number]), int(offsets[number + 1]))
        count = int(trained[part].sum())
        samples_out.append(
            (
                count,
                float(np.add.reduceat(delta[part], [0])[0]) / count if count else 0.0,
                float(np.add.reduceat(k3[part], [0])[0]) / count if count else 0.0,
                float(np.abs(delta[part]).max()) if count else 0.0,
                float(clipped[part].sum()) / count if count else 0.0,
                float(masked[part].sum()) / count if count else 0.0,
            )
        )
    return {"delta": delta, "ratio": ratio, "trained": trained, "samples": samples_out}


def figures(report: MismatchReport) -> list[tuple[int, float, float, float, float, float]]:
    return [
        (s.tokens, s.k1, s.k3, s.max_abs_delta, s.tis_clipped_fraction, s.icepop_masked_fraction)
        for s in report.samples
    ]


def check_identical(report: MismatchReport, expected: dict[str, Any]) -> None:
    assert np.array_equal(report.trained, expected["trained"])
    assert report.log_ratio.tobytes() == expected["delta"].tobytes()
    assert figures(report) == expected["samples"]
    tis = np.concatenate(report.weights("tis"))
    assert tis.tobytes() == np.where(expected["trained"], np.minimum(expected["ratio"], 2.0), 0.0).tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_form_of_trainer_logprobs_gives_the_original_report(seed: int) -> None:
    samples, trainer = batch(seed)
    expected = reference(samples, trainer)
    first = mismatch(samples, trainer, trainer_version="1")
    check_identical(first, expected)
    forms: list[Any] = [
        [tuple(values) for values in trainer],
        [np.asarray(values) for values in trainer],
        dict(enumerate(trainer)),
        np.concatenate([np.asarray(values, dtype=np.float64) for values in trainer]),
    ]
    for form in forms:
        report = mismatch(samples, form, trainer_version="1")
        check_identical(report, expected)
        assert report.to_dict() == first.to_dict()


def test_a_2d_array_a_tensor_and_float32_arrays_read_as_their_lists() -> None:
    torch = pytest.importorskip("torch")
    samples, trainer = batch(3, same_length=6)
    as_float32 = [np.asarray(values, dtype=np.float32) for values in trainer]
    expected = reference(samples, [values.tolist() for values in as_float32])
    for form in (np.stack(as_float32), torch.as_tensor(np.stack(as_float32)), as_float32):
        check_identical(mismatch(samples, form), expected)


def test_values_the_one_pass_reading_refuses_are_read_as_before() -> None:
    samples, trainer = batch(4)
    sequences = training_sequences(samples)
    trainer[1] = [str(value) for value in trainer[1]]  # type: ignore[misc]  # numpy parses text; the one-pass reading does not
    sequences[0].loss_mask = [float(m) for m in sequences[0].loss_mask or []]  # type: ignore[misc]  # floats: not bytes
    sequences[2].loss_mask = [2 * m for m in sequences[2].loss_mask or []]  # a 2 is not a trained token
    lengths = np.asarray([s.response_length for s in sequences], dtype=np.int64)
    new = flat_inputs(sequences, trainer, lengths)
    old = per_sequence_inputs(sequences, trainer, lengths)
    for made, before in zip(new, old, strict=True):
        assert made.dtype == before.dtype and made.tobytes() == before.tobytes()
    expected = reference(samples, trainer)
    check_identical(mismatch(samples, trainer), expected)
    flat = np.concatenate([np.asarray(values, dtype=np.float64) for values in trainer])
    check_identical(mismatch(samples, flat), expected)


def test_a_flat_array_of_the_wrong_length_names_both_lengths() -> None:
    samples, trainer = batch(5)
    flat = np.concatenate([np.asarray(values, dtype=np.float64) for values in trainer])
    with pytest.raises(MismatchInputError, match=f"flat array of {flat.size - 1} trainer logprobs for the batch's "
                                                 f"{flat.size} response tokens"):  # fmt: skip
        mismatch(samples, flat[:-1])
