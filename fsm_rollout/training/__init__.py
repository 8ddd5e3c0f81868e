"""Trainer glue: a batch of rollouts as a token tree (:func:`training_tree`, :class:`TokenTree`), packed into the
trainer's batches with their tree attention, and per-token results read back per sequence; the train/inference
mismatch of a batch, per token, per sample and per rollout event (:func:`mismatch`, :class:`MismatchReport`).

``docs/token-tree.md`` describes the format. Importing this package needs numpy only; the forward pass on a packed
batch (:mod:`fsm_rollout.training.tree_forward`) imports torch when called.

Its modules are internal: import from this package (or :mod:`fsm_rollout`).
"""

from fsm_rollout.training.mismatch import MismatchInputError, MismatchReport, mismatch
from fsm_rollout.training.nodes import ImageRef, TreeLeaf, TreeNode
from fsm_rollout.training.provenance import TreeBuildError
from fsm_rollout.training.tree import TokenTree, training_tree
from fsm_rollout.training.tree_pack import PackedBatch

__all__ = [
    "ImageRef",
    "MismatchInputError",
    "MismatchReport",
    "PackedBatch",
    "TokenTree",
    "TreeBuildError",
    "TreeLeaf",
    "TreeNode",
    "mismatch",
    "training_tree",
]
