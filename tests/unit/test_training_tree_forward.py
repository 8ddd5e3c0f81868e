"""A tiny Qwen2 on the packed token tree: per-token logprobs and gradients equal the flat rows', and the FlexAttention
block mask attends as the boolean mask does."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fsm_rollout import Sample, training_sequences, training_tree  # noqa: E402
from fsm_rollout.training.tree_forward import (  # noqa: E402
    flat_token_logprobs,
    sequence_logprobs,
    tree_token_logprobs,
)

VOCAB = 96


def tiny_qwen2() -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, use_sliding_window=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def batch_of_rollouts() -> list[Sample]:
    """Two GRPO groups of three (a 20-token prompt each), one rollout forked once, one rollout without a group."""
    generator = torch.Generator().manual_seed(1)

    def tokens(count: int) -> list[int]:
        return [int(t) for t in torch.randint(0, VOCAB, (count,), generator=generator)]

    samples: list[Sample] = []
    for group in range(2):
        prompt = tokens(20)
        for number in range(3):
            sample = Sample(group_index=group, index=len(samples), tokens=list(prompt))
            sample.append_response_tokens(tokens(5 + number), [-1.0] * (5 + number))
            sample.append_response_tokens(tokens(3), trainable=False)  # an observation
            sample.append_response_tokens(tokens(4), [-0.5] * 4)
            samples.append(sample)
    fork = samples[1]
    last = Sample(group_index=0, index=fork.index, tokens=fork.tokens[:-6] + tokens(2))
    last.append_response_tokens(tokens(6), [-0.7] * 6)
    last.branches = [fork]
    samples[1] = last
    loner = Sample(index=len(samples), tokens=tokens(12))
    loner.append_response_tokens(tokens(3), [-0.2] * 3)
    return [*samples, loner]


def loss_weights(rows: list[Sample]) -> list[Any]:
    """A fixed weight per generated token (an advantage-like value per sequence, varied per token)."""
    out = []
    for number, row in enumerate(rows):
        prompt = len(row.tokens) - row.response_length
        mask = torch.tensor([0] * prompt + list(row.loss_mask or []), dtype=torch.float32)
        out.append(mask * (number + 1) * torch.linspace(0.5, 1.5, len(row.tokens)))
    return out


def test_tree_logprobs_and_gradients_equal_the_flat_rows() -> None:
    model = tiny_qwen2()
    samples = batch_of_rollouts()
    rows = training_sequences(samples)
    tree = training_tree(samples)
    assert tree.stats["tree_tokens"] < tree.stats["flat_tokens"]
    batches = tree.pack(80)  # several batches, one of them repeating a group's prompt
    assert len(batches) > 1
    weights = loss_weights(rows)

    model.zero_grad()
    flat = [flat_token_logprobs(model, row.tokens) for row in rows]
    sum(-(lp * w).sum() for lp, w in zip(flat, weights, strict=True)).backward()
    flat_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    tree_values = sequence_logprobs(model, tree, batches)
    sum(-(lp * w).sum() for lp, w in zip(tree_values, weights, strict=True)).backward()

    for mine, theirs in zip(tree_values, flat, strict=True):
        assert mine.shape == theirs.shape
        assert float((mine - theirs).abs().max()) <= 1e-5
    for name, p in model.named_parameters():
        reference = flat_grads[name]
        relative = float((p.grad - reference).norm() / reference.norm().clamp_min(1e-12))
        assert relative <= 1e-4, name


def test_a_batch_computed_once_gives_each_generated_token_its_own_sequence() -> None:
    """The GRPO loss on the tree: advantages placed by ``sequence_of_token`` weigh the same tokens as the rows."""
    model = tiny_qwen2()
    samples = batch_of_rollouts()
    rows = training_sequences(samples)
    tree = training_tree(samples)
    [batch] = tree.pack(10_000)
    advantages = torch.arange(1, len(rows) + 1, dtype=torch.float32)
    with torch.no_grad():
        values = tree_token_logprobs(model, batch)
        owner = torch.as_tensor(batch.sequence_of_token)
        trained = torch.as_tensor(batch.loss_mask) == 1
        tree_loss = (values[trained] * advantages[owner[trained]]).sum()
        flat_loss = sum(
            (flat_token_logprobs(model, row.tokens)[len(row.tokens) - row.response_length :]
             * torch.tensor(row.loss_mask, dtype=torch.float32) * advantages[number]).sum()
            for number, row in enumerate(rows)
        )  # fmt: skip
    assert abs(float(tree_loss) - float(flat_loss)) <= 1e-4 * abs(float(flat_loss))
    with torch.no_grad():  # the LM head on the trained tokens' parents only gives the same values
        only = tree_token_logprobs(model, batch, trained_only=True)
    assert float((only[trained] - values[trained]).abs().max()) <= 1e-6
    assert float(only[~trained].abs().max()) == 0.0


def test_the_flex_attention_block_mask_attends_as_the_boolean_mask() -> None:
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    tree = training_tree(batch_of_rollouts())
    [batch] = tree.pack(10_000)
    size = len(batch)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, size, 16, generator=generator) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.as_tensor(batch.attention_mask())[None, None]
    )
    got = flex.flex_attention(q, k, v, block_mask=batch.block_mask(block_size=128))
    assert float((got - expected).abs().max()) <= 1e-5


def test_the_docs_examples_run() -> None:
    """``docs/token-tree.md``'s code blocks, run on a batch of rollouts and the tiny model."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "token-tree.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 3
    samples = batch_of_rollouts()
    for block in blocks:
        namespace = {
            "samples": samples,
            "model": tiny_qwen2(),
            "sequence_advantages": [float(n % 3) - 1.0 for n in range(len(training_sequences(samples)))],
        }
        exec(compile(block, "docs/token-tree.md", "exec"), namespace)
    assert namespace["labels"].shape == namespace["batch"].token_ids.shape
