"""``fsm-rollout inspect --tree RESULTS``: the token tree a trainer would get from a results file.

RESULTS is JSONL, one ``Sample.to_dict()`` per line (what ``fsm-rollout run --out`` writes). The tree's text
(:meth:`fsm_rollout.TokenTree.render`) shows its token counts against flat rows, the provenance splits by cause and
each node's positions, tokens and sharing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_OK, EXIT_UNUSABLE = 0, 2


def show_tree(results: Path, share: str, limit: int) -> int:
    """Print the tree of ``results`` built with ``share``; 2 when the file cannot be read as samples."""
    from fsm_rollout.errors import RolloutError
    from fsm_rollout.training import training_tree

    try:
        lines = results.read_text().splitlines()
    except OSError as error:
        print(f"error: cannot read {results}: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            print(f"error: {results} line {number} is not JSON: {error}", file=sys.stderr)
            return EXIT_UNUSABLE
    try:
        tree = training_tree(rows, share=share)  # type: ignore[arg-type]
    except (RolloutError, TypeError, ValueError, KeyError) as error:
        print(f"error: {results} does not hold samples a tree can be built from: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(tree.render(limit=limit))
    return EXIT_OK


__all__ = ["show_tree"]
