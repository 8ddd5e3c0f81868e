"""A turn made in several requests (a suspension cut it) keeps each token's top candidates, merged and cut like its
tokens; a resume state keeps them too."""

from __future__ import annotations

from typing import Any

from fsm_rollout.types import GeneratedTurn, TurnMeta
from fsm_rollout.weights.partial_turn import merge_turns, turn_from_json, turn_to_json


def part(finish: Any, token_ids: list[int], *, tops: bool = True) -> GeneratedTurn:
    return GeneratedTurn(
        request_id="r",
        finish=finish,
        token_ids=token_ids,
        logprobs=[-0.1 * token for token in token_ids],
        meta=TurnMeta(finish_reason=finish),
        top_logprobs=[[(token, -0.1 * token), (token + 100, -5.0)] for token in token_ids] if tops else None,
    )


def test_merged_parts_keep_their_candidates_in_order_and_a_stop_cut_cuts_them() -> None:
    turn, _ = merge_turns([part("abort", [1, 2]), part("stop", [3, 4])], request_id="r", fallback_version=None)
    assert turn.top_logprobs == [[(t, -0.1 * t), (t + 100, -5.0)] for t in (1, 2, 3)] + [[(4, -0.4), (104, -5.0)]]

    def cut(token_ids: list[int]) -> int:
        return 3

    turn, _ = merge_turns(
        [part("abort", [1, 2]), part("length", [3, 4])], request_id="r", fallback_version=None, cut_at_stop=cut
    )
    assert turn.finish == "stop" and turn.token_ids == [1, 2, 3]
    assert turn.top_logprobs is not None and [top[0][0] for top in turn.top_logprobs] == [1, 2, 3]


def test_a_part_without_candidates_leaves_the_merged_turn_without() -> None:
    turn, _ = merge_turns([part("abort", [1], tops=False), part("stop", [2])], request_id="r", fallback_version=None)
    assert turn.top_logprobs is None


def test_a_resume_state_keeps_the_candidates() -> None:
    original = part("abort", [5, 6])
    assert turn_from_json(turn_to_json(original)).top_logprobs == original.top_logprobs
    plain = part("abort", [5], tops=False)
    assert "top_logprobs" not in turn_to_json(plain)
    assert turn_from_json(turn_to_json(plain)).top_logprobs is None
