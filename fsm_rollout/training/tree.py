"""A batch of rollouts as a token tree: every generated token once, shared prefixes once (:func:`training_tree`).

The tree's nodes are spans of tokens with a parent; its leaves are the training sequences
(:func:`~fsm_rollout.sample.training_sequences` order), each the path from a root to its last node. Which prefixes
may merge, and the provenance rule that keeps apart tokens that only look alike, are described in
:mod:`fsm_rollout.training.build`; ``docs/token-tree.md`` describes the format for trainers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fsm_rollout.sample import Sample, training_sequences
from fsm_rollout.training.build import SPLIT_CAUSES, Trie, TrieNode
from fsm_rollout.training.nodes import ImageRef, TreeData, TreeLeaf, TreeNode
from fsm_rollout.training.provenance import (
    KEPT_ROWS,
    Intern,
    Interner,
    TreeBuildError,
    batch_tokens,
    sequence_tokens,
)
from fsm_rollout.training.tree_format import tree_from_dict, tree_to_dict
from fsm_rollout.training.tree_pack import PackedBatch, pack_tree
from fsm_rollout.training.tree_text import render_tree

Share = Literal["group", "all", "none"]


class TokenTree(TreeData):
    """The tree :func:`training_tree` builds: ``nodes`` (parents before children), ``leaves`` (one per training
    sequence, in order) and ``stats`` (token counts and the provenance splits by cause)."""

    def __init__(self, nodes: list[TreeNode], leaves: list[TreeLeaf], share: str, stats: dict[str, Any]) -> None:
        super().__init__(nodes, leaves, share, stats)
        self.batches: list[PackedBatch] | None = None
        """The batches of the last :meth:`pack`, which :meth:`unpack` reads by default."""

    def pack(self, max_tokens: int) -> list[PackedBatch]:
        """Batches of at most ``max_tokens`` tokens, each holding whole nodes and, for each of its sequences, the
        whole path (so a shared prefix is repeated in each batch that needs it, with loss mask 0 after its first
        copy). Raises :class:`TreeBuildError` naming a node or sequence that cannot fit."""
        self.batches = pack_tree(self, max_tokens)
        return self.batches

    def unpack(
        self, values: Sequence[Any], batches: Sequence[PackedBatch] | None = None, *, response_only: bool = False
    ) -> list[Any]:
        """Per-token ``values`` on the packed batches (one array or tensor per batch, tokens first) as one value
        per training sequence, in its flat token order (only its response side with ``response_only``)."""
        batches = self.batches if batches is None else batches
        if batches is None:
            raise TreeBuildError("TokenTree.unpack needs the batches: call pack() first or pass them")
        if len(values) != len(batches):
            raise TreeBuildError(f"unpack got {len(values)} values for {len(batches)} packed batches")
        home = {sequence: number for number, batch in enumerate(batches) for sequence in batch.leaf_token_index}
        out: list[Any] = []
        for leaf in self.leaves:
            number = home.get(leaf.sequence)
            if number is None:
                raise TreeBuildError(f"training sequence {leaf.sequence} is in none of the {len(batches)} batches")
            index = batches[number].leaf_token_index[leaf.sequence]
            if response_only:
                index = index[leaf.prompt_length :]
            out.append(_take(values[number], index))
        return out

    def sequence(self, number: int) -> dict[str, Any]:
        """Training sequence ``number``'s flat arrays as its path gives them: ``token_ids``, ``loss_mask``,
        ``rollout_log_probs``, ``weight_versions``."""
        path = [self.nodes[node] for node in self.leaves[number].nodes]
        return {
            "token_ids": [int(t) for node in path for t in node.token_ids],
            "loss_mask": [int(m) for node in path for m in node.loss_mask],
            "rollout_log_probs": [float(v) for node in path for v in node.rollout_log_probs],
            "weight_versions": [v for node in path for v in node.weight_versions],
        }

    def to_dict(self) -> dict[str, Any]:
        """The tree as JSON-compatible data (``docs/token-tree.md`` describes the fields)."""
        return tree_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenTree:
        """The tree :meth:`to_dict` wrote (possibly after a JSON round trip)."""
        parts = tree_from_dict(data)
        return cls(parts.nodes, parts.leaves, parts.share, parts.stats)

    def render(self, *, limit: int = 200) -> str:
        """The tree as text: token counts, provenance splits by cause, then one indented line per node (its
        positions, tokens, generated tokens, which sequences share it, its images), at most ``limit`` nodes."""
        return render_tree(self, limit=limit)

    def __repr__(self) -> str:
        stats = self.stats
        return (
            f"TokenTree(share={self.share!r}, sequences={len(self.leaves)}, nodes={len(self.nodes)}, "
            f"tree_tokens={stats.get('tree_tokens')}, flat_tokens={stats.get('flat_tokens')})"
        )


def training_tree(
    samples: Iterable[Sample | Mapping[str, Any]], *, share: Share = "group", image_token_id: int | None = None
) -> TokenTree:
    """The token tree of a batch of finished rollouts (``Sample`` objects or their ``to_dict()`` rows).

    ``share`` says what may merge: ``"group"`` (sequences of the same ``group_index``; a rollout without one
    shares only among its own branches), ``"all"`` (any identical prefix in the batch) or ``"none"`` (one path
    per sequence: the flat rows). ``image_token_id`` (the image placeholder token) lets sequences share a prefix
    up to and across an image they both hold; without it a sequence with multimodal features merges only with
    sequences whose features are all identical.
    """
    if share not in ("group", "all", "none"):
        raise TreeBuildError(f"share must be 'group', 'all' or 'none'; got {share!r}")
    rollouts = [item if isinstance(item, Sample) else _from_row(item, number) for number, item in enumerate(samples)]
    owners = [number for number, rollout in enumerate(rollouts) for _ in range(len(rollout.branches) + 1)]
    return _build(rollouts, owners, share, image_token_id, stored=False)


def reference_tree(
    samples: Iterable[Sample | Mapping[str, Any]], *, share: Share = "group", image_token_id: int | None = None
) -> TokenTree:
    """The tree built the original way, which the tests hold :func:`training_tree` to: every per-token row stored
    for every token, routed or not."""
    rollouts = [item if isinstance(item, Sample) else _from_row(item, number) for number, item in enumerate(samples)]
    owners = [number for number, rollout in enumerate(rollouts) for _ in range(len(rollout.branches) + 1)]
    return _build(rollouts, owners, share, image_token_id, stored=True)


def _build(
    rollouts: list[Sample], owners: list[int], share: str, image_token_id: int | None, *, stored: bool
) -> TokenTree:
    sequences = training_sequences(rollouts)
    intern = Intern(Interner(), Interner(), Interner(), Interner())
    trie = Trie()
    if stored:
        read = [
            sequence_tokens(sequence, n, image_token_id, intern, stored=True) for n, sequence in enumerate(sequences)
        ]
    else:
        read = batch_tokens(sequences, image_token_id, intern)
    for number, (sequence, tokens) in enumerate(zip(sequences, read, strict=True)):
        trie.insert(_scope(share, sequence, owners[number], number), tokens, number)
    return _finish(trie, sequences, [rollouts[owner] for owner in owners], owners, share, intern)


def _from_row(row: Any, number: int) -> Sample:
    if not isinstance(row, Mapping):
        raise TreeBuildError(f"training_tree takes Samples or Sample.to_dict() rows; item {number} is {type(row)}")
    return Sample.from_dict(row)


def _scope(share: str, sequence: Sample, owner: int, number: int) -> Any:
    if share == "all":
        return None
    if share == "none":
        return ("sequence", number)
    if sequence.group_index is None:
        return ("rollout", owner)
    return ("group", sequence.group_index)


def _finish(
    trie: Trie, sequences: list[Sample], rollouts: list[Sample], owners: list[int], share: str, intern: Intern
) -> TokenTree:
    order = trie.walk()
    ids = {id(node): number for number, node in enumerate(order)}
    end = [-1] * len(sequences)  # -1: no tokens
    for number, node in enumerate(order):
        for sequence in node.endings():
            end[sequence] = number
    nodes = _tree_nodes(order, ids, intern)
    for node in order:  # the trie's parent/child cycles would keep it (and the batch's arrays) until a GC pass
        node.parent = node.children = None
    del order, ids
    parents = [node.parent for node in nodes]
    sizes = [len(node.token_ids) for node in nodes]
    leaves: list[TreeLeaf] = []
    for number, sample in enumerate(sequences):
        path: list[int] = []
        last = end[number]
        length = 0
        while last >= 0:
            path.append(last)
            nodes[last].sequences.append(number)
            length += sizes[last]
            last = parents[last]
        path.reverse()
        leaves.append(_leaf(number, owners[number], sample, rollouts[number], path, length))
    return TokenTree(nodes, leaves, share, tree_stats(nodes, leaves, dict(trie.splits)))


def tree_stats(nodes: Sequence[TreeNode], leaves: Sequence[TreeLeaf], splits: Mapping[str, int]) -> dict[str, Any]:
    """Token counts (flat rows against the tree) and the provenance splits by cause."""
    return {
        "sequences": len(leaves),
        "nodes": len(nodes),
        "flat_tokens": sum(leaf.length for leaf in leaves),
        "tree_tokens": sum(len(node) for node in nodes),
        "generated_tokens": int(sum(int(node.loss_mask.sum()) for node in nodes)),
        "provenance_splits": {cause: int(splits.get(cause, 0)) for cause in SPLIT_CAUSES},
    }


def _tree_nodes(order: list[TrieNode], ids: dict[int, int], intern: Intern) -> list[TreeNode]:
    """The tree's nodes, in walk order. Their arrays are gathered for the whole tree in one copy of the rows they
    keep (each node's are views of it), not one small copy per node; the routing rows exist only where recorded."""
    sizes = [len(node) for node in order]
    bounds = [0] * (len(order) + 1)
    for number, size in enumerate(sizes):
        bounds[number + 1] = bounds[number] + size
    total = bounds[-1]
    data = np.concatenate([node.data for node in order], axis=1) if order else np.zeros((KEPT_ROWS, 0), dtype=np.int64)
    routed = np.full((2, total), -1, dtype=np.int64)
    for number, node in enumerate(order):
        if node.extra is not None:
            routed[:, bounds[number] : bounds[number + 1]] = node.extra[1:3]
    logprob = data[2].view(np.float64)
    names = [None, *(str(key) for key in intern.versions.keys)]  # a version code -1 (none) reads names[0]
    version = data[3]
    steady = [False] * len(order)  # nodes whose tokens share one version (or none): the usual case
    if order and min(sizes) > 0:
        starts = np.asarray(bounds[:-1], dtype=np.int64)
        steady = (np.minimum.reduceat(version, starts) == np.maximum.reduceat(version, starts)).tolist()
    nodes: list[TreeNode] = []
    for number, node in enumerate(order):
        start, stop = bounds[number], bounds[number + 1]
        parent = ids.get(id(node.parent), -1)
        tokens = node
        if steady[number]:
            versions = [names[int(version[start]) + 1]] * (stop - start)
        else:
            versions = [names[v + 1] for v in version[start:stop].tolist()]
        nodes.append(
            TreeNode(
                id=number,
                parent=parent,
                depth=0 if parent < 0 else nodes[parent].depth + sizes[parent],
                token_ids=data[0, start:stop],
                loss_mask=data[1, start:stop],
                rollout_log_probs=logprob[start:stop],
                weight_versions=versions,
                images=[]
                if tokens.extra is None
                else _images(tokens.img, tokens.img_k, tokens.img_seq, tokens.img_index, intern.images),
                routed_sequence=routed[0, start:stop],
                routed_row=routed[1, start:stop],
                sequences=[],
            )
        )
    return nodes


def _images(img: Any, k: Any, seq: Any, index: Any, hashes: Interner) -> list[ImageRef]:
    """One reference per run of one image's consecutive placeholders in a node."""
    if not (img >= 0).any():
        return []
    breaks = np.flatnonzero((img[1:] != img[:-1]) | (k[1:] != k[:-1] + 1)) + 1
    starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(img)]))
    return [
        ImageRef(
            hash=str(hashes.keys[int(img[start])]),
            offset=int(start),
            length=int(end - start),
            first=int(k[start]),
            sequence=int(seq[start]),
            image=int(index[start]),
        )
        for start, end in zip(starts, ends, strict=True)
        if img[start] >= 0
    ]


def _leaf(number: int, owner: int, sample: Sample, rollout: Sample, path: list[int], length: int) -> TreeLeaf:
    """The leaf of training sequence ``number``; the rollout's last sample says why it ended and its lineage."""
    metadata = sample.metadata if isinstance(sample.metadata, Mapping) else {}
    ended = rollout.metadata if isinstance(rollout.metadata, Mapping) else {}
    status = sample.status
    return TreeLeaf(
        sequence=number,
        sample=owner,
        index=sample.index,
        branch=metadata.get("branch"),
        lineage=metadata.get("lineage", ended.get("lineage")),  # a gateway session's chain ("l0", ...); else None
        group_index=sample.group_index,
        reward=sample.reward,
        status=str(getattr(status, "value", status)),
        reason=ended.get("rollout_reason"),
        nodes=path,
        length=length,
        prompt_length=len(sample.tokens) - int(sample.response_length),
    )


def _take(values: Any, index: npt.NDArray[np.int64]) -> Any:
    if hasattr(values, "detach"):  # a tensor: index it with one of its own kind
        import torch

        return values[torch.as_tensor(index, device=values.device)]
    return np.asarray(values)[index]


__all__ = ["Share", "TokenTree", "training_tree"]
