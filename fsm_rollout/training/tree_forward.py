"""Internal: a causal LM's forward pass on a packed token tree, and the per-token logprobs it gives.

A packed batch is one row: its tokens attend along the tree (``PackedBatch.attention_mask``) at their depth in
their sequences (``position_ids``), so each token's hidden state is the one it has in its flat row. The logits that
predict a token are its parent's (``PackedBatch.parent``), not the previous row position's. A Hugging Face model
takes the boolean mask as a custom 4-D ``attention_mask`` and passes it to SDPA as it is.

torch is imported when a function here runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsm_rollout.training.nodes import TreeData
from fsm_rollout.training.tree_pack import PackedBatch


def tree_inputs(batch: PackedBatch, *, device: Any = None) -> dict[str, Any]:
    """``input_ids``, ``position_ids`` (``(1, tokens)``) and the tree's boolean ``attention_mask``
    (``(1, 1, tokens, tokens)``, True = attend) for a Hugging Face causal LM's forward."""
    import torch

    return {
        "input_ids": torch.as_tensor(batch.token_ids, device=device)[None],
        "position_ids": torch.as_tensor(batch.position_ids, device=device)[None],
        "attention_mask": torch.as_tensor(batch.attention_mask(), device=device)[None, None],
    }


def token_logprobs_from_logits(logits: Any, parent: Any, token_ids: Any) -> Any:
    """Each token's logprob under the logits at ``parent`` (float32; 0.0 for a token without a parent).

    ``logits`` is ``(tokens, vocabulary)``; only the rows that predict a token go through ``log_softmax``.
    """
    import torch

    parent = torch.as_tensor(parent, device=logits.device)
    targets = torch.as_tensor(token_ids, device=logits.device)
    out = torch.zeros(len(targets), dtype=torch.float32, device=logits.device)
    has = parent >= 0
    if bool(has.any()):
        rows = torch.log_softmax(logits[parent[has]].float(), dim=-1)
        out = out.masked_scatter(has, rows.gather(-1, targets[has][:, None])[:, 0])
    return out


def tree_token_logprobs(model: Any, batch: PackedBatch, *, device: Any = None, trained_only: bool = False) -> Any:
    """The per-token logprobs of one packed batch, in one forward pass of ``model`` (a Hugging Face causal LM
    loaded with ``attn_implementation="sdpa"``): ``(tokens,)`` float32, differentiable.

    With ``trained_only`` only the tokens with loss mask 1 (and a parent) get theirs (the others 0.0), and the LM
    head runs only on their parents' hidden states: with a real vocabulary every token's logits would dwarf the
    model.
    """
    import torch

    inputs = tree_inputs(batch, device=device)
    if not trained_only:
        return token_logprobs_from_logits(model(**inputs).logits[0], batch.parent, batch.token_ids)
    hidden = model.get_decoder()(**inputs).last_hidden_state[0]
    trained = torch.as_tensor((batch.loss_mask == 1) & (batch.parent >= 0), device=hidden.device)
    parent = torch.as_tensor(batch.parent, device=hidden.device)
    rows = parent[trained]
    targets = torch.as_tensor(batch.token_ids, device=hidden.device)[trained]
    picked = torch.log_softmax(model.get_output_embeddings()(hidden[rows]).float(), dim=-1)
    out = torch.zeros(len(batch), dtype=torch.float32, device=hidden.device)
    return out.masked_scatter(trained, picked.gather(-1, targets[:, None])[:, 0])


def flat_token_logprobs(model: Any, token_ids: Sequence[int], *, device: Any = None) -> Any:
    """The same logprobs for one flat row (the reference the tree must match): token ``i`` under the logits at
    ``i - 1``."""
    import torch

    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    logits = model(input_ids=ids[None]).logits[0]
    parent = torch.arange(-1, len(ids) - 1, device=ids.device)
    return token_logprobs_from_logits(logits, parent, ids)


def sequence_logprobs(model: Any, tree: TreeData, batches: Sequence[PackedBatch], *, device: Any = None) -> list[Any]:
    """Every training sequence's per-token logprobs (its flat order, prompt included), one forward per batch."""
    values = [tree_token_logprobs(model, batch, device=device) for batch in batches]
    home = {sequence: number for number, batch in enumerate(batches) for sequence in batch.leaf_token_index}
    out = []
    for leaf in tree.leaves:
        batch = home[leaf.sequence]
        index = batches[batch].leaf_token_index[leaf.sequence]
        out.append(values[batch][index])
    return out


__all__ = [
    "flat_token_logprobs",
    "sequence_logprobs",
    "token_logprobs_from_logits",
    "tree_inputs",
    "tree_token_logprobs",
]
