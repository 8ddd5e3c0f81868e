"""The GRPO example's ``--tree`` path: the policy's logprobs on the step's packed token tree.

A step's rollouts become one token tree: a group's shared prompt (and a forked rollout's tokens before the fork) is
computed once instead of once per row. Each packed batch is one forward pass of the policy, with SDPA and the tree's
boolean attention mask at each token's depth in its sequence, so each token's hidden state is the one it has in its
flat row. The trainable tokens' logprobs come back in :class:`~fsm_rollout.examples.grpo.TrainableTokens` order, so
the loss, the mismatch report and the corrections are the flat path's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsm_rollout import Sample, training_tree
from fsm_rollout.examples.grpo_tiny import LiveVocabulary
from fsm_rollout.training.tree_pack import PackedBatch

__all__ = ["TreeTokens", "tree_logprobs"]


@dataclass(frozen=True)
class TreeTokens:
    """Where each trainable token (``TrainableTokens`` order: sequence by sequence, loss mask 1) sits in the packed
    tree: its ``batch`` and its ``index`` in that batch; and the tokens a forward pass processes, flat and tree."""

    batches: list[PackedBatch]
    batch: torch.Tensor
    index: torch.Tensor
    flat_tokens: int
    tree_tokens: int

    @classmethod
    def of(cls, sequences: Sequence[Sample], rollouts: Sequence[Sample] | None, max_tokens: int) -> TreeTokens:
        """The tree of ``rollouts`` (whose training sequences are ``sequences``, in order; default: the sequences
        themselves) packed in batches of at most ``max_tokens`` tokens."""
        tree = training_tree(list(rollouts if rollouts is not None else sequences))
        if len(tree.leaves) != len(sequences):
            raise ValueError(f"the tree has {len(tree.leaves)} sequences, the step {len(sequences)}")
        batches = tree.pack(max_tokens)
        home = {sequence: number for number, batch in enumerate(batches) for sequence in batch.leaf_token_index}
        where_batch: list[int] = []
        where_index: list[int] = []
        for number, (leaf, sample) in enumerate(zip(tree.leaves, sequences, strict=True)):
            if leaf.length != len(sample.tokens):
                raise ValueError(f"tree sequence {number} holds {leaf.length} tokens, the step's {len(sample.tokens)}")
            index = batches[home[number]].leaf_token_index[number]
            prompt = len(sample.tokens) - sample.response_length
            for position, bit in enumerate(sample.loss_mask or []):
                if bit == 1:
                    where_batch.append(home[number])
                    where_index.append(int(index[prompt + position]))
        return cls(
            batches,
            torch.tensor(where_batch, dtype=torch.long),
            torch.tensor(where_index, dtype=torch.long),
            flat_tokens=int(tree.stats["flat_tokens"]),
            tree_tokens=sum(len(batch) for batch in batches),
        )


def tree_logprobs(policy: Any, vocabulary: LiveVocabulary, tokens: TreeTokens,
                  which: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """log p(token) under ``policy`` of the trainable tokens (those at indices ``which``; all by default), in their
    order: one forward pass per packed batch that holds one, the LM head over the vocabulary's live rows."""
    which = torch.arange(len(tokens.batch)) if which is None else which
    if not len(which):
        return torch.zeros(0)
    order, values = [], []
    for number in torch.unique(tokens.batch[which]).tolist():
        batch = tokens.batches[number]
        mine = torch.nonzero(tokens.batch[which] == number).squeeze(1)
        ids = torch.as_tensor(batch.token_ids)
        hidden = policy.model(
            inputs_embeds=vocabulary.embed(ids[None]),
            position_ids=torch.as_tensor(batch.position_ids)[None],
            attention_mask=torch.as_tensor(batch.attention_mask())[None, None],
        ).last_hidden_state[0]
        index = tokens.index[which[mine]]
        values.append(vocabulary.logprobs(hidden[torch.as_tensor(batch.parent)[index]], ids[index]))
        order.append(mine)
    # back to ``which``'s order: position k of the concatenation belongs to entry order[k]
    placed = torch.cat(order)
    return torch.cat(values)[torch.argsort(placed)]
