"""Internal: the arrays :func:`fsm_rollout.mismatch` reads, flat over a batch's response tokens.

Turning tens of millions of Python floats into arrays is most of mismatch()'s work, so lists are read in one pass
over the whole batch (``np.fromiter`` over the chained lists; loss masks as bytes) instead of one array per
sequence, and numpy arrays (or tensors) are joined as they are. Input the one-pass reading refuses is read again
sequence by sequence, which finds the first sequence and position at fault and names them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Flat = tuple[Floats, Floats, npt.NDArray[np.bool_]]
LISTS = (list, tuple)


class MismatchInputError(ValueError):
    """Trainer logprobs that do not fit the samples: a wrong length, a value that is not finite, an unknown
    sample or sequence. The message names the sequence and position."""


def flat_inputs(sequences: Sequence[Any], trainer_logprobs: Any, lengths: npt.NDArray[np.int64]) -> Flat:
    """The trainer's logprobs, the rollout's and the trained flags (loss mask 1), flat over the response tokens of
    ``sequences`` (one after the other, ``lengths`` each). ``trainer_logprobs`` is one list, array or tensor per
    sequence (or a mapping from sequence number), a 2-D array with a row per sequence, or one flat 1-D array."""
    total = int(lengths.sum())
    given = _as_numpy(trainer_logprobs)
    if isinstance(given, np.ndarray) and given.ndim == 1 and given.dtype.kind in "fiub":
        if given.shape[0] != total:
            raise MismatchInputError(
                f"got a flat array of {given.shape[0]} trainer logprobs for the batch's {total} response tokens"
            )
        read = _rollout_and_mask(sequences, lengths, total)
        if read is None:  # read sequence by sequence, which names a sample whose arrays do not fit
            _, rollout, trained = per_sequence_inputs(sequences, [np.zeros(n) for n in lengths.tolist()], lengths)
        else:
            rollout, trained = read
        return given.astype(np.float64), rollout, trained
    values = _sequence_values(given, len(sequences))
    train = _trainer_flat(values, lengths, total)
    flat = _rollout_and_mask(sequences, lengths, total) if train is not None else None
    if train is None or flat is None:
        return per_sequence_inputs(sequences, values, lengths)  # raises naming what does not fit, or reads it slowly
    return train, flat[0], flat[1]


def _as_numpy(values: Any) -> Any:
    if hasattr(values, "detach"):  # a tensor: read without importing torch
        values = values.detach().cpu()
        return values.double().numpy() if str(values.dtype) == "torch.bfloat16" else values.numpy()
    return values


def _sequence_values(trainer_logprobs: Any, count: int) -> list[Any]:
    if isinstance(trainer_logprobs, Mapping):
        unknown = sorted(set(trainer_logprobs) - set(range(count)), key=str)
        if unknown:
            raise MismatchInputError(f"sequence {unknown[0]!r}: no such training sequence (there are {count})")
        missing = [number for number in range(count) if number not in trainer_logprobs]
        if missing:
            raise MismatchInputError(f"sequence {missing[0]}: no trainer logprobs given")
        return [trainer_logprobs[number] for number in range(count)]
    values = list(trainer_logprobs)
    if len(values) != count:
        raise MismatchInputError(
            f"sequence {min(len(values), count)}: got trainer logprobs for {len(values)} sequences, "
            f"training_sequences has {count}"
        )
    return values


def _trainer_flat(values: list[Any], lengths: npt.NDArray[np.int64], total: int) -> Floats | None:
    """All sequences' values in one array, or None when one does not fit (wrong length, not plain numbers)."""
    values = [_as_numpy(value) for value in values]
    sizes = lengths.tolist()
    if all(isinstance(value, LISTS) for value in values):
        if any(len(value) != size for value, size in zip(values, sizes, strict=True)):
            return None
        out = np.empty(total, dtype=np.float64)
        return out if _pack_floats(out, values, sizes) else None
    if all(isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "fiub" for value in values):
        if any(value.shape[0] != size for value, size in zip(values, sizes, strict=True)):
            return None
        try:
            return np.concatenate(values, dtype=np.float64, casting="unsafe") if values else np.zeros(0)
        except (TypeError, ValueError):
            return None
    return None


def _rollout_and_mask(
    sequences: Sequence[Any], lengths: npt.NDArray[np.int64], total: int
) -> tuple[Floats, npt.NDArray[np.bool_]] | None:
    """The samples' rollout logprobs (0.0 where a sample has none) and trained flags, or None when a sample's do not
    cover its response or are not plain lists of numbers (0/1 for the mask)."""
    rollouts: list[Any] = []
    masks: list[bytes] = []
    rollout_flat = np.zeros(total, dtype=np.float64)
    try:
        for sample, size in zip(sequences, lengths.tolist(), strict=True):
            rollout, mask = sample.rollout_log_probs, sample.loss_mask
            if rollout and (not isinstance(rollout, LISTS) or len(rollout) != size):
                return None
            if mask is not None and (not isinstance(mask, LISTS) or len(mask) != size):
                return None
            rollouts.append(rollout if rollout else None)  # None: no logprobs, read as 0.0
            masks.append(b"\x01" * size if mask is None else bytes(mask))
    except (TypeError, ValueError):  # a mask value that is not an integer within a byte, or an ambiguous truth
        return None
    if not _pack_floats(rollout_flat, rollouts, lengths.tolist()):
        return None
    mask_flat = np.frombuffer(b"".join(masks), dtype=np.uint8)
    if mask_flat.size and int(mask_flat.max()) > 127:  # the per-sequence reading refuses these as int8
        return None
    return rollout_flat, mask_flat == 1


def _pack_floats(out: Floats, parts: Sequence[Sequence[Any] | None], sizes: Sequence[int]) -> bool:
    """Write the lists one after the other into ``out`` (``sizes`` values each; a None part is left as ``out``
    holds it), converting each value as ``float()`` does: ``struct`` reads a list of Python floats about twice as
    fast as ``np.fromiter`` or ``np.asarray``. False when a value is not a plain number."""
    formats: dict[int, struct.Struct] = {}
    position = 0
    try:
        for part, size in zip(parts, sizes, strict=True):
            if part is not None and size:
                layout = formats.get(size)
                if layout is None:
                    layout = formats[size] = struct.Struct(f"{size}d")
                layout.pack_into(out.data, position, *part)
            position += 8 * size
    except (struct.error, TypeError, ValueError, OverflowError):
        return False
    return True


def _as_floats(values: Any, number: int) -> Floats:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise MismatchInputError(f"sequence {number}: trainer logprobs are not numbers: {error}") from error
    if array.ndim != 1:
        raise MismatchInputError(f"sequence {number}: trainer logprobs must be a flat list, got shape {array.shape}")
    return array


def per_sequence_inputs(sequences: Sequence[Any], values: list[Any], lengths: npt.NDArray[np.int64]) -> Flat:
    """The same arrays, one sequence at a time (the reading before the one-pass one, kept as its fallback and its
    reference): raises for the first sequence that does not fit."""
    trainer_parts, rollout_parts, mask_parts = [], [], []
    for number, (sample, given) in enumerate(zip(sequences, values, strict=True)):
        length = int(lengths[number])
        train = _as_floats(given, number)
        if train.shape[0] != length:
            raise MismatchInputError(
                f"sequence {number}, position {min(train.shape[0], length)}: got {train.shape[0]} trainer "
                f"logprobs for {length} response tokens"
            )
        rollout = sample.rollout_log_probs or [0.0] * length
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * length
        if len(rollout) != length or len(mask) != length:
            raise MismatchInputError(f"sequence {number}: the sample's logprobs or loss mask do not cover its response")
        trainer_parts.append(train)
        rollout_parts.append(np.asarray(rollout, dtype=np.float64))
        mask_parts.append(np.asarray(mask, dtype=np.int8))
    empty = np.zeros(0)
    train_flat = np.concatenate(trainer_parts) if trainer_parts else empty
    rollout_flat = np.concatenate(rollout_parts) if rollout_parts else empty
    trained = (np.concatenate(mask_parts) if mask_parts else empty.astype(np.int8)) == 1
    return train_flat, rollout_flat, trained


__all__ = ["MismatchInputError", "flat_inputs", "per_sequence_inputs"]
