"""Internal: the trie that merges training sequences' identical prefixes, and its provenance rule.

Sequences go in one at a time; each walks down from its scope's root while its tokens agree with a node's, splits
that node where they stop agreeing, and hangs the rest of itself as a new node. Tokens *agree* only when all of
these are equal: the token id, the position (implied: both are at the same depth of the same path), the loss mask,
the rollout logprob (bit for bit), the routed experts where both record them, and the multimodal key (the image's
content hash and the place in it, or the digest of the features). And a generated token (mask 1) agrees with
nothing: two sequences that both generated the same token at the same place are two generations, each trained once
with its own sequence's advantage. So every node holding a generated token lies on exactly one sequence's path.

When token ids agree but another field does not, the paths part there and the cause is counted (the first field to
differ, in the order ``generated``, ``loss_mask``, ``log_probs``, ``routed_experts``, ``images``/``multimodal``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fsm_rollout.training.provenance import FIELDS, KEPT_ROWS, Tokens

SPLIT_CAUSES: tuple[str, ...] = ("generated", "loss_mask", "log_probs", "routed_experts", "images", "multimodal")
"""The provenance causes ``tree.stats["provenance_splits"]`` counts, in the order they are checked."""


class TrieNode(Tokens):
    """A span of tokens (its own :class:`Tokens` arrays) under ``parent``; ``children`` by their first token id (a
    list when provenance split several apart); ``ending`` the sequences whose path ends here (one number, or a list
    of them). Both stay None until needed, and a lone child is held as it is: a batch's trie has a node per
    sequence, most of them leaves with no siblings, and every object it allocates is one more for the garbage
    collector to visit."""

    __slots__ = ("children", "ending", "parent")

    def __init__(self, tokens: Tokens, parent: TrieNode | None) -> None:
        super().__init__(tokens.data, tokens.extra)
        self.parent = parent
        self.children: dict[int, TrieNode | list[TrieNode]] | None = None
        self.ending: int | list[int] | None = None

    def end(self, number: int) -> None:
        """Sequence ``number``'s path ends here."""
        if self.ending is None:
            self.ending = number
        elif isinstance(self.ending, list):
            self.ending.append(number)
        else:
            self.ending = [self.ending, number]

    def endings(self) -> list[int]:
        ending = self.ending
        return [] if ending is None else ending if isinstance(ending, list) else [ending]

    def adopt(self, child: TrieNode) -> None:
        child.parent = self
        if self.children is None:
            self.children = {}
        first = int(child.ids[0])
        held = self.children.get(first)
        if held is None:
            self.children[first] = child
        elif isinstance(held, list):
            held.append(child)
        else:
            self.children[first] = [held, child]

    def kids(self) -> list[TrieNode]:
        """The children, by first token id, then in the order they were adopted."""
        if self.children is None:
            return []
        return [child for held in self.children.values() for child in (held if isinstance(held, list) else (held,))]

    def candidates(self, first: int) -> tuple[TrieNode, ...] | list[TrieNode]:
        """The children whose first token id is ``first``."""
        held = None if self.children is None else self.children.get(first)
        if held is None:
            return ()
        return held if isinstance(held, list) else (held,)


def first_difference(node: Tokens, rest: Tokens, length: int) -> tuple[int, str | None]:
    """Where, within the first ``length`` tokens, ``rest`` stops agreeing with ``node``, and the provenance cause
    (None when the token ids differ there, or when they agree throughout and the index is ``length``)."""
    # argmax finds the first True in one reduction (flatnonzero would list them all)
    if length == 0:
        return 0, None
    head = node.data[:3, :length]
    differ = head != rest.data[:3, :length]  # token ids, loss masks and logprobs' bits in one comparison
    first = int(differ[0].argmax())
    limit = first if differ[0, first] else length
    if limit == 0:
        return 0, None
    bad = differ[1:, :limit].any(axis=0)
    bad |= head[1, :limit] == 1  # a generated token agrees with nothing
    if node.extra is not None or rest.extra is not None:  # else neither recorded routing or features: all -1
        ar, br = node.routed[:limit], rest.routed[:limit]
        bad |= (ar != br) & (ar >= 0) & (br >= 0)  # routing is compared where both recorded it
        bad |= node.mm[:limit] != rest.mm[:limit]
    at = int(bad.argmax())
    if not bad[at]:
        return limit, None
    return at, _cause(node, rest, at)


def _cause(node: Tokens, rest: Tokens, at: int) -> str:
    """The first provenance field (in :data:`SPLIT_CAUSES` order) that differs at ``at``."""
    if node.mask[at] == rest.mask[at] == 1:
        return "generated"
    if node.mask[at] != rest.mask[at]:
        return "loss_mask"
    if node.data[2, at] != rest.data[2, at]:
        return "log_probs"
    if node.routed[at] != rest.routed[at] and node.routed[at] >= 0 and rest.routed[at] >= 0:
        return "routed_experts"
    return "images" if node.img[at] >= 0 or rest.img[at] >= 0 else "multimodal"


class Trie:
    """The scopes' roots and the provenance splits counted while inserting."""

    def __init__(self) -> None:
        self.roots: dict[Any, TrieNode] = {}
        self.splits: Counter[str] = Counter()

    def insert(self, scope: Any, sequence: Tokens, number: int) -> None:
        node = self.roots.get(scope)
        if node is None:
            node = self.roots[scope] = TrieNode(sequence.cut(0, 0), None)
        position, size = 0, len(sequence)
        while position < size:
            rest = sequence.cut(position)
            chosen, matched, cause = None, 0, None
            for child in node.candidates(int(rest.ids[0])):
                reach, why = first_difference(child, rest, min(len(child), len(rest)))
                if reach > 0:  # at most one child agrees on its first token: the others were split from it
                    chosen, matched = child, reach
                    break
                cause = cause or why
            if chosen is None:
                if cause is not None:
                    self.splits[cause] += 1
                fresh = TrieNode(rest, None)  # the sequence's own arrays: each build reads them afresh
                node.adopt(fresh)
                node = fresh
                break
            _fill_routing(chosen, rest, matched)
            if matched < len(chosen):
                _split(chosen, matched)
            node, position = chosen, position + matched
        node.end(number)

    def walk(self) -> list[TrieNode]:
        """Every real node, depth first, parents before children, scopes and children in insertion order."""
        out: list[TrieNode] = []
        for root in self.roots.values():
            stack = root.kids()[::-1]
            while stack:
                node = stack.pop()
                out.append(node)
                if node.children is not None:
                    stack.extend(reversed(node.kids()))
        return out


def _fill_routing(node: Tokens, rest: Tokens, matched: int) -> None:
    """Where only the incoming sequence recorded routing for a shared token, the node keeps its reference."""
    if not matched or rest.extra is None or int(rest.routed[:matched].max()) < 0:  # the usual case: no routing
        return
    fill = np.flatnonzero((node.routed[:matched] < 0) & (rest.routed[:matched] >= 0))
    if fill.size:
        rows = np.asarray([FIELDS.index(name) - KEPT_ROWS for name in ("routed", "routed_seq", "routed_row")])
        node.recorded()[np.ix_(rows, fill)] = rest.recorded()[np.ix_(rows, fill)]


def _split(node: TrieNode, at: int) -> None:
    """Cut ``node`` after ``at`` tokens: it keeps the head, a new child takes the tail, its children and endings."""
    tail = TrieNode(node.cut(at), node)
    tail.children, tail.ending = node.children, node.ending
    for child in tail.kids():
        child.parent = tail
    node.data = node.data[:, :at]
    node.extra = None if node.extra is None else node.extra[:, :at]
    node.children, node.ending = None, None
    node.adopt(tail)


__all__ = ["SPLIT_CAUSES", "Trie", "TrieNode", "first_difference"]
