"""Comparing what today's rollout does with what the recording holds, one kind of thing at a time.

Each comparator takes the recorded value and today's, and returns a :class:`Divergence` describing the first
difference, or None. They do no I/O, raise nothing and keep no state; the re-execution
(:mod:`fsm_rollout.replay.reexecute`) decides when to call them and fills in what only the running rollout knows
(the turn and state a request or environment call was made in, the tape line).

* an engine request: :func:`compare_engine_request`;
* an environment call: :func:`compare_env_call`;
* a transition event: :func:`compare_transition`, :func:`extra_transition`, :func:`compare_transition_count`;
* the final result (an :class:`Outcome` each): :func:`compare_tokens`, :func:`compare_loss_mask`,
  :func:`compare_logprobs`, :func:`compare_status`, :func:`compare_reason`, :func:`compare_error`, in that order
  :func:`compare_outcome`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fsm_rollout.recording.format import jsonable
from fsm_rollout.replay.paths import arrow

DivergenceKind = Literal[
    "transition",
    "request",
    "unexpected call",
    "missing answer",
    "tokens",
    "loss_mask",
    "logprobs",
    "status",
    "reason",
    "error",
    "leftover",
    "setup",
    "tape",
]

CORE_FIELDS = ("trigger", "src", "dst", "turn", "reason", "response_length", "remaining_budget")
"""Transition fields compared even when only one side has them."""
UNCOMPARED_FIELDS = frozenset({"dwell_ms", "suspended_ms", "ts", "schema", "event", "sample_id", "session_id"})
"""Transition fields that differ between any two runs (timing, identity the trace binds)."""
CONTEXT_TOKENS = 12
CONTEXT_CHARS = 60
ABSENT = "(absent)"


@dataclass(frozen=True)
class TextContext:
    """Decoded text around a divergence: what came before, then what the recording and today's code have there."""

    before: str
    expected: str
    actual: str


@dataclass(frozen=True)
class Divergence:
    """The first place where today's rollout did something the recording did not."""

    kind: DivergenceKind
    """``transition``, ``request`` (a request or environment call differs), ``unexpected call``, ``missing answer``
    (the tape has no answer), ``tokens``, ``loss_mask``, ``logprobs``, ``status``, ``reason``, ``error``,
    ``leftover`` (the recording made more calls), ``setup`` (today's code rejects the recorded sample or config)
    or ``tape`` (the record itself is malformed)."""
    message: str
    turn: int | None = None
    state: str | None = None
    index: int | None = None
    """The token index (into ``sample.tokens``), character index or transition number the message refers to."""
    expected: Any = None
    actual: Any = None
    context: TextContext | None = None
    line: int | None = None
    """The trace line of the diverging transition (or the tape line of the record)."""


@dataclass(frozen=True)
class Outcome:
    """How a sample ended, as its recorded result says or as today's rollout left it."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int] | None
    rollout_log_probs: Sequence[float] | None
    status: str | None
    reason: str | None
    error: Any = None
    """``metadata["rollout_error"]`` as JSON; None when the sample did not fail (or the tape predates it)."""
    branches: tuple[tuple[list[int], list[int] | None], ...] = ()
    """The rollout's earlier training sequences (``sample.branches``), each as its tokens and loss mask."""


# ---------------------------------------------------------------------------------------------------- requests


def compare_engine_request(
    what: str,
    *,
    recorded_request: Any,
    recorded_headers: Mapping[str, str] | None,
    recorded_tokens: list[int] | None,
    payload: Mapping[str, Any],
    headers: Mapping[str, str] | None,
    tokenizer: Any,
) -> Divergence | None:
    """An engine request today's rollout sends against the recorded one: token ids, body, headers.

    ``recorded_tokens`` are the recorded ``token_ids`` of a generate request (kept apart from its body on the
    tape), or None when the request has none; ``what`` names the request in messages.
    """
    body: Mapping[str, Any] = payload
    if recorded_tokens is not None:
        sent = payload.get("token_ids")
        if sent != recorded_tokens:
            sent_list = list(sent) if isinstance(sent, list | tuple) else []
            index = first_index(recorded_tokens, sent_list)
            return Divergence(
                "request",
                f"{what} sends different token_ids: token_ids[{index}] "
                f"{token_at(tokenizer, recorded_tokens, index)} in the recording, "
                f"{token_at(tokenizer, sent_list, index)} today "
                f"({len(recorded_tokens)} vs {len(sent_list)} ids)",
                index=index,
                context=token_context(tokenizer, recorded_tokens, sent_list, index),
            )
        body = {key: value for key, value in payload.items() if key != "token_ids"}
    body = _as_recorded_unbounded(recorded_request, body)
    if isinstance(recorded_request, Mapping) and "stream" not in recorded_request:
        # a streamed exchange is recorded without its stream fields (the recorder keeps the whole exchange it
        # amounts to); a replay never streams, so today's own stream fields are not a difference
        body = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    if recorded_request != body:
        difference = first_difference(recorded_request, jsonable(body))
        if difference is not None:  # equal once today's tuples are JSON lists
            where, recorded, today = difference
            return Divergence(
                "request", f"{what} differs at {where or 'the top level'}", expected=recorded, actual=today
            )
    recorded_headers = recorded_headers or None
    sent_headers = dict(headers) if headers else None
    if recorded_headers != sent_headers:
        return Divergence("request", f"{what} sends different headers", expected=recorded_headers, actual=sent_headers)
    return None


def _as_recorded_unbounded(recorded: Any, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """``body`` as a release that left ``max_tokens`` out for an unbounded turn would have sent it.

    An explicit ``"max_tokens": null`` and an absent key mean the same to the vLLM versions those releases ran
    against (the rest of the context), so a recording without the key is no divergence.
    """
    params = body.get("sampling_params")
    recorded_params = recorded.get("sampling_params") if isinstance(recorded, Mapping) else None
    if (
        isinstance(params, Mapping)
        and "max_tokens" in params
        and params["max_tokens"] is None
        and isinstance(recorded_params, Mapping)
        and "max_tokens" not in recorded_params
    ):
        return {**body, "sampling_params": {key: value for key, value in params.items() if key != "max_tokens"}}
    return body


def compare_env_call(op: str, recorded_text: Any, text: str | None) -> Divergence | None:
    """An environment call's argument against the recorded one (only ``step`` has one: the model's text)."""
    if op != "step" or recorded_text == text:
        return None
    recorded, today = str(recorded_text), str(text)
    index = first_index(recorded, today)
    return Divergence(
        "request",
        f"env.step gets different text (first difference at character {index})",
        index=index,
        context=TextContext(
            recorded[max(0, index - CONTEXT_CHARS) : index],
            recorded[index : index + CONTEXT_CHARS],
            today[index : index + CONTEXT_CHARS],
        ),
    )


# ---------------------------------------------------------------------------------------------------- transitions


def compare_transition(index: int, recorded: Mapping[str, Any], today: Mapping[str, Any]) -> Divergence | None:
    """Today's ``index``-th transition event against the recording's: the core fields, and every other field both
    events have (timing and identity apart)."""
    differing = [name for name in CORE_FIELDS if recorded.get(name) != today.get(name)]
    differing += [
        name
        for name in recorded
        if name in today and name not in CORE_FIELDS and name not in UNCOMPARED_FIELDS and recorded[name] != today[name]
    ]
    if not differing:
        return None
    was = arrow(recorded.get("src"), recorded.get("trigger"), recorded.get("dst"))
    now = arrow(today.get("src"), today.get("trigger"), today.get("dst"))
    detail = ", ".join(f"{name} {recorded.get(name)!r} → {today.get(name)!r}" for name in differing)
    message = (
        f"transition {index + 1}: recorded {was}, today {now}" if was != now else f"transition {index + 1} ({now})"
    ) + f"; differs in {detail}"
    return Divergence(
        "transition",
        message,
        turn=recorded.get("turn"),
        state=recorded.get("src"),
        index=index,
        expected=event_view(recorded),
        actual=event_view(today),
    )


def extra_transition(index: int, today: Mapping[str, Any]) -> Divergence:
    """Today's ``index``-th transition, which the recording (with ``index`` transitions) does not have."""
    now = arrow(today.get("src"), today.get("trigger"), today.get("dst"))
    return Divergence(
        "transition",
        f"today's rollout fires {now} after the recording's last transition",
        turn=today.get("turn"),
        state=today.get("src"),
        index=index,
        actual=event_view(today),
    )


def compare_transition_count(recorded: Sequence[Mapping[str, Any]], fired: int) -> Divergence | None:
    """Whether today's rollout, having ended after ``fired`` transitions, fired all the recorded ones."""
    if fired >= len(recorded):
        return None
    missing = recorded[fired]
    return Divergence(
        "transition",
        "today's rollout ended before the recording's "
        f"{arrow(missing.get('src'), missing.get('trigger'), missing.get('dst'))}",
        index=fired,
        expected=event_view(missing),
    )


def event_view(event: Mapping[str, Any]) -> dict[str, Any]:
    """A transition event without the fields that are never compared."""
    return {key: value for key, value in event.items() if key not in UNCOMPARED_FIELDS}


# ---------------------------------------------------------------------------------------------------- the result


def compare_tokens(
    recorded: Outcome, today: Outcome, *, tokenizer: Any, transitions: Sequence[Mapping[str, Any]]
) -> Divergence | None:
    """The sample's whole token list (prompt and response); the turn is found from the recorded transitions."""
    if today.tokens == recorded.tokens:
        return None
    index = first_index(recorded.tokens, today.tokens)
    return Divergence(
        "tokens",
        f"tokens[{index}]: {token_at(tokenizer, recorded.tokens, index)} recorded, "
        f"{token_at(tokenizer, today.tokens, index)} today "
        f"({len(recorded.tokens)} vs {len(today.tokens)} tokens)",
        turn=turn_of(transitions, index - recorded.prompt_length),
        index=index,
        context=token_context(tokenizer, recorded.tokens, today.tokens, index),
    )


def compare_branches(recorded: Outcome, today: Outcome, *, tokenizer: Any) -> Divergence | None:
    """The earlier training sequences of a rollout that forked: how many, then each one's tokens and loss mask."""
    if recorded.branches == today.branches:
        return None
    if len(recorded.branches) != len(today.branches):
        return Divergence(
            "tokens",
            f"{len(recorded.branches)} earlier sequence(s) (forks) recorded, {len(today.branches)} today",
            expected=len(recorded.branches),
            actual=len(today.branches),
        )
    for number, (old, new) in enumerate(zip(recorded.branches, today.branches, strict=True)):
        if old[0] != new[0]:
            index = first_index(old[0], new[0])
            return Divergence(
                "tokens",
                f"branch {number} tokens[{index}]: {token_at(tokenizer, old[0], index)} recorded, "
                f"{token_at(tokenizer, new[0], index)} today ({len(old[0])} vs {len(new[0])} tokens)",
                index=index,
                context=token_context(tokenizer, old[0], new[0], index),
            )
        if old[1] != new[1]:
            index = first_index(old[1] or [], new[1] or [])
            return Divergence(
                "loss_mask",
                f"branch {number} loss_mask[{index}]: {value_at(old[1] or [], index)} recorded, "
                f"{value_at(new[1] or [], index)} today",
            )
    return None


def compare_loss_mask(
    recorded: Outcome, today: Outcome, *, tokenizer: Any, transitions: Sequence[Mapping[str, Any]]
) -> Divergence | None:
    """The loss mask (one entry per response token); the index reported is into the tokens."""
    if recorded.loss_mask == today.loss_mask:
        return None
    recorded_mask, today_mask = recorded.loss_mask or [], list(today.loss_mask or [])
    index = first_index(recorded_mask, today_mask)
    offset = recorded.prompt_length
    return Divergence(
        "loss_mask",
        f"loss_mask[{index}] (tokens[{offset + index}]): {value_at(recorded_mask, index)} recorded, "
        f"{value_at(today_mask, index)} today",
        turn=turn_of(transitions, index),
        index=offset + index,
        context=token_context(tokenizer, recorded.tokens, today.tokens, offset + index),
    )


def compare_logprobs(
    recorded: Outcome, today: Outcome, *, transitions: Sequence[Mapping[str, Any]]
) -> Divergence | None:
    """The rollout's log probabilities (one per response token), compared exactly."""
    if recorded.rollout_log_probs == today.rollout_log_probs:
        return None
    recorded_values, today_values = list(recorded.rollout_log_probs or []), list(today.rollout_log_probs or [])
    index = first_index(recorded_values, today_values)
    offset = recorded.prompt_length
    return Divergence(
        "logprobs",
        f"rollout_log_probs[{index}] (tokens[{offset + index}]): {value_at(recorded_values, index)} recorded, "
        f"{value_at(today_values, index)} today",
        turn=turn_of(transitions, index),
        index=offset + index,
        expected=value_at(recorded_values, index),
        actual=value_at(today_values, index),
    )


def compare_status(recorded: Outcome, today: Outcome, *, turn: int | None) -> Divergence | None:
    """The terminal status; ``turn`` is the turn today's rollout ended in."""
    if recorded.status == today.status:
        return None
    return Divergence(
        "status", "the sample ends with another status", turn=turn, expected=recorded.status, actual=today.status
    )


def compare_reason(recorded: Outcome, today: Outcome, *, turn: int | None) -> Divergence | None:
    """The terminal reason; ``turn`` is the turn today's rollout ended in."""
    if recorded.reason == today.reason:
        return None
    return Divergence(
        "reason", "the sample ends for another reason", turn=turn, expected=recorded.reason, actual=today.reason
    )


def compare_error(recorded: Outcome, today: Outcome, *, turn: int | None) -> Divergence | None:
    """The error a failed sample ended with (class name, message, state, trigger).

    A recorded result without an error (a sample that did not fail, or a tape from before errors were kept) has
    nothing to compare: a sample failing today where the recording did not is a status divergence.
    """
    if recorded.error is None or recorded.error == today.error:
        return None
    return Divergence(
        "error", "the sample fails with another error", turn=turn, expected=recorded.error, actual=today.error
    )


def compare_outcome(
    recorded: Outcome, today: Outcome, *, tokenizer: Any, transitions: Sequence[Mapping[str, Any]], turn: int | None
) -> Divergence | None:
    """The first of tokens, loss mask, logprobs, status, reason and error that differs (``transitions``: the
    recorded ones, which place a token index in its turn; ``turn``: the one today's rollout ended in)."""
    return (
        compare_branches(recorded, today, tokenizer=tokenizer)
        or compare_tokens(recorded, today, tokenizer=tokenizer, transitions=transitions)
        or compare_loss_mask(recorded, today, tokenizer=tokenizer, transitions=transitions)
        or compare_logprobs(recorded, today, transitions=transitions)
        or compare_status(recorded, today, turn=turn)
        or compare_reason(recorded, today, turn=turn)
        or compare_error(recorded, today, turn=turn)
    )


def turn_of(transitions: Sequence[Mapping[str, Any]], response_index: int) -> int | None:
    """The turn in which the response had grown past ``response_index`` tokens (else the last turn)."""
    for event in transitions:
        length = event.get("response_length")
        if isinstance(length, int) and length > response_index:
            turn = event.get("turn")
            return turn if isinstance(turn, int) else None
    last = transitions[-1].get("turn") if transitions else None
    return last if isinstance(last, int) else None


# ---------------------------------------------------------------------------------------------------- helpers


def first_index(expected: Sequence[Any], actual: Sequence[Any]) -> int:
    """The first index where two sequences differ (the shorter one's length when one is a prefix)."""
    limit = min(len(expected), len(actual))
    for index in range(limit):
        if expected[index] != actual[index]:
            return index
    return limit


def value_at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else "(none)"


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Token ids as text; ids the tokenizer cannot decode (a tampered tape) are shown as ids."""
    try:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))
    except Exception:
        return " ".join(f"<{token}>" for token in token_ids)


def token_at(tokenizer: Any, token_ids: Sequence[int], index: int) -> str:
    if index >= len(token_ids):
        return "(end)"
    return f"{token_ids[index]} {decode(tokenizer, token_ids[index : index + 1])!r}"


def token_context(tokenizer: Any, expected: Sequence[int], actual: Sequence[int], index: int) -> TextContext:
    """The decoded tokens before ``index`` (as recorded), then from ``index`` on each side."""
    return TextContext(
        before=decode(tokenizer, expected[max(0, index - CONTEXT_TOKENS) : index]),
        expected=decode(tokenizer, expected[index : index + CONTEXT_TOKENS]),
        actual=decode(tokenizer, actual[index : index + CONTEXT_TOKENS]),
    )


def first_difference(expected: Any, actual: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first place (a dotted path) where two JSON values differ, with both values there."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in list(expected) + [key for key in actual if key not in expected]:
            inner = f"{where}.{key}" if where else str(key)
            if key not in actual:
                return inner, expected[key], ABSENT
            if key not in expected:
                return inner, ABSENT, actual[key]
            found = first_difference(expected[key], actual[key], inner)
            if found is not None:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for index, (left, right) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(left, right, f"{where}[{index}]")
            if found is not None:
                return found
        if len(expected) != len(actual):
            return f"{where} (length)", len(expected), len(actual)
        return None
    return None if expected == actual else (where, expected, actual)


__all__ = [
    "Divergence",
    "DivergenceKind",
    "Outcome",
    "TextContext",
    "compare_engine_request",
    "compare_env_call",
    "compare_error",
    "compare_logprobs",
    "compare_loss_mask",
    "compare_outcome",
    "compare_reason",
    "compare_status",
    "compare_tokens",
    "compare_transition",
    "compare_transition_count",
    "extra_transition",
    "first_difference",
    "turn_of",
]
