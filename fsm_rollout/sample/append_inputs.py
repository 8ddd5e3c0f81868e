"""What ``Sample.append_response_tokens`` receives, checked and converted: token ids, logprobs, top-p spans and
routed experts. Every error names the sample and says what was wrong."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from fsm_rollout.errors import RoutingReplayError, SampleAppendError
from fsm_rollout.types import TokenIds, TurnMeta


class Named(Protocol):
    """What an error message needs of the sample it is about (a :class:`~fsm_rollout.sample.Sample`; this module
    builds the sample's inputs and so does not import it)."""

    @property
    def index(self) -> int | None: ...

    @property
    def session_id(self) -> str | None: ...


class _SupportsToList(Protocol):
    """Anything that converts itself to (nested) Python lists: numpy arrays, torch tensors."""

    def tolist(self) -> Any: ...


IntsLike: TypeAlias = Sequence[int] | _SupportsToList
"""Token ids as a list, tuple, 1-D numpy array or 1-D tensor."""

FloatsLike: TypeAlias = Sequence[float] | _SupportsToList
"""Logprobs as a list, tuple, 1-D numpy array or 1-D tensor."""


def describe(sample: Named) -> str:
    """How error messages name a sample."""
    return f"sample index={sample.index} session_id={sample.session_id}"


def int_list(values: Any, what: str, sample: Named) -> list[int]:
    """``values`` as a flat list of Python ints, or ``SampleAppendError`` saying what was wrong."""
    if type(values) is list and all(type(item) is int for item in values):
        return list(values)  # the common case, without ABC isinstance checks per token
    items = _flat_items(values, what, sample)
    for item in items:
        if not isinstance(item, numbers.Integral) or isinstance(item, bool):
            raise SampleAppendError(
                f"{describe(sample)}: expected {what} to hold integers; got {type(item).__name__} {item!r}"
            )
    return [int(item) for item in items]


def float_list(values: Any, what: str, sample: Named) -> list[float]:
    """``values`` as a flat list of Python floats, or ``SampleAppendError`` saying what was wrong."""
    if type(values) is list and all(type(item) is float for item in values):
        return list(values)
    items = _flat_items(values, what, sample)
    for item in items:
        if not isinstance(item, numbers.Real) or isinstance(item, bool):
            raise SampleAppendError(
                f"{describe(sample)}: expected {what} to hold numbers; got {type(item).__name__} {item!r}"
            )
    return [float(item) for item in items]


def _flat_items(values: Any, what: str, sample: Named) -> list[Any]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise SampleAppendError(
            f"{describe(sample)}: expected {what} as a list, tuple, 1-D array or 1-D tensor; "
            f"got {type(values).__name__}"
        )
    items = list(values)
    if any(isinstance(item, Sequence) and not isinstance(item, str | bytes) for item in items):
        raise SampleAppendError(f"{describe(sample)}: expected {what} to be one-dimensional; got nested values")
    return items


def top_p_spans(meta: TurnMeta, new_count: int, sample: Named) -> tuple[TokenIds, list[int]] | None:
    """The meta's top-p ids and offsets for ``new_count`` tokens, checked; None when the meta has none."""
    raw_ids, raw_offsets = meta.top_p_token_ids, meta.top_p_token_offsets
    if raw_ids is None and raw_offsets is None:
        return None
    if raw_ids is None or raw_offsets is None:
        missing = "top_p_token_ids" if raw_ids is None else "top_p_token_offsets"
        raise SampleAppendError(
            f"{describe(sample)}: top-p spans need both top_p_token_ids and top_p_token_offsets; got {missing}=None"
        )
    ids = int_list(raw_ids, "top_p_token_ids", sample)
    offsets = int_list(raw_offsets, "top_p_token_offsets", sample)
    if len(offsets) != new_count + 1:
        raise SampleAppendError(
            f"{describe(sample)}: expected {new_count + 1} top-p offsets for {new_count} tokens; got {len(offsets)}"
        )
    if offsets[0] != 0:
        raise SampleAppendError(f"{describe(sample)}: expected top-p offsets to start at 0; got {offsets[0]}")
    if offsets[-1] != len(ids):
        raise SampleAppendError(
            f"{describe(sample)}: expected the last top-p offset to equal the {len(ids)} top-p ids; got {offsets[-1]}"
        )
    if any(later < earlier for earlier, later in pairwise(offsets)):
        raise SampleAppendError(f"{describe(sample)}: expected non-decreasing top-p offsets; got {offsets}")
    return ids, offsets


def routed_experts_array(
    raw: Any, expert_dims: tuple[int, int] | None, rows: int, sample: Named
) -> npt.NDArray[np.int32] | None:
    """The turn's routing as int32 ``(rows, num_layers, topk)``; None when absent or its shape is unknown."""
    if raw is None or expert_dims is None:
        return None
    num_layers, topk = expert_dims
    if num_layers <= 0 or topk <= 0:
        raise RoutingReplayError(
            f"{describe(sample)}: expected expert_dims as positive (num_layers, topk); got {expert_dims}"
        )
    if not isinstance(raw, np.ndarray) or not np.issubdtype(raw.dtype, np.integer):
        got = f"array of {raw.dtype}" if isinstance(raw, np.ndarray) else type(raw).__name__
        raise RoutingReplayError(f"{describe(sample)}: expected routed_experts as an integer array; got {got}")
    expected = rows * num_layers * topk
    if raw.size != expected:
        raise RoutingReplayError(
            f"{describe(sample)}: routed_experts element count {raw.size} does not match rows * num_layers "
            f"* topk = {rows} * {num_layers} * {topk} = {expected}"
        )
    limits = np.iinfo(np.int32)
    if raw.size and (int(raw.min()) < limits.min or int(raw.max()) > limits.max):
        raise RoutingReplayError(f"{describe(sample)}: routed_experts values do not fit in int32")
    return raw.astype(np.int32).reshape(rows, num_layers, topk)
