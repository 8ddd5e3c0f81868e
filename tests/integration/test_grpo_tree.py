"""The GRPO example's ``--tree`` path: on the default model, the policy's logprobs on the packed token tree, the
clipped loss and its gradients equal the padded rows' (float32), while the tree runs fewer tokens; a whole trainer
step with ``tree=True`` moves the weights as the flat step does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fsm_rollout import Sample, training_sequences  # noqa: E402
from fsm_rollout.engine.local.default_model import default_model_dir  # noqa: E402
from fsm_rollout.examples.grpo import (  # noqa: E402
    GRPOOptions,
    TrainableTokens,
    Trainer,
    clipped_loss,
    parse_args,
    token_logprobs,
)
from fsm_rollout.examples.grpo_tree import TreeTokens, tree_logprobs  # noqa: E402


def rollouts(trainer: Any) -> list[Sample]:
    """A group of three sharing a 30-token prompt (one of them forked once), and a rollout of its own; ids among
    the vocabulary's live rows, each response an answer, an observation (loss mask 0) and a second answer."""
    generator = torch.Generator().manual_seed(3)
    live = trainer.vocabulary.rows

    def ids(count: int) -> list[int]:
        return [int(t) for t in live[torch.randint(len(live), (count,), generator=generator)]]

    def logprobs(count: int) -> list[float]:
        return [float(v) for v in -torch.rand(count, generator=generator) * 3]

    def finish(sample: Sample) -> Sample:
        spans = [{"version": "0", "start": 0, "end": sample.response_length}]
        sample.metadata = {**sample.metadata, "weight_version_spans": spans}
        return sample

    prompt = ids(30)
    made: list[Sample] = []
    for member in range(3):
        sample = Sample(prompt="q", group_index=0, index=member, tokens=list(prompt))
        sample.append_response_tokens(ids(6 + member), logprobs(6 + member))
        sample.append_response_tokens(ids(4), trainable=False)
        sample.append_response_tokens(ids(5), logprobs(5))
        made.append(finish(sample))
    fork = made[1]
    last = Sample(prompt="q", group_index=0, index=1, tokens=list(fork.tokens[:-7]))
    last.append_response_tokens(ids(8), logprobs(8))
    last.branches = [fork]
    made[1] = finish(last)
    loner = Sample(prompt="r", index=3, tokens=ids(17))
    loner.append_response_tokens(ids(7), logprobs(7))
    return [*made, finish(loner)]


def test_tree_logprobs_loss_and_gradients_equal_the_padded_rows() -> None:
    trainer = Trainer(default_model_dir(), GRPOOptions())
    made = rollouts(trainer)
    samples = training_sequences(made)
    advantages = [1.0, -0.5, -0.5, 0.75, 0.0][: len(samples)]
    flat_tokens = TrainableTokens.of(samples, advantages)
    tree = TreeTokens.of(samples, made, max_tokens=64)  # more than one batch: the prompt is repeated in the next
    assert len(tree.batches) > 1
    assert tree.tree_tokens < tree.flat_tokens == sum(len(sample.tokens) for sample in samples)
    assert len(tree.batch) == len(flat_tokens.target)

    def run(compute: Any) -> tuple[Any, Any, dict[str, Any]]:
        trainer.optimizer.zero_grad(set_to_none=True)
        current = compute()
        loss = clipped_loss(current, flat_tokens, 0.2)
        loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
        grads = {str(n): p.grad.clone() for n, p in enumerate(trainer.trainable) if p.grad is not None}
        return current.detach(), loss.detach(), grads

    flat, flat_loss, flat_grads = run(lambda: token_logprobs(trainer.policy, trainer.vocabulary, flat_tokens))
    mine, tree_loss, tree_grads = run(lambda: tree_logprobs(trainer.policy, trainer.vocabulary, tree))
    assert float((mine - flat).abs().max()) <= 1e-5
    assert abs(float(tree_loss - flat_loss)) <= 1e-5 * max(abs(float(flat_loss)), 1.0)
    assert flat_grads.keys() == tree_grads.keys() and len(flat_grads) > 1
    for name, reference in flat_grads.items():
        assert float(reference.norm()) > 0, name
        relative = float((tree_grads[name] - reference).norm() / reference.norm())
        assert relative <= 1e-4, name
    some = torch.tensor([4, 0, len(tree.batch) - 1])  # a subset comes back in the order asked
    with torch.no_grad():
        picked = tree_logprobs(trainer.policy, trainer.vocabulary, tree, some)
    assert float((picked - flat[some]).abs().max()) <= 1e-5


def test_a_tree_step_moves_the_weights_as_the_flat_step() -> None:
    flat, tree = (Trainer(default_model_dir(), replace(GRPOOptions(optimizer="sgd"), tree=on)) for on in (False, True))
    made = rollouts(flat)
    samples = training_sequences(made)
    advantages = [1.0, -0.5, -0.5, 0.75, 0.0][: len(samples)]
    flat_report, _ = flat.step(samples, advantages, made)
    tree_report, _ = tree.step(samples, advantages, made)
    assert tree.processed[1] < tree.processed[0] == flat.processed[0]
    assert float(abs(flat_report.log_ratio - tree_report.log_ratio).max()) <= 1e-5
    after_flat, after_tree = flat.weights(), tree.weights()
    moved = max(float((after_flat[name] - value).abs().max()) for name, value in Trainer(
        default_model_dir(), GRPOOptions()).weights().items())  # fmt: skip
    assert moved > 0
    worst = max(float((after_tree[name] - value).abs().max()) for name, value in after_flat.items())
    assert worst <= 1e-3 * moved


def test_the_tree_flags() -> None:
    assert parse_args([]).tree is False
    options = parse_args(["--tree", "--tree-max-tokens", "512"])
    assert (options.tree, options.tree_max_tokens) == (True, 512)
    with pytest.raises(SystemExit):
        parse_args(["--tree-max-tokens", "0"])
