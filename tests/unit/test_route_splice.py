"""Routed experts of a turn made in several requests: each row from the request that owns it, cut with the turn at
a stop found across answers, checked for size, and kept by a resume state."""

from __future__ import annotations

import numpy as np
import pytest

from fsm_rollout.errors import GenerationError
from fsm_rollout.types import GeneratedTurn, TurnMeta
from fsm_rollout.weights.partial_turn import merge_turns, turn_from_json, turn_to_json

PROMPT = 3


def routes(request: int, rows: int) -> np.ndarray:
    """Rows tagged with the request that computed them: row r of request k holds ``100 * k + r``."""
    return (100 * request + np.arange(rows, dtype=np.int32)).reshape(rows, 1, 1)


def part(request: int, finish: str, tokens: list[int], prompt: int, *, routed: bool = True) -> GeneratedTurn:
    return GeneratedTurn(
        request_id=f"r{request}",
        finish=finish,  # type: ignore[arg-type]
        token_ids=tokens,
        logprobs=[-0.1] * len(tokens),
        meta=TurnMeta(
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=f"v{request}",
            routed_experts=routes(request, prompt + len(tokens) - 1) if routed else None,
        ),
    )


def test_each_request_keeps_the_rows_that_produced_its_tokens() -> None:
    parts = [part(0, "abort", [1, 2], PROMPT), part(1, "abort", [3], PROMPT + 2), part(2, "stop", [4, 5], PROMPT + 3)]
    turn, _ = merge_turns(parts, request_id="r2", fallback_version=None, prompt_length=PROMPT)
    got = turn.meta.routed_experts.reshape(-1).tolist()
    # rows 0..3 from r0 (prefill and its first token), row 4 from r1 (produced token 3), rows 5..6 from r2
    assert got == [0, 1, 2, 3, 104, 205, 206]
    assert turn.meta.routed_expert_spans == (("r0", "v0", 0, 4), ("r1", "v1", 4, 5), ("r2", "v2", 5, 7))


def test_a_request_without_routes_leaves_its_rows_to_the_next_one_that_prefilled_them() -> None:
    parts = [part(0, "abort", [1, 2], PROMPT, routed=False), part(1, "stop", [3, 4], PROMPT + 2)]
    turn, _ = merge_turns(parts, request_id="r1", fallback_version=None, prompt_length=PROMPT)
    assert turn.meta.routed_experts.reshape(-1).tolist() == [100, 101, 102, 103, 104, 105]
    assert turn.meta.routed_expert_spans == (("r1", "v1", 0, 6),)


def test_a_stop_found_across_answers_cuts_the_rows_too() -> None:
    parts = [part(0, "abort", [1, 2], PROMPT), part(1, "length", [3, 4, 5], PROMPT + 2)]
    turn, _ = merge_turns(
        parts, request_id="r1", fallback_version=None, prompt_length=PROMPT, cut_at_stop=lambda ids: 3
    )
    assert turn.token_ids == [1, 2, 3]
    assert turn.meta.routed_experts.reshape(-1).tolist() == [0, 1, 2, 3, 104]
    assert turn.meta.routed_expert_spans == (("r0", "v0", 0, 4), ("r1", "v1", 4, 5))


def test_routes_of_the_wrong_size_name_the_request() -> None:
    bad = GeneratedTurn(
        request_id="r0",
        finish="abort",
        token_ids=[1, 2],
        logprobs=[-0.1, -0.1],
        meta=TurnMeta(finish_reason="abort", routed_experts=np.zeros(7, dtype=np.int32)),
    )
    with pytest.raises(GenerationError, match="request r0 has 7 values"):
        merge_turns([bad, part(1, "stop", [3], PROMPT + 2)], request_id="r1", fallback_version=None, prompt_length=3)


def test_a_resume_state_keeps_a_partial_turns_routes() -> None:
    kept = part(0, "abort", [1, 2], PROMPT)
    back = turn_from_json(turn_to_json(kept))
    assert np.array_equal(back.meta.routed_experts, kept.meta.routed_experts)
    merged, _ = merge_turns(
        [back, part(1, "stop", [3], PROMPT + 2)], request_id="r1", fallback_version=None, prompt_length=PROMPT
    )
    assert merged.meta.routed_experts.reshape(-1).tolist() == [0, 1, 2, 3, 104]
    restored = turn_from_json(turn_to_json(merged))
    assert restored.meta.routed_expert_spans == merged.meta.routed_expert_spans
