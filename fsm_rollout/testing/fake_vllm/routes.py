"""The fake model's expert routing: what ``choices[0].routed_experts`` holds when the fake server is asked for it.

vLLM sends one row per token of prompt plus output, less the last (row ``i`` is the routing of the forward pass
that took token ``i`` as input), as base64 ``.npy`` of int32 ``(rows, num_layers, topk)``. The fake's routing of a
row is a function of the row, the layer, the slot and the weight version it was computed under, so a test can tell
which request, under which version, computed each row: the prefill rows carry the version the request started
with, each decode row the version of the token it produced.
"""

from __future__ import annotations

import base64
import io
import zlib
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

ExpertDims = tuple[int, int]
"""``(num_layers, topk)``."""


def check_expert_dims(dims: object) -> ExpertDims | None:
    """``dims`` as ``(num_layers, topk)`` of positive ints, or None; anything else raises ``ValueError``."""
    if dims is None:
        return None
    if not isinstance(dims, tuple) or len(dims) != 2 or not all(type(value) is int and value > 0 for value in dims):
        raise ValueError(f"routed_experts must be (num_layers, topk) of positive ints, got {dims!r}")
    return dims[0], dims[1]


def version_routes(version: str, start: int, end: int, dims: ExpertDims) -> npt.NDArray[np.int32]:
    """The routing of rows ``[start, end)`` computed under ``version``: int32 ``(end - start, num_layers, topk)``."""
    layers, topk = dims
    rows = np.arange(start, end, dtype=np.int64)[:, None, None]
    layer = np.arange(layers, dtype=np.int64)[None, :, None]
    slot = np.arange(topk, dtype=np.int64)[None, None, :]
    seed = zlib.crc32(version.encode())
    return ((seed + rows * 7919 + layer * 104729 + slot * 1299709) % 2**31).astype(np.int32)


def answer_routes(prompt_len: int, runs: Iterable[tuple[str, int]], start_version: str, dims: ExpertDims) -> str:
    """``routed_experts`` of an answer: prefill rows under ``start_version``, then one row per output token under
    that token's version (``runs`` of ``(version, token count)``), as vLLM encodes them."""
    pieces = [version_routes(start_version, 0, max(prompt_len - 1, 0), dims)]
    row = max(prompt_len - 1, 0)
    for version, count in runs:
        if count > 0:
            pieces.append(version_routes(version, row, row + count, dims))
            row += count
    buffer = io.BytesIO()
    np.save(buffer, np.concatenate(pieces), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


__all__ = ["ExpertDims", "answer_routes", "check_expert_dims", "version_routes"]
