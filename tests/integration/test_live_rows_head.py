"""The embedded engine's LM head over its non-zero rows: the same logits and samples as the model's own head, on only
while most rows are zero, and never for a model whose logits are not a plain projection."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fsm_rollout.engine.local.live_rows import live_rows_head
from fsm_rollout.engine.local.model import (
    Generation,
    LiveRowsHead,
    LoadedModel,
    load_model,
    load_weights,
)
from fsm_rollout.engine.local.protocol import SamplingSettings
from fsm_rollout.engine.local.tiny import tiny_model_dir

EMBEDDING = "model.embed_tokens.weight"
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(tiny_model_dir())


@pytest.fixture
def sparse(loaded: LoadedModel) -> Any:
    """The model with all but 500 rows of its (tied) embedding zeroed; restored afterwards."""
    original = loaded.model.state_dict()[EMBEDDING].clone()
    zeroed = torch.zeros_like(original)
    keep = torch.arange(0, original.shape[0], original.shape[0] // 500)[:500]
    keep = torch.unique(torch.cat([keep, torch.tensor(PROMPT)]))
    zeroed[keep] = original[keep]
    load_weights(loaded, {EMBEDDING: zeroed})
    yield keep
    load_weights(loaded, {EMBEDDING: original})


def generate(loaded: LoadedModel, seed: int = 3) -> Generation:
    settings = SamplingSettings(max_tokens=24, ignore_eos=True, seed=seed, logprobs=2)
    generation = Generation(loaded, PROMPT, settings)
    with torch.inference_mode():
        while generation.step() is None:
            pass
    return generation


def test_a_dense_model_keeps_its_own_head(loaded: LoadedModel) -> None:
    assert loaded.head is not None  # Qwen2's logits are a bias-free projection: the check passed
    assert loaded.head.rows is None


def test_mostly_zero_rows_give_the_same_logits_and_samples(loaded: LoadedModel, sparse: torch.Tensor) -> None:
    assert loaded.head is not None and loaded.head.rows is not None
    assert loaded.head.rows.tolist() == sparse.tolist()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        full = loaded.model(input_ids=ids).logits[0, -1]
        hidden = loaded.model.base_model(input_ids=ids).last_hidden_state[0, -1]
        computed = loaded.head.logits(hidden)
    assert torch.allclose(computed, full, atol=1e-5, rtol=0)
    zero_rows = torch.ones(full.shape[0], dtype=torch.bool)
    zero_rows[sparse] = False
    assert bool((computed[zero_rows] == 0).all())

    with_head = generate(loaded)
    without_head = generate(dataclasses.replace(loaded, head=None))
    assert with_head.token_ids == without_head.token_ids
    for ours, theirs in zip(with_head.logprobs, without_head.logprobs, strict=True):
        assert abs(ours.logprob - theirs.logprob) <= 1e-5


def test_a_weight_load_turns_the_shortcut_off_and_on(loaded: LoadedModel) -> None:
    assert loaded.head is not None
    original = loaded.model.state_dict()[EMBEDDING].clone()
    zeroed = original.clone()
    zeroed[: original.shape[0] // 2 + 1] = 0
    load_weights(loaded, {EMBEDDING: zeroed})
    try:
        live = torch.nonzero(zeroed.abs().sum(dim=1) > 0).squeeze(1)  # the padding row was zero already
        assert loaded.head.rows is not None and loaded.head.rows.tolist() == live.tolist()
        zeroed[0] = torch.nan  # a NaN row is live: its logit is not 0
        load_weights(loaded, {EMBEDDING: zeroed})
        assert loaded.head.rows is not None and int(loaded.head.rows[0]) == 0
    finally:
        load_weights(loaded, {EMBEDDING: original})
    assert loaded.head.rows is None


class _Scaled(torch.nn.Module):
    """A causal LM whose forward scales its logits (as some architectures do): not a plain projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Embedding(10, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        with torch.no_grad():
            self.lm_head.weight[2:] = 0

    @property
    def base_model(self) -> Any:
        model = self.inner

        class _Base:
            def __call__(self, input_ids: torch.Tensor, **_: Any) -> Any:
                return type("Out", (), {"last_hidden_state": model(input_ids)})()

        return _Base()

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        return type("Out", (), {"logits": 2.0 * self.lm_head(self.inner(input_ids))})()


def test_logits_that_are_not_a_plain_projection_keep_the_models_head() -> None:
    assert live_rows_head(_Scaled()) is None
    assert isinstance(LiveRowsHead(_Scaled()).rows, torch.Tensor)  # the rows alone would have qualified
