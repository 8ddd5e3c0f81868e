"""The embedded engine's LM head over its non-zero rows: the same logits and samples as the model's own head, on only
while most rows are zero, and never for a model whose logits are not a plain projection."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fsm_rollout.engine.local.default_model import default_model_dir
from fsm_rollout.engine.local.live_rows import LiveLayout, LiveLogits, live_rows_head, sample_live, sample_live_rows
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


@pytest.fixture(scope="module")
def default_loaded() -> LoadedModel:
    return load_model(default_model_dir(), max_model_len=512)


def run_to_end(loaded: LoadedModel, prompt: list[int], settings: SamplingSettings, *, live: bool) -> Generation:
    generation = Generation(loaded, prompt, settings)
    if not live:  # the same logits, sampled over the whole vocabulary
        generation._samples_live = False
    with torch.inference_mode():
        while generation.step() is None:
            pass
    return generation


@pytest.mark.parametrize(
    "extra",
    [{}, {"temperature": 0.0}, {"temperature": 0.6}, {"temperature": 2.5}, {"min_tokens": 12}, {"logprobs": None}],
)
def test_sampling_the_live_rows_gives_what_the_whole_vocabulary_gives(
    default_loaded: LoadedModel, extra: dict[str, Any]
) -> None:
    loaded = default_loaded
    assert loaded.head is not None and loaded.head.rows is not None  # the default model's head is mostly zero
    dead = loaded.sampleable - int((loaded.head.rows < loaded.sampleable).sum())
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Find x in the triangle with angles 50 and 60 degrees."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    zero_rows_drawn = 0
    for seed in range(8):
        options: dict[str, Any] = {"max_tokens": 48, "seed": seed, "logprobs": 1, "ignore_eos": seed % 2 == 0}
        settings = SamplingSettings(**{**options, **extra})
        live = run_to_end(loaded, prompt, settings, live=True)
        full = run_to_end(loaded, prompt, settings, live=False)
        assert live._samples_live and live.token_ids == full.token_ids
        assert live.logprobs == full.logprobs  # logprob, rank and top candidate, bit for bit
        zero_rows_drawn += sum(token not in set(loaded.head.rows.tolist()) for token in live.token_ids)
    assert dead > 100_000
    if extra.get("temperature") == 2.5:  # a flat distribution draws zero rows: the blocks between live ids count
        assert zero_rows_drawn > 0


def test_rows_sampled_together_get_what_each_gets_alone() -> None:
    """sample_live_rows over many rows (greedy, temperature 1 and 0.7, logits from large to small) against
    sample_live one row at a time: the same tokens, logprobs, ranks and best candidates, bit for bit; and each
    logprob is the one the full vocabulary's float32 log-softmax gives."""
    vocab, sampleable = 151_936, 151_665
    rows = torch.unique(torch.randint(0, vocab, (300,), generator=torch.Generator().manual_seed(5)))
    layout = LiveLayout.of(rows, vocab_size=vocab, sampleable=sampleable)
    source = torch.Generator().manual_seed(6)
    count = 24
    values = torch.randn((count, rows.numel()), generator=source) * torch.linspace(0.5, 12.0, count)[:, None]
    temperatures = [1.0 if row % 3 else 0.7 for row in range(count)]
    greedy = [row % 4 == 0 for row in range(count)]
    together = sample_live_rows(
        values.clone(),
        layout,
        temperatures=temperatures,
        greedy=greedy,
        generators=[torch.Generator().manual_seed(100 + row) for row in range(count)],
    )
    for row in range(count):
        alone = sample_live(
            LiveLogits(values[row].clone(), rows),
            vocab_size=vocab,
            sampleable=sampleable,
            masked=None,
            temperature=0.0 if greedy[row] else temperatures[row],
            greedy=greedy[row],
            generator=torch.Generator().manual_seed(100 + row),
        )
        assert together[row] == alone
        full = LiveLogits(values[row].clone(), rows).full(vocab)
        full[sampleable:] = float("-inf")
        if not greedy[row] and temperatures[row] != 1.0:
            full = full / temperatures[row]
        assert alone.logprob == float(torch.log_softmax(full, dim=0)[alone.token])
