"""Internal: a token tree as text (:meth:`TokenTree.render`): its token counts, provenance splits and node spans.

One line per node, indented by its depth in the tree: its position span, token count, generated tokens, the
sequences that share it and its images. Long trees are cut after ``limit`` nodes.
"""

from __future__ import annotations

from fsm_rollout.training.nodes import TreeData


def render_tree(tree: TreeData, *, limit: int = 200) -> str:
    stats = tree.stats
    flat, held = stats.get("flat_tokens", 0), stats.get("tree_tokens", 0)
    splits = {cause: count for cause, count in (stats.get("provenance_splits") or {}).items() if count}
    lines = [
        f"token tree (share={tree.share}): {len(tree.leaves)} sequences, {len(tree.nodes)} nodes, {held} tokens "
        f"for {flat} flat ({held / flat if flat else 1.0:.3f}), {stats.get('generated_tokens', 0)} generated",
        "provenance splits: " + (", ".join(f"{cause} {count}" for cause, count in splits.items()) or "none"),
    ]
    level: dict[int, int] = {}
    for node in tree.nodes[:limit]:
        level[node.id] = 0 if node.parent < 0 else level[node.parent] + 1
        generated = int(node.loss_mask.sum())
        shared = f"shared by {len(node.sequences)}" if len(node.sequences) > 1 else f"sequence {node.sequences[0]}"
        images = f", {len(node.images)} image run(s)" if node.images else ""
        lines.append(
            f"{'  ' * level[node.id]}node {node.id}: positions {node.depth}-{node.depth + len(node) - 1} "
            f"({len(node)} tokens, {generated} generated), {shared}{images}"
        )
    if len(tree.nodes) > limit:
        lines.append(f"... {len(tree.nodes) - limit} more nodes")
    return "\n".join(lines)


__all__ = ["render_tree"]
