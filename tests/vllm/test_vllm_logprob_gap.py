"""The train/inference logprob gap: vLLM's rollout logprobs against a transformers forward pass of the same weights.

An RL trainer recomputes the logprob of every trainable token with its own model and weighs the policy update by the
ratio to ``sample.rollout_log_probs``; the two must agree, or the update is biased. Here tokens are sampled at
temperature 1 (``--logprobs-mode processed_logprobs``: the logprobs of the distribution sampled from, which at
temperature 1 and top-p 1 is the model's own) through the library's ``RolloutRunner``, over several turns, so the
context holds observations and the masked EOS the library inserts after a stop string. One float32 forward pass of
transformers over ``sample.tokens`` then scores every position where ``loss_mask == 1``, and the gap to
``rollout_log_probs`` is printed and bounded.

The check must not pass vacuously: the samples are asserted to have several turns, masked positions and a masked
EOS, enough tokens are compared, and the same comparison one position off (the classic bug: the distribution at a
token's own position instead of the one before) must be far above the bound.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm_helpers import GENERATE_PATH, assert_logprobs_aligned, model_positions

from fsm_rollout import RolloutRunner, Sample, Status, capture_transitions
from fsm_rollout.testing.envs import ScriptedEnvFactory

pytestmark = pytest.mark.vllm

PROMPTS = (
    "Question 0: what is 2 + 2?",
    "Question 1: name a colour.",
    "Question 2: count to three.",
    "Question 3: tell me a story.",
)
SEED = 1234
MAX_TURNS = 3
#: A few stop strings common enough to end most turns within a few dozen random tokens.
STOPS = ["q", "z", "x"]
SAMPLING = {"max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "stop": STOPS, "no_stop_trim": True}
#: Bound on both the mean and the max absolute gap (nats): both sides run the same float32 weights.
GAP_BOUND = 1e-3
#: The one-position-off comparison must exceed the bound by this factor.
SHIFTED_FACTOR = 50.0
MIN_COMPARED = 60


@dataclass
class Gaps:
    """Absolute differences between recomputed and rollout logprobs, aligned and one position off."""

    aligned: list[float] = field(default_factory=list)
    shifted: list[float] = field(default_factory=list)


def summary(values: list[float]) -> str:
    return f"mean {sum(values) / len(values):.3e}, max {max(values):.3e} over {len(values)} tokens"


def index_of(exchange: Any) -> int:
    """The sample index in a request id ``gap-<index>-turn<N>``."""
    return int(exchange.request_id.removeprefix("gap-").split("-turn", 1)[0])


def load_reference(model_dir: pathlib.Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def add_gaps(gaps: Gaps, model: Any, sample: Sample) -> None:
    """Score ``sample.tokens`` in one forward pass and compare at every trainable response position."""
    import torch

    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    prompt_length = len(sample.tokens) - sample.response_length
    for index in model_positions(sample.loss_mask):
        position = prompt_length + index
        token = sample.tokens[position]
        rollout = sample.rollout_log_probs[index]
        # The token at ``position`` was sampled from the distribution the model gives at ``position - 1``.
        gaps.aligned.append(abs(float(logprobs[position - 1, token]) - rollout))
        gaps.shifted.append(abs(float(logprobs[position, token]) - rollout))


async def test_rollout_logprobs_match_a_transformers_forward_pass_of_the_same_weights(
    proxy: Any, vllm_config: Any, vllm_server: Any, vllm_tokenizer: Any
) -> None:
    config = vllm_config(max_turns=MAX_TURNS)
    samples: list[Sample] = []
    with capture_transitions() as events:
        # A runner per sample, each with its own seed: the random model's distribution is nearly uniform, so one
        # seed draws nearly the same tokens for every prompt. One at a time, vLLM's batch is the same every run.
        for index, prompt in enumerate(PROMPTS):
            sampling = {**SAMPLING, "seed": SEED + index}
            async with RolloutRunner(config, sampling_params=sampling, tokenizer=vllm_tokenizer,
                                     env_factory=ScriptedEnvFactory(), raise_on_error=True) as runner:  # fmt: skip
                samples.append(await runner.run(Sample(prompt=prompt, index=index, session_id=f"gap-{index}")))

    # The premises: sampled at temperature 1 with the seed, several samples, several turns, masked positions.
    answered: dict[int, list[float]] = defaultdict(list)
    for exchange in proxy.to(GENERATE_PATH):
        params = exchange.body["sampling_params"]
        assert (params["temperature"], params["top_p"], params["seed"]) == (1.0, 1.0, SEED + index_of(exchange))
        assert exchange.status == 200, exchange.response
        answered[index_of(exchange)].extend(assert_logprobs_aligned(exchange.response))
    generated = sum(len(values) for values in answered.values())
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["trigger"] == "step":
            steps[event["sample_id"]].append(event)
    turns = {index: len(steps[str(index)]) for index in range(len(samples))}
    assert len(samples) == len(PROMPTS)
    statuses = [sample.status for sample in samples]
    assert all(status in (Status.COMPLETED, Status.TRUNCATED) for status in statuses), statuses
    assert max(turns.values()) > 1, f"no sample has more than one turn: {turns}"
    masked = sum(sample.loss_mask.count(0) for sample in samples if sample.loss_mask is not None)
    assert masked > 0, "no loss-mask-0 position (observation) in any sample"
    # The rollout logprobs compared below are vLLM's, as it answered them.
    for index, sample in enumerate(samples):
        assert sample.loss_mask is not None and sample.rollout_log_probs is not None
        trained = [sample.rollout_log_probs[position] for position in model_positions(sample.loss_mask)]
        assert trained == answered[index], index
    # A masked EOS before a later turn: it is in the context the later trainable tokens are scored in.
    inserted = [sample_id for sample_id, sample_steps in steps.items()
                if any(event["eos_inserted"] for event in sample_steps[:-1])]  # fmt: skip
    assert inserted, f"no sample has a masked EOS (after a stop string) before a later turn: {dict(steps)}"

    model = load_reference(vllm_server.model_dir)
    gaps = Gaps()
    for sample in samples:
        add_gaps(gaps, model, sample)
    aligned, shifted = summary(gaps.aligned), summary(gaps.shifted)
    print(f"\nlogprob gap vLLM vs transformers: {aligned}; one position off: {shifted}; turns per sample {turns}, "
          f"{masked} masked positions")  # fmt: skip

    # Every trainable token is compared, and there are enough of them for the figure to mean something.
    assert len(gaps.aligned) == generated, (len(gaps.aligned), generated)
    assert len(gaps.aligned) >= MIN_COMPARED, f"only {len(gaps.aligned)} tokens compared"
    mean = sum(gaps.aligned) / len(gaps.aligned)
    assert mean <= GAP_BOUND and max(gaps.aligned) <= GAP_BOUND, f"train/inference logprob gap too large: {aligned}"
    shifted_mean = sum(gaps.shifted) / len(gaps.shifted)
    assert shifted_mean > SHIFTED_FACTOR * GAP_BOUND, (
        f"the one-position-off comparison ({shifted}) is not far above the bound {GAP_BOUND}: the check could not "
        f"tell the off-by-one bug from a correct alignment (aligned: {aligned})"
    )
