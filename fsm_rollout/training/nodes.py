"""Internal: the token tree's parts (nodes, leaves, image references) and the data every tree operation reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FORMAT_VERSION = 1
"""``TokenTree.to_dict()["version"]``: raised when a field changes meaning or goes away."""


@dataclass(frozen=True)
class ImageRef:
    """An image's placeholder tokens inside a node: ``length`` tokens from ``offset`` (in the node), which are the
    image's placeholders ``first`` onwards (0 unless the image started in an ancestor node). The pixels are image
    ``image`` of training sequence ``sequence``'s ``multimodal_train_inputs``; ``hash`` is their content hash."""

    hash: str
    offset: int
    length: int
    first: int
    sequence: int
    image: int


@dataclass
class TreeNode:
    """A span of tokens: its ``parent`` (-1 for a root), ``depth`` (the position of its first token in every
    sequence through it), per-token arrays, and the ``sequences`` (leaves) whose path holds it.

    ``routed_sequence``/``routed_row`` refer each token to a row of a sequence's ``rollout_routed_experts`` (-1
    where none was recorded); ``weight_versions`` is None for tokens that were not generated.
    """

    id: int
    parent: int
    depth: int
    token_ids: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.int64]
    rollout_log_probs: npt.NDArray[np.float64]
    weight_versions: list[str | None]
    images: list[ImageRef]
    routed_sequence: npt.NDArray[np.int64]
    routed_row: npt.NDArray[np.int64]
    sequences: list[int]

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class TreeLeaf:
    """One training sequence: where it came from (``sample`` is the rollout's place in the input, ``index`` its
    ``Sample.index``, ``branch`` its ``metadata["branch"]``), its outcome, and its path of ``nodes``."""

    sequence: int
    sample: int
    index: int | None
    branch: int | None
    lineage: Any
    group_index: int | None
    reward: Any
    status: str
    reason: Any
    nodes: list[int]
    length: int
    prompt_length: int


@dataclass
class TreeData:
    """A tree's ``nodes`` (parents before children), ``leaves`` (one per training sequence, in order), the ``share``
    mode that built it and its ``stats``."""

    nodes: list[TreeNode]
    leaves: list[TreeLeaf]
    share: str
    stats: dict[str, Any]


__all__ = ["FORMAT_VERSION", "ImageRef", "TreeData", "TreeLeaf", "TreeNode"]
