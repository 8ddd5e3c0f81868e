"""Internal: a token tree as JSON-compatible data and back (:meth:`TokenTree.to_dict` / ``from_dict``).

The field names are the format (``docs/token-tree.md``); ``version`` changes when one changes meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from fsm_rollout.training.nodes import FORMAT_VERSION, ImageRef, TreeData, TreeLeaf, TreeNode
from fsm_rollout.training.provenance import TreeBuildError

NODE_ARRAYS = ("token_ids", "loss_mask", "rollout_log_probs", "routed_sequence", "routed_row")
"""Node fields written as plain lists (and read back as numpy arrays)."""


def tree_to_dict(tree: TreeData) -> dict[str, Any]:
    nodes = []
    for node in tree.nodes:
        row: dict[str, Any] = {"id": node.id, "parent": node.parent, "depth": node.depth}
        for name in NODE_ARRAYS:
            row[name] = getattr(node, name).tolist()
        row["weight_versions"] = list(node.weight_versions)
        row["images"] = [asdict(ref) for ref in node.images]
        row["sequences"] = list(node.sequences)
        nodes.append(row)
    leaves = [asdict(leaf) for leaf in tree.leaves]
    return {
        "format": "fsm-rollout token tree",
        "version": FORMAT_VERSION,
        "share": tree.share,
        "nodes": nodes,
        "leaves": leaves,
        "stats": {**tree.stats, "provenance_splits": dict(tree.stats.get("provenance_splits", {}))},
    }


def tree_from_dict(data: Mapping[str, Any]) -> TreeData:
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise TreeBuildError(f"token tree data has version {version!r}; this library reads version {FORMAT_VERSION}")
    try:
        nodes = [
            TreeNode(
                id=int(row["id"]),
                parent=int(row["parent"]),
                depth=int(row["depth"]),
                token_ids=np.asarray(row["token_ids"], dtype=np.int64),
                loss_mask=np.asarray(row["loss_mask"], dtype=np.int64),
                rollout_log_probs=np.asarray(row["rollout_log_probs"], dtype=np.float64),
                routed_sequence=np.asarray(row["routed_sequence"], dtype=np.int64),
                routed_row=np.asarray(row["routed_row"], dtype=np.int64),
                weight_versions=[None if v is None else str(v) for v in row["weight_versions"]],
                images=[ImageRef(**ref) for ref in row["images"]],
                sequences=[int(s) for s in row["sequences"]],
            )
            for row in data["nodes"]
        ]
        leaves = [TreeLeaf(**{**leaf, "nodes": [int(n) for n in leaf["nodes"]]}) for leaf in data["leaves"]]
    except (KeyError, TypeError) as error:
        raise TreeBuildError(f"token tree data is malformed: {type(error).__name__}: {error}") from error
    for number, node in enumerate(nodes):
        if node.id != number or not -1 <= node.parent < number:
            raise TreeBuildError(f"token tree node {number}: expected id {number} and a parent before it")
    return TreeData(nodes, leaves, str(data.get("share")), dict(data.get("stats") or {}))


__all__ = ["tree_from_dict", "tree_to_dict"]
