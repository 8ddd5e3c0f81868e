"""The lifecycle's disconnect edge on a context built by hand: an abort with the reason ``agent_disconnected`` keeps
the cut turn's tokens generated so far (a suspension's partial turn, then what the request in flight streamed), as
generated tokens; any other abort drops them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fsm_rollout.config import RolloutConfig
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout import steps
from fsm_rollout.rollout.context import Deps, RolloutContext
from fsm_rollout.rollout.gating import GatePoint
from fsm_rollout.sample import Sample
from fsm_rollout.types import GeneratedTurn, TurnMeta

PROMPT = [1, 2, 3]


def cut_part(token_ids: list[int]) -> GeneratedTurn:
    return GeneratedTurn(
        request_id="r",
        finish="abort",
        token_ids=token_ids,
        logprobs=[-0.1 * token for token in token_ids],
        meta=TurnMeta(finish_reason="abort"),
    )


def turn_in_progress(state: str, reason: str, *, budget: int = 10, **fields: Any) -> RolloutContext:
    tokenizer = SimpleNamespace(  # a text tokenizer: it knows no image placeholder
        decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)),
        convert_tokens_to_ids=lambda token: None,
    )
    deps = Deps(
        config=RolloutConfig(model="m", engine_url="http://engine.invalid", max_turns=3),
        params={"max_tokens": budget},
        encoder=None,
        tokenizer=tokenizer,
        processor=None,
        gate=GatePoint(None),
    )
    ctx = RolloutContext(
        sample=Sample(prompt="p", index=0, metadata={}),
        deps=deps,
        state=state,
        stop_reason=reason,
        prompt_length=len(PROMPT),
        budget=budget,
        **fields,
    )
    sample = ctx.sample
    sample.tokens, sample.loss_mask, sample.rollout_log_probs, sample.response_length = list(PROMPT), [], [], 0
    steps.MACHINE.events["abort"].trigger(ctx, ctx)
    return ctx


@pytest.mark.parametrize("state", ["generating", "suspended"])
def test_a_disconnect_keeps_the_partial_turn_and_the_streamed_tokens_as_generated(state: str) -> None:
    streamed = ([7, 8], [-0.7, -0.8])
    ctx = turn_in_progress(state, lifecycle.AGENT_DISCONNECTED, partial_turn=[cut_part([5, 6])], streamed=streamed)
    sample = ctx.sample
    assert ctx.state == "aborted" and sample.metadata["rollout_reason"] == "agent_disconnected"
    assert sample.tokens == [*PROMPT, 5, 6, 7, 8] and sample.loss_mask == [1, 1, 1, 1]
    assert sample.rollout_log_probs == pytest.approx([-0.5, -0.6, -0.7, -0.8])
    assert sample.metadata["disconnected_turn"] == {"start": 0, "end": 4, "turn": 0}
    assert ctx.partial_turn == [] and ctx.streamed == ([], [])


def test_the_kept_tokens_never_exceed_the_budget_and_a_stream_without_logprobs_is_left_out() -> None:
    ctx = turn_in_progress("generating", lifecycle.AGENT_DISCONNECTED, budget=1, partial_turn=[cut_part([5, 6])])
    assert ctx.sample.tokens == [*PROMPT, 5] and ctx.sample.loss_mask == [1]
    ctx = turn_in_progress("generating", lifecycle.AGENT_DISCONNECTED, streamed=([7, 8], []))
    assert ctx.sample.tokens == PROMPT and ctx.sample.metadata["disconnected_turn"]["end"] == 0


def test_another_abort_drops_the_turn_in_progress() -> None:
    ctx = turn_in_progress("suspended", "cancelled", partial_turn=[cut_part([5, 6])], streamed=([7], [-0.7]))
    assert ctx.state == "aborted" and ctx.sample.metadata["rollout_reason"] == "cancelled"
    assert ctx.sample.tokens == PROMPT and "disconnected_turn" not in ctx.sample.metadata
