"""The ``tree`` workload (``--only tree``): the tokens a trainer processes as flat rows against the token tree.

Three parts, on synthetic rollouts (seeded random tokens; the counts do not depend on the values):

* the agent batch: groups of 8 rollouts sharing a 4,096-token prompt (``quick``: 1,024), each forked 3 times (four
  sequences, each re-rendering the last as context before its observation and answer). Figures: tokens processed
  (the packed batches, prompts repeated where a group spans two batches) per trained token, flat and tree, and
  their ratio;
* build and pack time of the tree of 10,000 GRPO samples (``quick``: 2,000), groups of 8, a 256-token prompt and a
  128-token answer each;
* the default model's forward+backward on one group of 8 forked rollouts, flat rows against the tree, in the same
  run (SDPA with the tree mask; the LM head on the trained tokens only, on both sides).
"""

from __future__ import annotations

import random
import time
from typing import Any

from fsm_rollout.sample import Sample
from fsm_rollout.training import TokenTree, training_tree

GROUP = 8
"""Samples per group, as the issue's synthetic agent batch has them."""


def _rollout(rng: random.Random, prompt: list[int], group: int, index: int, forks: int, answer: int) -> Sample:
    """A rollout of ``forks + 1`` sequences: each later one re-renders the last as context, then observes and
    answers."""
    chain: list[Sample] = []
    context = list(prompt)
    for _ in range(forks + 1):
        sequence = Sample(group_index=group, index=index, tokens=list(context))
        sequence.append_response_tokens(_tokens(rng, answer), [-1.0] * answer)
        sequence.append_response_tokens(_tokens(rng, 32), trainable=False)  # the observation
        chain.append(sequence)
        context = list(sequence.tokens)
    last = chain[-1]
    last.branches = chain[:-1]
    return last


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(count)]


def _batch(groups: int, prompt: int, forks: int, answer: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    for group in range(groups):
        shared = _tokens(rng, prompt)
        out.extend(_rollout(rng, shared, group, len(out), forks, answer) for _ in range(GROUP))
    return out


def _processed(tree: TokenTree, max_tokens: int) -> int:
    return sum(len(batch) for batch in tree.pack(max_tokens))


def agent_batch_figures(quick: bool) -> dict[str, float]:
    prompt = 1_024 if quick else 4_096
    samples = _batch(2, prompt, 3, 128, seed=1)
    tree, flat = training_tree(samples), training_tree(samples, share="none")
    trained = tree.stats["generated_tokens"]
    limit = 4 * max(leaf.length for leaf in tree.leaves)
    flat_tokens, tree_tokens = _processed(flat, limit), _processed(tree, limit)
    return {
        "agent_sequences": float(len(tree.leaves)),
        "agent_trained_tokens": float(trained),
        "agent_flat_tokens": float(flat_tokens),
        "agent_tree_tokens": float(tree_tokens),
        "agent_flat_tokens_per_trained": flat_tokens / trained,
        "agent_tree_tokens_per_trained": tree_tokens / trained,
        "agent_tree_over_flat": tree_tokens / flat_tokens,
    }


def build_and_pack_figures(quick: bool) -> dict[str, float]:
    samples = _batch((2_000 if quick else 10_000) // GROUP, 256, 0, 128, seed=2)
    wall, cpu = time.perf_counter(), time.process_time()
    tree = training_tree(samples)
    tree.pack(16_384)
    return {
        "build_pack_samples": float(len(samples)),
        "build_pack_s": time.perf_counter() - wall,
        "build_pack_cpu_s": time.process_time() - cpu,
    }


def _fwd_bwd(model: Any, tree: TokenTree, max_tokens: int) -> tuple[float, int]:
    """Seconds of one forward+backward over every packed batch (loss: minus the trained tokens' logprobs)."""
    from fsm_rollout.training.tree_forward import tree_token_logprobs

    model.zero_grad()
    batches = tree.pack(max_tokens)
    start = time.perf_counter()
    for batch in batches:
        (-tree_token_logprobs(model, batch, trained_only=True).sum()).backward()
    return time.perf_counter() - start, sum(len(batch) for batch in batches)


def default_model_figures(quick: bool) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from fsm_rollout.engine.local.default_model import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_dir()), dtype=torch.float32, attn_implementation="sdpa"
    ).train()
    samples = _batch(1, 256 if quick else 1_024, 1, 64, seed=3)
    tree, flat = training_tree(samples), training_tree(samples, share="none")
    longest = max(leaf.length for leaf in tree.leaves)
    _fwd_bwd(model, flat, longest)  # a warm-up: the first pass allocates
    flat_s, flat_tokens = _fwd_bwd(model, flat, longest)  # one row per pass, as a flat trainer runs them
    tree_s, tree_tokens = _fwd_bwd(model, tree, max(tree.stats["tree_tokens"], longest))
    return {
        "model_flat_tokens": float(flat_tokens),
        "model_tree_tokens": float(tree_tokens),
        "model_flat_fwd_bwd_s": flat_s,
        "model_tree_fwd_bwd_s": tree_s,
        "model_flat_over_tree_time": flat_s / tree_s,
    }


def bench_token_tree(quick: bool) -> dict[str, float]:
    """Every figure of the workload (see the module's docstring)."""
    return {**agent_batch_figures(quick), **build_and_pack_figures(quick), **default_model_figures(quick)}


__all__ = ["agent_batch_figures", "bench_token_tree", "build_and_pack_figures", "default_model_figures"]
