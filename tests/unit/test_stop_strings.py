"""vLLM's stop rule (fsm_rollout.engine.stop_strings): stop strings with the ``min_tokens`` floor, stop tokens and
``max_tokens``, on a toy vocabulary whose token ids index their text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm_rollout.engine.stop_strings import (
    StopCut,
    StopStringMatch,
    completed_stop_string,
    cut_at_stop,
    first_stop_string,
)

VOCAB = ["a", "b", "c", "</", "ans", "wer>", "<|eos|>", " ", "x"]
EOS = VOCAB.index("<|eos|>")


def ids(*pieces: str) -> list[int]:
    return [VOCAB.index(piece) for piece in pieces]


def decode(token_ids: Sequence[int]) -> str:
    return "".join(VOCAB[token] for token in token_ids)


def test_completed_stop_string_needs_the_string_to_end_past_the_searched_text() -> None:
    assert completed_stop_string("abcab", 3, ["ab"]) == "ab"  # the second "ab" ends in the new characters
    assert completed_stop_string("abcab", 5, ["ab"]) is None  # nothing new
    assert completed_stop_string("abcab", 3, ["ca"]) == "ca"  # begun in the searched text, ended in the new
    assert completed_stop_string("abcab", 4, ["ca"]) is None  # wholly searched already
    assert completed_stop_string("abc", 3, [""]) is None  # an empty stop string never matches


def test_completed_stop_string_reports_the_first_string_in_request_order() -> None:
    assert completed_stop_string("xab", 1, ["b", "ab"]) == "b"
    assert completed_stop_string("xab", 1, ["ab", "b"]) == "ab"


def test_first_stop_string_ends_at_the_token_that_completes_it() -> None:
    tokens = ids("a", "</", "ans", "wer>", "b")
    assert first_stop_string(tokens, ["</answer>"], decode) == StopStringMatch(end=4, stop="</answer>")
    assert first_stop_string(tokens, ["zzz"], decode) is None
    assert first_stop_string(tokens, [], decode) is None


def test_a_stop_string_inside_the_first_min_tokens_is_never_honoured() -> None:
    tokens = ids("a", "b", "c", "a", "b")
    assert first_stop_string(tokens, ["ab"], decode) == StopStringMatch(end=2, stop="ab")
    # "ab" ends at token 2, inside the floor of 2 tokens: passed over; the next "ab" ends at token 5
    assert first_stop_string(tokens, ["ab"], decode, min_tokens=2) == StopStringMatch(end=5, stop="ab")
    assert first_stop_string(tokens, ["ab"], decode, min_tokens=5) is None  # no token is generated past the floor


def test_a_stop_string_begun_inside_min_tokens_and_ended_after_counts() -> None:
    tokens = ids("x", "</", "ans", "wer>")
    assert first_stop_string(tokens, ["</answer>"], decode, min_tokens=2) == StopStringMatch(end=4, stop="</answer>")
    assert first_stop_string(tokens, ["</answer>"], decode, min_tokens=4) is None


def test_a_lone_string_is_one_stop_string() -> None:
    tokens = ids("a", "b", "c")
    assert first_stop_string(tokens, "bc", decode) == StopStringMatch(end=3, stop="bc")
    assert cut_at_stop(tokens, max_tokens=5, stop="bc", decode=decode) == StopCut(tokens, "stop", "bc")


def test_first_stop_string_refuses_a_negative_floor() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        first_stop_string(ids("a"), ["a"], decode, min_tokens=-1)


@given(
    tokens=st.lists(st.integers(0, len(VOCAB) - 1), max_size=12),
    stop=st.lists(st.sampled_from(["a", "ab", "ca", "</ans", "wer>", "x x", "b<|"]), max_size=3),
    min_tokens=st.integers(0, 6),
)
def test_first_stop_string_is_vllms_token_by_token_loop(tokens: list[int], stop: list[str], min_tokens: int) -> None:
    expected = None
    searched = len(decode(tokens[:min_tokens]))
    for count in range(min_tokens + 1, len(tokens) + 1):
        text = decode(tokens[:count])
        matched = completed_stop_string(text, searched, stop)
        if matched is not None:
            expected = StopStringMatch(end=count, stop=matched)
            break
        searched = len(text)
    assert first_stop_string(tokens, stop, decode, min_tokens=min_tokens) == expected


def test_cut_at_stop_ends_on_eos_or_a_stop_token_with_vllms_stop_reason() -> None:
    tokens = ids("a", "b", "<|eos|>", "c")
    assert cut_at_stop(tokens, max_tokens=10, eos_token_id=EOS) == StopCut(tokens[:3], "stop", None)
    assert cut_at_stop(tokens, max_tokens=10, stop_token_ids={ids("b")[0]}) == StopCut(tokens[:2], "stop", ids("b")[0])
    assert cut_at_stop(tokens, max_tokens=10) == StopCut(tokens, "stop", None)  # EOS ignored: the script's end


def test_cut_at_stop_passes_over_a_stop_token_before_min_tokens() -> None:
    tokens = ids("<|eos|>", "a", "<|eos|>", "b")
    assert cut_at_stop(tokens, max_tokens=10, eos_token_id=EOS, min_tokens=1) == StopCut(tokens[:1], "stop", None)
    assert cut_at_stop(tokens, max_tokens=10, eos_token_id=EOS, min_tokens=2) == StopCut(tokens[:3], "stop", None)


def test_cut_at_stop_prefers_the_stop_token_on_the_same_token_and_the_earlier_stop_otherwise() -> None:
    tokens = ids("a", "</", "ans", "wer>", "b")
    token = ids("wer>")[0]
    assert cut_at_stop(tokens, max_tokens=10, stop=["</answer>"], stop_token_ids={token}, decode=decode) == StopCut(
        tokens[:4], "stop", token
    )
    assert cut_at_stop(tokens, max_tokens=10, stop=["a"], stop_token_ids={token}, decode=decode) == StopCut(
        tokens[:1], "stop", "a"
    )


def test_cut_at_stop_caps_at_max_tokens_unless_the_last_token_stops() -> None:
    tokens = ids("a", "b", "c", "a")
    assert cut_at_stop(tokens, max_tokens=2) == StopCut(tokens[:2], "length", None)
    assert cut_at_stop(tokens, max_tokens=2, stop=["ab"], decode=decode) == StopCut(tokens[:2], "stop", "ab")
    assert cut_at_stop(tokens, max_tokens=2, stop=["ca"], decode=decode) == StopCut(tokens[:2], "length", None)
    assert cut_at_stop(tokens, max_tokens=4) == StopCut(tokens, "length", None)
    with pytest.raises(ValueError, match="max_tokens"):
        cut_at_stop(tokens, max_tokens=0)
    with pytest.raises(ValueError, match="decode"):
        cut_at_stop(tokens, max_tokens=2, stop=["a"])
