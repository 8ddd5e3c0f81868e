"""The train/inference mismatch of a batch: per token, per sample and per rollout event.

``trainer_logprobs`` holds one list (or array, or tensor) per training sequence (:func:`fsm_rollout.training_sequences`
order), one value per response token, as ``sample.rollout_log_probs`` does; or a 2-D array with one row per sequence;
or one flat array of the batch's response tokens, sequence after sequence (``TokenTree.unpack(values,
response_only=True)`` gives the per-sequence arrays from a packed tree). Values at loss-mask-0 positions are not read.
With
``Δ = log p_train - log p_rollout`` per trained token:

- the TIS weight is ``min(exp(Δ), tis_cap)``; the MIS weight is ``exp(Δ)``, or 0 where ``exp(Δ) > tis_cap``; the
  IcePop weight is ``exp(Δ)`` inside ``icepop = (low, high)``, else 0;
- K1 is ``mean(Δ)`` and K3 ``mean(r - 1 - log r)`` with ``r = p_rollout / p_train = exp(-Δ)``;
- the event groups (:mod:`fsm_rollout.training.mismatch_events`) give each the token count, K3 and max ``|Δ|``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fsm_rollout.sample import Sample, training_sequences
from fsm_rollout.training.mismatch_events import DIMENSIONS, PER_SEQUENCE, label_sequences, staleness_of
from fsm_rollout.training.mismatch_inputs import MismatchInputError, flat_inputs

Floats = npt.NDArray[np.float64]
WeightKind = Literal["tis", "mis", "icepop"]


@dataclass(frozen=True, slots=True)
class SampleMismatch:
    """One training sequence's statistics over its trained tokens (slotted: a batch makes one per sequence, and
    fewer, smaller objects leave the garbage collector less to do while the batch's lists are alive)."""

    sequence: int
    index: int | None
    branch: int
    tokens: int
    k1: float
    k3: float
    max_abs_delta: float
    tis_clipped_fraction: float
    icepop_masked_fraction: float


SAMPLE_FIELDS = tuple(item.name for item in fields(SampleMismatch))


@dataclass(frozen=True)
class EventGroup:
    """The trained tokens that went through one rollout event."""

    dimension: str
    label: str
    tokens: int
    k3: float
    max_abs_delta: float
    staleness: int | None = None


@dataclass
class MismatchReport:
    """What :func:`mismatch` found. ``log_ratio`` and ``trained`` are flat over the batch's response tokens,
    ``offsets`` delimit each sequence's (``offsets[i]:offsets[i + 1]``)."""

    tis_cap: float
    icepop: tuple[float, float]
    offsets: npt.NDArray[np.int64]
    log_ratio: Floats
    trained: npt.NDArray[np.bool_]
    samples: list[SampleMismatch]
    events: list[EventGroup]
    tokens: int
    k1: float
    k3: float
    max_abs_delta: float
    tis_clipped_fraction: float
    icepop_masked_fraction: float
    _ratio: Floats | None = field(repr=False, default=None)  # exp(log_ratio), made when weights are first asked for

    def weights(self, kind: WeightKind = "tis") -> list[Floats]:
        """Per-token weights in ``training_sequences`` order, one array per sequence over its response tokens
        (0 at untrained positions)."""
        if self._ratio is None:
            self._ratio = np.exp(self.log_ratio)
        ratio = self._ratio
        if kind == "tis":
            flat = np.minimum(ratio, self.tis_cap)
        elif kind == "mis":
            flat = np.where(ratio > self.tis_cap, 0.0, ratio)
        elif kind == "icepop":
            low, high = self.icepop
            flat = np.where((ratio >= low) & (ratio <= high), ratio, 0.0)
        else:
            raise ValueError(f"weights kind must be 'tis', 'mis' or 'icepop', got {kind!r}")
        flat = np.where(self.trained, flat, 0.0)
        return np.split(flat, self.offsets[1:-1])

    def mask(self, kind: Literal["mis", "icepop"]) -> list[npt.NDArray[np.bool_]]:
        """Per-token masks (True: the token keeps its gradient) in ``training_sequences`` order."""
        return [weights > 0 for weights in self.weights(kind)]

    def worst_event(self) -> EventGroup | None:
        """The event group with the largest K3 among those with tokens (ties: the larger max ``|Δ|``)."""
        groups = [group for group in self.events if group.tokens]
        return max(groups, key=lambda group: (group.k3, group.max_abs_delta), default=None)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (no per-token arrays)."""
        return {
            "tokens": self.tokens,
            "k1": self.k1,
            "k3": self.k3,
            "max_abs_delta": self.max_abs_delta,
            "tis_clipped_fraction": self.tis_clipped_fraction,
            "icepop_masked_fraction": self.icepop_masked_fraction,
            "tis_cap": self.tis_cap,
            "icepop": list(self.icepop),
            "samples": [{name: getattr(sample, name) for name in SAMPLE_FIELDS} for sample in self.samples],
            "events": [vars(group) for group in self.events],
        }


def _check_finite(flat: Floats, trained: npt.NDArray[np.bool_], offsets: npt.NDArray[np.int64], what: str) -> None:
    """Raise naming the first trained position whose value is not finite."""
    # one plain pass when all is well (a NaN or an infinity anywhere makes the sum so; a masked ``sum(where=)`` costs
    # seven times as much); a sum that is not finite only sends the search below to the trained positions
    if np.isfinite(flat.sum()):
        return
    bad = np.flatnonzero(trained & ~np.isfinite(flat))
    if bad.size:
        position = int(bad[0])
        number = int(np.searchsorted(offsets, position, side="right")) - 1
        raise MismatchInputError(
            f"sequence {number}, position {position - int(offsets[number])}: {what} is {flat[position]} (not finite)"
        )


def mismatch(
    samples: Iterable[Sample],
    trainer_logprobs: Sequence[Any] | Mapping[int, Any] | npt.NDArray[Any],
    *,
    tis_cap: float = 2.0,
    icepop: tuple[float, float] = (0.5, 2.0),
    trainer_version: Any = None,
    image_window: int = 32,
    history_policy: str | None = None,
    engine: str | None = None,
) -> MismatchReport:
    """The train/inference mismatch of ``samples`` (the module's docstring).

    ``trainer_version`` is the weight version the trainer computed its logprobs at (staleness ``w - v`` when both
    read as integers). ``history_policy`` and ``engine`` label samples whose metadata does not say. Raises
    :class:`MismatchInputError` for input that does not fit.
    """
    if not tis_cap > 0 or not 0 <= icepop[0] <= icepop[1]:
        raise ValueError(f"need tis_cap > 0 and 0 <= icepop low <= high, got {tis_cap} and {icepop}")
    try:
        sequences = training_sequences(samples)
    except TypeError as error:
        raise MismatchInputError(str(error)) from error
    lengths = np.fromiter((sample.response_length for sample in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    train_flat, rollout_flat, trained = flat_inputs(sequences, trainer_logprobs, lengths)
    _check_finite(train_flat, trained, offsets, "the trainer logprob")
    _check_finite(rollout_flat, trained, offsets, "the rollout logprob")
    # untrained positions count as Δ = 0, so every figure below is 0 there
    # in place where the result is the same: each fresh batch-sized array costs as much as the arithmetic on it
    delta = np.subtract(train_flat, rollout_flat, out=train_flat)  # flat_inputs' arrays are this call's own
    np.copyto(delta, 0.0, where=~trained)
    k3 = np.negative(delta, out=rollout_flat)  # the rollout's values are read: their array holds K3's terms
    np.expm1(k3, out=k3)
    k3 += delta  # r - 1 - log r with r = exp(-delta), exact for tiny delta
    low, high = icepop
    clipped, masked = _clipped_and_masked(delta, trained, tis_cap, low, high)
    per_sequence = _per_sequence_sums(offsets, trained, delta, k3, clipped, masked)
    report = MismatchReport(
        tis_cap=tis_cap,
        icepop=(low, high),
        offsets=offsets,
        log_ratio=delta,
        trained=trained,
        samples=_per_sample(sequences, per_sequence),
        events=[],
        **_totals(trained, delta, k3, per_sequence["max"], clipped, masked),
    )
    labels = label_sequences(
        sequences,
        offsets,
        trained,
        trainer_version=trainer_version,
        image_window=image_window,
        history_policy=history_policy,
        engine=engine,
    )
    for dimension in DIMENSIONS:
        names, codes = labels[dimension].names, labels[dimension].codes
        if dimension in PER_SEQUENCE:  # from the sequences' sums: no pass over the tokens
            figures = _label_figures(names, codes, per_sequence["tokens"], per_sequence["k3"], per_sequence["max"])
        else:
            figures = _run_figures(names, codes, trained, k3, delta)
        report.events.extend(_groups(dimension, names, *figures))
    return report


RATIO_CHUNK = 1 << 16
"""Tokens per chunk of ratios: a cache-sized buffer instead of a batch-sized array the report may never need."""


def _clipped_and_masked(
    delta: Floats, trained: npt.NDArray[np.bool_], tis_cap: float, low: float, high: float
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """The trained tokens whose ratio ``exp(Δ)`` is over ``tis_cap`` (TIS clips them), and those outside ``[low,
    high]`` (IcePop masks them), with the ratios made a chunk at a time."""
    clipped = np.empty(delta.size, dtype=bool)
    masked = np.empty(delta.size, dtype=bool)
    buffer = np.empty(min(delta.size, RATIO_CHUNK))
    for start in range(0, delta.size, RATIO_CHUNK):
        part = slice(start, start + RATIO_CHUNK)
        ratio = np.exp(delta[part], out=buffer[: len(delta[part])])
        np.greater(ratio, tis_cap, out=clipped[part])
        outside = masked[part]
        np.less(ratio, low, out=outside)
        outside |= ratio > high
    clipped &= trained
    masked &= trained
    return clipped, masked


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0


def _totals(trained: Any, delta: Floats, k3: Floats, maxima: Floats, clipped: Any, masked: Any) -> dict[str, Any]:
    count = int(np.count_nonzero(trained))
    return {
        "tokens": count,
        "k1": _mean(float(delta.sum()), count),
        "k3": _mean(float(k3.sum()), count),
        "max_abs_delta": float(maxima.max()) if delta.size else 0.0,  # the sequences' maxima, 0 or more each
        "tis_clipped_fraction": _mean(float(np.count_nonzero(clipped)), count),
        "icepop_masked_fraction": _mean(float(np.count_nonzero(masked)), count),
    }


def _counts(flags: npt.NDArray[np.bool_], starts: npt.NDArray[np.int64]) -> Floats:
    """The True flags from each start to the next (or the end), as floats: integer sums of the flags' bytes cost
    half what float sums of the booleans do, and are exact."""
    wide = np.int32 if flags.size < 2**31 else np.int64
    return np.add.reduceat(flags.view(np.uint8), starts, dtype=wide).astype(np.float64)


def _max_abs(delta: Floats, starts: npt.NDArray[np.int64]) -> Floats:
    """The max ``|Δ|`` from each start to the next: max(max Δ, -min Δ), exactly the max of ``abs(Δ)`` without a
    batch-sized array of it (+ 0.0 turns a -0.0 into the 0.0 ``abs`` gives)."""
    return np.maximum(np.maximum.reduceat(delta, starts), -np.minimum.reduceat(delta, starts)) + 0.0


def _per_sequence_sums(
    offsets: npt.NDArray[np.int64], trained: Any, delta: Floats, k3: Floats, clipped: Any, masked: Any
) -> dict[str, Floats]:
    """Each sequence's sums (trained tokens, Δ, K3 terms, clipped, masked) and max ``|Δ|``."""
    count = len(offsets) - 1
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    firsts = starts[nonempty]

    def spread(values: Floats) -> Floats:
        out = np.zeros(count)
        out[nonempty] = values
        return out

    if not delta.size:
        zeros = np.zeros(count)
        return {name: zeros for name in ("tokens", "k1", "k3", "clipped", "masked", "max")}
    return {"tokens": spread(_counts(trained, firsts)), "k1": spread(np.add.reduceat(delta, firsts)),
            "k3": spread(np.add.reduceat(k3, firsts)), "clipped": spread(_counts(clipped, firsts)),
            "masked": spread(_counts(masked, firsts)), "max": spread(_max_abs(delta, firsts))}  # fmt: skip


def _per_sample(sequences: Sequence[Sample], sums: Mapping[str, Floats]) -> list[SampleMismatch]:
    counts = sums["tokens"].astype(np.int64).tolist()
    k1s, k3s, clips, masks, maxima = (sums[name].tolist() for name in ("k1", "k3", "clipped", "masked", "max"))
    out = []
    for number, sample in enumerate(sequences):
        count = counts[number]
        metadata = sample.metadata
        out.append(
            SampleMismatch(
                sequence=number,
                index=sample.index,
                branch=int(metadata.get("branch", 0)) if isinstance(metadata, dict) else 0,
                tokens=count,
                k1=_mean(k1s[number], count),
                k3=_mean(k3s[number], count),
                max_abs_delta=maxima[number],
                tis_clipped_fraction=_mean(clips[number], count),
                icepop_masked_fraction=_mean(masks[number], count),
            )
        )
    return out


def _label_figures(
    names: list[str], codes: Any, counts: Floats, k3_sums: Floats, maxima: Floats
) -> tuple[Any, Any, Any]:
    """Each label's token count, K3 sum and max ``|Δ|`` from the same figures per item (sequence or run)."""
    size = len(names)
    label_counts = np.bincount(codes, weights=counts, minlength=size)
    label_k3 = np.bincount(codes, weights=k3_sums, minlength=size)
    label_max = np.zeros(size)
    np.maximum.at(label_max, codes, maxima)
    return label_counts, label_k3, label_max


def _run_figures(
    names: list[str], codes: Any, trained: npt.NDArray[np.bool_], k3: Floats, delta: Floats
) -> tuple[Any, Any, Any]:
    """Each label's figures over per-token ``codes``. Labels come in runs (spans, windows, turns), so the sums and
    maxima are taken per run, then per label: a few passes over the batch whatever the number of labels. ``k3``
    and ``delta`` are 0 at untrained positions."""
    if not codes.size:
        return np.zeros(len(names)), np.zeros(len(names)), np.zeros(len(names))
    starts = np.concatenate(([0], np.flatnonzero(codes[1:] != codes[:-1]) + 1))
    return _label_figures(
        names, codes[starts], _counts(trained, starts), np.add.reduceat(k3, starts), _max_abs(delta, starts)
    )


def _groups(dimension: str, names: list[str], counts: Floats, k3_sums: Floats, maxima: Floats) -> list[EventGroup]:
    """The event groups of the labels that have trained tokens."""
    groups = []
    for code, name in enumerate(names):
        count = int(counts[code])
        if count:
            groups.append(
                EventGroup(
                    dimension=dimension,
                    label=name,
                    tokens=count,
                    k3=_mean(float(k3_sums[code]), count),
                    max_abs_delta=float(maxima[code]),
                    staleness=staleness_of(name) if dimension == "version" else None,
                )
            )
    return groups


__all__ = ["EventGroup", "MismatchInputError", "MismatchReport", "SampleMismatch", "mismatch"]
