"""Internal: a token tree packed into the trainer's batches (:meth:`TokenTree.pack`), with their attention structure.

A batch holds whole nodes, parents before children, and for each sequence in it the whole path from its root, so
every token can attend to all of its ancestors. Sequences are taken in the tree's depth-first order, so siblings
that share a prefix land in the same batch; a prefix whose sequences do not all fit in one batch is repeated in the
next with loss mask 0 (by the tree's provenance rule a shared node never holds a generated token, so no loss is
counted twice either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from fsm_rollout.training.nodes import ImageRef, TreeData
from fsm_rollout.training.provenance import TreeBuildError

IntArray = npt.NDArray[np.int64]


@dataclass
class PackedBatch:
    """One forward pass's tokens, flat, in the tree's order.

    Per token: ``token_ids``, ``position_ids`` (its depth in its sequences), ``parent`` (the batch index of the
    token before it in its sequences, -1 for a first token: the token whose logits predict this one),
    ``node_of_token`` (its tree node), ``loss_mask`` (0 on a repeated copy), ``rollout_log_probs``,
    ``weight_versions`` and ``sequence_of_token`` (the one training sequence whose path holds it, -1 when several
    do; a generated token always has one). ``leaf_token_index[sequence]`` lists the batch indices of a sequence's
    tokens in its flat order; ``images`` places each image reference at its batch offset.
    """

    token_ids: IntArray
    position_ids: IntArray
    parent: IntArray
    node_of_token: IntArray
    loss_mask: IntArray
    rollout_log_probs: npt.NDArray[np.float64]
    weight_versions: list[str | None]
    sequence_of_token: IntArray
    leaf_token_index: dict[int, IntArray]
    nodes: list[int]
    images: list[tuple[int, ImageRef]] = field(default_factory=list)
    ancestors: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    """``ancestors[i, j]``: the batch's node ``j`` is node ``i`` or one of its ancestors (batch-local numbering)."""
    local_node: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.token_ids)

    def attention_mask(self) -> npt.NDArray[np.bool_]:
        """``(tokens, tokens)`` booleans, True where the query token (row) may attend to the key token (column):
        itself and its ancestors only. ``torch.nn.functional.scaled_dot_product_attention`` takes it as it is (add
        the batch and head dimensions: ``mask[None, None]``)."""
        local = self.local_node
        order = np.arange(len(local))
        same = local[:, None] == local[None, :]
        mask: npt.NDArray[np.bool_] = self.ancestors[local[:, None], local[None, :]] & (
            ~same | (order[None, :] <= order[:, None])
        )
        return mask

    def block_mask(self, *, block_size: int = 128, device: str = "cpu") -> Any:
        """The same attention as a FlexAttention ``BlockMask`` (torch imported here; raises ``RuntimeError`` when
        this torch has no ``torch.nn.attention.flex_attention``)."""
        try:
            import torch
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as error:
            raise RuntimeError(f"this torch has no FlexAttention: {error}") from error
        local = torch.as_tensor(self.local_node, device=device)
        ancestors = torch.as_tensor(self.ancestors, device=device)

        def mask_mod(batch: Any, head: Any, query: Any, key: Any) -> Any:
            return ancestors[local[query], local[key]] & ((local[query] != local[key]) | (key <= query))

        size = len(self)
        return create_block_mask(mask_mod, None, None, size, size, device=device, BLOCK_SIZE=block_size)


def pack_tree(tree: TreeData, max_tokens: int) -> list[PackedBatch]:
    """The batches :meth:`TokenTree.pack` returns."""
    if max_tokens <= 0:
        raise TreeBuildError(f"max_tokens must be positive; got {max_tokens}")
    sizes = [len(node.token_ids) for node in tree.nodes]  # read once: packing asks for them per sequence
    for node in tree.nodes:
        if sizes[node.id] > max_tokens:
            raise TreeBuildError(
                f"tree node {node.id} (depth {node.depth}, sequences {node.sequences[:8]}) holds {len(node)} tokens, "
                f"more than max_tokens={max_tokens}; packing never splits a node"
            )
    last = np.fromiter((leaf.nodes[-1] if leaf.nodes else -1 for leaf in tree.leaves), np.int64, len(tree.leaves))
    ends = np.argsort(last, kind="stable").tolist()  # by last node, then by number
    groups: list[tuple[list[int], set[int]]] = []
    current: list[int] = []
    held: set[int] = set()
    size = 0
    for number in ends:
        leaf = tree.leaves[number]
        if leaf.length > max_tokens:
            raise TreeBuildError(
                f"training sequence {number} (sample {leaf.sample}, branch {leaf.branch}) holds {leaf.length} tokens, "
                f"more than max_tokens={max_tokens}; each sequence's whole path goes in one batch"
            )
        extra = 0
        for node in leaf.nodes:
            if node not in held:
                extra += sizes[node]
        if current and size + extra > max_tokens:
            groups.append((current, held))
            current, held, size = [], set(), 0
            extra = leaf.length
        current.append(number)
        held.update(leaf.nodes)
        size += extra
    if current:
        groups.append((current, held))
    seen: set[int] = set()
    batches = []
    for sequences, nodes in groups:
        batches.append(_batch(tree, sizes, sequences, sorted(nodes), seen))
        seen.update(nodes)
    return batches


def _batch(tree: TreeData, sizes: list[int], sequences: list[int], nodes: list[int], seen: set[int]) -> PackedBatch:
    """One batch of ``nodes`` (sorted: the tree numbers parents before children); ``seen`` were in earlier ones.

    The per-token arrays are built per node in one step each (a node's id, owner and depth repeated over its
    tokens), not token by token."""
    parts = [tree.nodes[node_id] for node_id in nodes]
    counts = np.fromiter((sizes[node_id] for node_id in nodes), dtype=np.int64, count=len(parts))
    starts = np.zeros(len(parts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    total = int(counts.sum())
    start = dict(zip(nodes, starts.tolist(), strict=True))
    local = {node: number for number, node in enumerate(nodes)}
    ancestors = np.zeros((len(nodes), len(nodes)), dtype=bool)
    heads = np.full(len(parts), -1, dtype=np.int64)  # each node's first token's parent (-1 for a root)
    for here, node in enumerate(parts):
        if node.parent >= 0:
            ancestors[here] = ancestors[local[node.parent]]
            heads[here] = start[node.parent] + sizes[node.parent] - 1
        ancestors[here, here] = True
    order = np.arange(total, dtype=np.int64)
    begin = np.repeat(starts, counts)
    parent = order - 1
    parent[starts[counts > 0]] = heads[counts > 0]
    owners = np.fromiter((node.sequences[0] if len(node.sequences) == 1 else -1 for node in parts), dtype=np.int64,
                         count=len(parts))  # fmt: skip
    fresh = np.fromiter((node.id not in seen for node in parts), dtype=bool, count=len(parts))
    depths = np.fromiter((node.depth for node in parts), dtype=np.int64, count=len(parts))

    def joined(name: str, dtype: Any) -> Any:
        arrays = [getattr(node, name) for node in parts]
        return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)

    images = [(start[node.id] + ref.offset, ref) for node in parts for ref in node.images]
    index = _path_indices(tree, sizes, start, sorted(sequences))
    return PackedBatch(
        token_ids=joined("token_ids", np.int64),
        position_ids=np.repeat(depths, counts) + order - begin,
        parent=parent,
        node_of_token=np.repeat(np.asarray(nodes, dtype=np.int64), counts),
        loss_mask=joined("loss_mask", np.int64) * np.repeat(fresh, counts),  # 0 on a repeated copy
        rollout_log_probs=joined("rollout_log_probs", np.float64),
        weight_versions=list(chain.from_iterable(node.weight_versions for node in parts)),
        sequence_of_token=np.repeat(owners, counts),
        leaf_token_index=index,
        nodes=list(nodes),
        images=images,
        ancestors=ancestors,
        local_node=np.repeat(np.arange(len(parts), dtype=np.int64), counts),
    )


def _path_indices(tree: TreeData, sizes: list[int], start: dict[int, int], numbers: list[int]) -> dict[int, IntArray]:
    """The batch indices of each sequence's tokens, its path's nodes' spans one after another: computed for all of
    the batch's sequences in one gather, then split per sequence (views of one array)."""
    paths = [tree.leaves[number].nodes for number in numbers]
    steps = list(chain.from_iterable(paths))
    counts = np.fromiter((sizes[node] for node in steps), np.int64, len(steps))
    firsts = np.fromiter((start[node] for node in steps), np.int64, len(steps))
    ends = np.cumsum(counts)
    flat = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    flat += np.repeat(firsts - (ends - counts), counts)  # each span shifted from its place in flat to the batch's
    edges = np.concatenate(([0], ends))[np.cumsum([len(path) for path in paths])]
    return dict(zip(numbers, np.split(flat, edges[:-1]), strict=True))


__all__ = ["PackedBatch", "pack_tree"]
