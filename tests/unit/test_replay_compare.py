"""Replay's comparators, each on its own: recorded value and today's in, a typed divergence (or None) out.

Also the tape cursor, which hands out one sample record's exchanges in order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_rollout.recording import TapeFile, TapeSample
from fsm_rollout.recording.format import PACKED_ENCODING
from fsm_rollout.recording.reader import Blobs
from fsm_rollout.replay import Divergence, Outcome, TapeCursor
from fsm_rollout.replay.compare import (
    compare_engine_request,
    compare_env_call,
    compare_error,
    compare_logprobs,
    compare_loss_mask,
    compare_outcome,
    compare_reason,
    compare_status,
    compare_tokens,
    compare_transition,
    compare_transition_count,
    extra_transition,
    turn_of,
)


class LetterTokenizer:
    """Token id n decodes to the n-th lowercase letter; ids past ``z`` cannot be decoded."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + token) if token < 26 else self._unknown(token) for token in token_ids)

    @staticmethod
    def _unknown(token: int) -> str:
        raise KeyError(token)


TOKENIZER = LetterTokenizer()


def request(**overrides: Any) -> dict[str, Any]:
    return {
        "what": "the generate request",
        "recorded_request": {"model": "m", "sampling_params": {"temperature": 1.0, "stop": ["</a>"]}},
        "recorded_headers": {"x-session-id": "s1"},
        "recorded_tokens": [0, 1, 2],
        "payload": {"model": "m", "sampling_params": {"temperature": 1.0, "stop": ["</a>"]}, "token_ids": [0, 1, 2]},
        "headers": {"x-session-id": "s1"},
        "tokenizer": TOKENIZER,
        **overrides,
    }


def event(src: str, trigger: str, dst: str, **fields: Any) -> dict[str, Any]:
    return {
        "src": src,
        "trigger": trigger,
        "dst": dst,
        "turn": 0,
        "response_length": 0,
        "remaining_budget": 10,
        **fields,
    }


TRANSITIONS = [
    event("pending", "render", "rendered"),
    event("rendered", "generate", "generating"),
    event("generating", "step", "stepping", response_length=3),
    event("stepping", "observe", "observing", turn=1, response_length=5),
    event("observing", "generate", "generating", turn=1, response_length=5),
    event("generating", "step", "truncated", turn=1, response_length=8, reason="length"),
]


def outcome(**overrides: Any) -> Outcome:
    values: dict[str, Any] = {
        "tokens": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        "prompt_length": 2,
        "loss_mask": [1, 1, 1, 0, 0, 1, 1, 1],
        "rollout_log_probs": [-0.5] * 8,
        "status": "failed",
        "reason": "error",
        "error": {"type": "ValueError", "message": "boom", "state": "stepping", "trigger": "observe"},
    }
    values.update(overrides)
    return Outcome(**values)


# --------------------------------------------------------------------------- engine requests


def test_the_same_request_does_not_diverge() -> None:
    assert compare_engine_request(**request()) is None


def test_tuples_sent_today_equal_the_lists_the_tape_holds() -> None:
    payload = {"model": "m", "sampling_params": {"temperature": 1.0, "stop": ("</a>",)}, "token_ids": [0, 1, 2]}
    assert compare_engine_request(**request(payload=payload)) is None


def test_different_token_ids_are_reported_at_the_first_differing_index_with_their_text() -> None:
    found = compare_engine_request(**request(payload={**request()["payload"], "token_ids": [0, 1, 5, 6]}))
    assert found is not None
    assert (found.kind, found.index) == ("request", 2)
    assert "token_ids[2] 2 'c' in the recording, 5 'f' today (3 vs 4 ids)" in found.message
    assert found.context is not None
    assert (found.context.before, found.context.expected, found.context.actual) == ("ab", "c", "fg")


def test_a_body_difference_names_the_dotted_path_and_both_values() -> None:
    payload = {**request()["payload"], "sampling_params": {"temperature": 0.7, "stop": ["</a>"]}}
    found = compare_engine_request(**request(payload=payload))
    assert found is not None
    assert found.message == "the generate request differs at sampling_params.temperature"
    assert (found.expected, found.actual) == (1.0, 0.7)


def test_a_field_only_one_side_has_is_absent_on_the_other() -> None:
    found = compare_engine_request(**request(payload={**request()["payload"], "priority": 3}))
    assert found is not None
    assert (found.expected, found.actual) == ("(absent)", 3)


def test_an_unbounded_turn_recorded_without_max_tokens_equals_todays_explicit_null() -> None:
    """Releases before schema 2 left max_tokens out of an unbounded generate; today it is sent as null."""
    payload = {**request()["payload"], "sampling_params": {"temperature": 1.0, "stop": ["</a>"], "max_tokens": None}}
    assert compare_engine_request(**request(payload=payload)) is None


def test_a_null_max_tokens_still_differs_from_a_recorded_number() -> None:
    recorded = {"model": "m", "sampling_params": {"temperature": 1.0, "stop": ["</a>"], "max_tokens": 5}}
    payload = {**request()["payload"], "sampling_params": {"temperature": 1.0, "stop": ["</a>"], "max_tokens": None}}
    found = compare_engine_request(**request(payload=payload, recorded_request=recorded))
    assert found is not None
    assert (found.expected, found.actual) == (5, None)


def test_different_headers_diverge_and_no_headers_equal_empty_ones() -> None:
    found = compare_engine_request(**request(headers={"x-session-id": "s2"}))
    assert found is not None and found.message == "the generate request sends different headers"
    assert compare_engine_request(**request(recorded_headers={}, headers=None)) is None


def test_a_request_without_recorded_tokens_compares_its_whole_body() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    assert compare_engine_request(**request(recorded_tokens=None, recorded_request=body, payload=body)) is None
    found = compare_engine_request(
        **request(recorded_tokens=None, recorded_request=body, payload={**body, "messages": []})
    )
    assert found is not None and "messages (length)" in found.message


def test_undecodable_token_ids_are_shown_as_ids() -> None:
    found = compare_engine_request(**request(payload={**request()["payload"], "token_ids": [0, 1, 99]}))
    assert found is not None and "99 '<99>' today" in found.message


# --------------------------------------------------------------------------- environment calls


def test_env_step_text_is_compared_with_the_first_differing_character() -> None:
    assert compare_env_call("step", "the answer is 42", "the answer is 42") is None
    found = compare_env_call("step", "the answer is 42", "the answer is 43")
    assert found is not None
    assert (found.kind, found.index) == ("request", 15)
    assert found.context is not None and (found.context.expected, found.context.actual) == ("2", "3")


def test_env_calls_without_an_argument_never_diverge() -> None:
    assert compare_env_call("reset", None, None) is None
    assert compare_env_call("close", "ignored", None) is None


# --------------------------------------------------------------------------- transitions


def test_a_transition_as_recorded_does_not_diverge_whatever_its_timing() -> None:
    recorded = {**TRANSITIONS[2], "dwell_ms": 3.0, "ts": 1.0}
    assert compare_transition(2, recorded, {**TRANSITIONS[2], "dwell_ms": 9.0, "ts": 2.0}) is None


def test_another_destination_is_reported_at_the_recorded_turn_and_state() -> None:
    found = compare_transition(5, TRANSITIONS[5], {**TRANSITIONS[5], "dst": "stepping", "reason": None})
    assert found is not None
    assert (found.kind, found.turn, found.state, found.index) == ("transition", 1, "generating", 5)
    assert found.message.startswith(
        "transition 6: recorded generating --step--> truncated, today generating --step--> stepping; differs in dst"
    )


def test_a_summary_field_both_events_have_is_compared() -> None:
    found = compare_transition(2, {**TRANSITIONS[2], "eos_inserted": True}, {**TRANSITIONS[2], "eos_inserted": False})
    assert found is not None
    assert found.message == "transition 3 (generating --step--> stepping); differs in eos_inserted True → False"


def test_a_summary_field_only_one_event_has_is_not_compared() -> None:
    assert compare_transition(2, TRANSITIONS[2], {**TRANSITIONS[2], "finish": "stop"}) is None


def test_a_transition_after_the_recorded_ones_is_reported_where_it_fired() -> None:
    found = extra_transition(6, event("truncated", "fail", "failed", turn=1))
    assert (found.kind, found.turn, found.state, found.index) == ("transition", 1, "truncated", 6)
    assert "after the recording's last transition" in found.message


def test_ending_before_the_recorded_transitions_names_the_first_missing_one() -> None:
    assert compare_transition_count(TRANSITIONS, len(TRANSITIONS)) is None
    found = compare_transition_count(TRANSITIONS, 4)
    assert found is not None
    assert found.message == "today's rollout ended before the recording's observing --generate--> generating"
    assert found.index == 4


# --------------------------------------------------------------------------- the result


def test_the_same_outcome_does_not_diverge() -> None:
    assert compare_outcome(outcome(), outcome(), tokenizer=TOKENIZER, transitions=TRANSITIONS, turn=1) is None


def test_a_different_token_is_placed_in_the_turn_that_generated_it() -> None:
    found = compare_tokens(
        outcome(), outcome(tokens=[0, 1, 2, 3, 4, 5, 6, 25, 8, 9]), tokenizer=TOKENIZER, transitions=TRANSITIONS
    )
    assert found is not None
    assert (found.kind, found.index, found.turn) == ("tokens", 7, 1)  # response index 5: grown past in turn 1
    assert found.message == "tokens[7]: 7 'h' recorded, 25 'z' today (10 vs 10 tokens)"
    assert found.context is not None and found.context.actual.startswith("z")


def test_a_shorter_token_list_diverges_at_its_end() -> None:
    found = compare_tokens(outcome(), outcome(tokens=[0, 1, 2]), tokenizer=TOKENIZER, transitions=TRANSITIONS)
    assert found is not None and found.index == 3 and "(end) today" in found.message


def test_a_loss_mask_difference_is_reported_at_its_token_index() -> None:
    found = compare_loss_mask(
        outcome(), outcome(loss_mask=[1, 1, 1, 1, 0, 1, 1, 1]), tokenizer=TOKENIZER, transitions=TRANSITIONS
    )
    assert found is not None
    assert (found.kind, found.index, found.turn) == ("loss_mask", 5, 1)
    assert found.message == "loss_mask[3] (tokens[5]): 0 recorded, 1 today"


def test_a_missing_loss_mask_differs_from_an_empty_one() -> None:
    found = compare_loss_mask(
        outcome(loss_mask=None), outcome(loss_mask=[]), tokenizer=TOKENIZER, transitions=TRANSITIONS
    )
    assert found is not None and found.index == 2


def test_logprobs_are_compared_exactly() -> None:
    found = compare_logprobs(outcome(), outcome(rollout_log_probs=[-0.5] * 7 + [-0.5000001]), transitions=TRANSITIONS)
    assert found is not None
    assert (found.kind, found.index, found.expected, found.actual) == ("logprobs", 9, -0.5, -0.5000001)


def test_status_and_reason_are_reported_at_the_turn_the_rollout_ended_in() -> None:
    found = compare_status(outcome(), outcome(status="truncated"), turn=4)
    assert found is not None and (found.kind, found.turn, found.expected, found.actual) == (
        "status",
        4,
        "failed",
        "truncated",
    )
    found = compare_reason(outcome(), outcome(reason="max_turns"), turn=4)
    assert found is not None and (found.kind, found.expected, found.actual) == ("reason", "error", "max_turns")


def test_another_error_of_a_failed_sample_diverges() -> None:
    today = outcome(error={**outcome().error, "message": "bang"})
    found = compare_error(outcome(), today, turn=1)
    assert found is not None and found.kind == "error"
    assert (found.expected["message"], found.actual["message"]) == ("boom", "bang")


def test_a_tape_without_the_error_has_none_to_compare() -> None:
    assert compare_error(outcome(error=None), outcome(), turn=1) is None


def test_the_outcome_reports_the_first_difference_in_order() -> None:
    today = outcome(status="completed", reason="env_done", loss_mask=[0] * 8)
    found = compare_outcome(outcome(), today, tokenizer=TOKENIZER, transitions=TRANSITIONS, turn=1)
    assert found is not None and found.kind == "loss_mask"


def test_a_response_index_past_every_transition_falls_in_the_last_turn() -> None:
    assert turn_of(TRANSITIONS, 100) == 1
    assert turn_of([], 0) is None


def test_divergences_are_values() -> None:
    found = compare_status(outcome(), outcome(status="completed"), turn=1)
    assert found == Divergence(
        "status", "the sample ends with another status", turn=1, expected="failed", actual="completed"
    )


# --------------------------------------------------------------------------- the tape cursor


def record(io: list[dict[str, Any]], result: dict[str, Any] | None = None) -> TapeSample:
    return TapeSample(
        line=7,
        sample_id="1",
        session_id=None,
        request_prefix="p",
        config={},
        sampling_params={},
        sample={},
        io=io,
        transitions=[],
        result=result or {},
        tokenizer={},
        processor_merge_size=None,
    )


def take(cursor: TapeCursor, op: str) -> dict[str, Any]:
    entry = cursor.take(op, op)
    assert not isinstance(entry, Divergence), entry
    return entry


def test_the_cursor_hands_out_entries_in_order_and_names_what_is_missing() -> None:
    cursor = TapeCursor(record([{"op": "render", "answer": {}}, {"op": "generate"}]), TapeFile(Path("t")))
    assert cursor.take("render", "the render endpoint") == {"op": "render", "answer": {}}
    wrong = cursor.take("reset", "env.reset()")
    assert isinstance(wrong, Divergence) and wrong.kind == "unexpected call"
    assert "the recording's next call is the generate endpoint" in wrong.message
    assert cursor.take("generate", "the generate endpoint") == {"op": "generate"}
    missing = cursor.take("step", "env.step()")
    assert isinstance(missing, Divergence) and missing.kind == "missing answer"


def test_generate_tokens_are_rebuilt_from_deltas_on_the_render_answer() -> None:
    io = [
        {"op": "render", "answer": {"token_ids": [1, 2]}},
        {"op": "generate", "tokens": {"keep": 2, "add": [3]}},
        {"op": "generate", "tokens": {"keep": 3, "add": [4, 5]}},
    ]
    cursor = TapeCursor(record(io, {"tokens": {"keep": 5, "add": [6]}}), TapeFile(Path("t")))
    cursor.answered(take(cursor, "render"))
    assert cursor.generate_tokens(take(cursor, "generate")) == [1, 2, 3]
    assert cursor.generate_tokens(take(cursor, "generate")) == [1, 2, 3, 4, 5]
    assert cursor.recorded_tokens() == [1, 2, 3, 4, 5, 6]


def test_a_malformed_token_delta_is_a_tape_divergence() -> None:
    cursor = TapeCursor(record([{"op": "generate", "tokens": {"keep": 4, "add": []}}]), TapeFile(Path("t")))
    found = cursor.generate_tokens(take(cursor, "generate"))
    assert isinstance(found, Divergence) and found.kind == "tape"
    assert isinstance(cursor.recorded_outcome(), Divergence)


def test_a_missing_blob_is_a_tape_divergence() -> None:
    cursor = TapeCursor(record([]), TapeFile(Path("t"), blobs={"sha256:a": "text"}))
    assert cursor.value({"op": "step", "refs": True, "text": {"$blob": "sha256:a"}}, "text") == "text"
    found = cursor.value({"op": "step", "refs": True, "text": {"$blob": "sha256:b"}}, "text")
    assert isinstance(found, Divergence) and "lacks blob sha256:b (tape line 7)" in found.message


def test_a_packed_blob_that_does_not_unpack_is_a_tape_divergence_not_a_crash() -> None:
    blobs = Blobs()
    blobs.store("sha256:a", "bm90IHpsaWI=", PACKED_ENCODING)  # base64 of bytes that are no zlib stream
    tape = TapeFile(Path("t"), blobs=blobs)
    cursor = TapeCursor(record([]), tape)
    found = cursor.value({"op": "step", "refs": True, "text": {"$blob": "sha256:a"}}, "text")
    assert isinstance(found, Divergence) and found.kind == "tape" and "damaged" in found.message
    assert [digest for digest, _ in tape.damaged_blobs({"x": {"$blob": "sha256:a"}})] == ["sha256:a"]


def test_a_recorded_abort_lands_only_where_it_was_requested() -> None:
    io = [
        {"op": "abort_requested", "reason": "weight_update", "state": "generating", "running": True, "in_flight": True}
    ]
    cursor = TapeCursor(record(io), TapeFile(Path("t")))
    assert cursor.abort_before_start() is None  # it came while the rollout ran
    assert cursor.abort_landing("stepping", in_flight=True) is None
    assert cursor.abort_landing("generating", in_flight=False) is None
    assert cursor.abort_landing("generating", in_flight=True) == "weight_update"
    assert cursor.peek() is None


def test_an_abort_before_the_start_is_taken_first() -> None:
    io = [{"op": "abort_requested", "reason": "shutdown", "state": "pending", "running": False, "in_flight": False}]
    cursor = TapeCursor(record(io), TapeFile(Path("t")))
    assert cursor.abort_before_start() == "shutdown"
    assert cursor.peek() is None
