"""Internal: one turn generated in several requests, the partial turn a suspension keeps, and the continuation
merged onto it.

When a rollout is suspended mid-turn, the engine answers the aborted request with the tokens it produced so far.
Those are kept; the continuation request carries them as part of its prompt and asks only for the remaining budget.
:func:`merge_turns` joins the answers into the one turn an uninterrupted request would have produced: tokens,
logprobs and metadata in order, the weight-version spans shifted onto the merged positions, and a stop string that
spans two answers found where the engine would have stopped (each answer's engine only saw its own output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsm_rollout.engine.schema import DEFAULT_WEIGHT_VERSION
from fsm_rollout.errors import GenerationError
from fsm_rollout.types import GeneratedTurn, TopCandidates, TurnMeta

Span = tuple[str, int, int]


def answer_spans(turn: GeneratedTurn, fallback_version: str | None) -> list[Span]:
    """The weight-version spans of one answer over its own tokens: the engine's ``weight_versions``, else one span of
    its top-level ``weight_version``, else of ``fallback_version`` (vLLM's ``default`` when that is None too).

    Spans from the engine must cover its tokens exactly once, in order.
    """
    count = len(turn.token_ids)
    if count == 0:
        return []
    spans = turn.meta.weight_version_spans
    if spans is None:
        version = turn.meta.weight_version or fallback_version or DEFAULT_WEIGHT_VERSION
        return [(version, 0, count)]
    covered: list[Span] = []
    position = 0
    for version, start, end in spans:
        if start != position:
            _raise_uncovered(count, spans)
        if end > start:
            covered.append((version, start, end))
        position = end
    if position != count:
        _raise_uncovered(count, spans)
    return covered


def _raise_uncovered(count: int, spans: Sequence[Span]) -> None:
    raise GenerationError(
        f"choices[0].weight_versions must cover the {count} output tokens once, in order; got "
        f"{[{'version': v, 'start': s, 'end': e} for v, s, e in spans]}"
    )


def shift_spans(spans: Sequence[Span], offset: int) -> list[Span]:
    """``spans`` moved ``offset`` positions on."""
    return [(version, start + offset, end + offset) for version, start, end in spans]


def join_spans(spans: list[Span], more: Sequence[Span]) -> list[Span]:
    """``spans`` extended by ``more``, a span that continues the last one with the same version merged into it."""
    for span in more:
        if spans and spans[-1][0] == span[0] and spans[-1][2] == span[1]:
            spans[-1] = (span[0], spans[-1][1], span[2])
        else:
            spans.append(span)
    return spans


def merge_turns(
    parts: Sequence[GeneratedTurn],
    *,
    request_id: str,
    fallback_version: str | None,
    cut_at_stop: Any = None,
) -> tuple[GeneratedTurn, list[Span]]:
    """One turn from the answers of its requests (the first ones aborted for a suspension), and its spans.

    ``cut_at_stop`` (``token_ids -> length or None``) finds the shortest prefix that ends on a stop string; when a
    merged turn holds one before its end, the turn ends there with ``stop`` as the engine would have ended it.
    """
    token_ids: list[int] = []
    logprobs: list[float] = []
    spans: list[Span] = []
    # top candidates only when every part has them (a part restored from a resume state has none)
    tops: TopCandidates | None = [] if all(part.top_logprobs is not None for part in parts) else None
    for part in parts:
        join_spans(spans, shift_spans(answer_spans(part, fallback_version), len(token_ids)))
        token_ids.extend(part.token_ids)
        logprobs.extend(part.logprobs)
        if tops is not None and part.top_logprobs is not None:
            tops.extend(part.top_logprobs)
    last = parts[-1]
    finish = last.finish
    meta = _merged_meta([part.meta for part in parts], finish)
    if len(parts) > 1 and cut_at_stop is not None and finish != "abort":
        end = cut_at_stop(token_ids)
        if end is not None and end < len(token_ids):
            token_ids, logprobs, finish = token_ids[:end], logprobs[:end], "stop"
            tops = None if tops is None else tops[:end]
            spans = [(v, s, min(e, end)) for v, s, e in spans if s < end]
            meta = _merged_meta([part.meta for part in parts], finish, keep_tokens=end)
    turn = GeneratedTurn(
        request_id=request_id, finish=finish, token_ids=token_ids, logprobs=logprobs, meta=meta, top_logprobs=tops
    )
    return turn, spans


def _sum(values: Sequence[int | None]) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def _merged_meta(metas: Sequence[TurnMeta], finish: Any, *, keep_tokens: int | None = None) -> TurnMeta:
    """The engine bookkeeping of a turn made in several requests: counters summed (each request was real engine
    work), the last request's weight version and routed experts (they cover the whole sequence), top-p spans in
    order."""
    last = metas[-1]
    top_p_ids: list[int] | None = None
    top_p_offsets: list[int] | None = None
    if all(meta.top_p_token_ids is not None and meta.top_p_token_offsets is not None for meta in metas):
        top_p_ids, top_p_offsets = [], [0]
        for meta in metas:
            assert meta.top_p_token_ids is not None and meta.top_p_token_offsets is not None
            shift = len(top_p_ids)
            top_p_ids.extend(meta.top_p_token_ids)
            top_p_offsets.extend(offset + shift for offset in meta.top_p_token_offsets[1:])
        if keep_tokens is not None:
            top_p_offsets = top_p_offsets[: keep_tokens + 1]
            top_p_ids = top_p_ids[: top_p_offsets[-1]]
    versions = [meta.weight_version for meta in metas if meta.weight_version is not None]
    return TurnMeta(
        finish_reason=finish,
        weight_version=versions[-1] if versions else None,
        prompt_tokens=_sum([meta.prompt_tokens for meta in metas]),
        completion_tokens=_sum([meta.completion_tokens for meta in metas]),
        cached_tokens=_sum([meta.cached_tokens for meta in metas]),
        spec_accept_token_num=_sum([meta.spec_accept_token_num for meta in metas]),
        spec_draft_token_num=_sum([meta.spec_draft_token_num for meta in metas]),
        spec_verify_ct=_sum([meta.spec_verify_ct for meta in metas]),
        routed_experts=last.routed_experts,
        top_p_token_ids=top_p_ids,
        top_p_token_offsets=top_p_offsets,
        weight_version_spans=None,
    )


def turn_to_json(turn: GeneratedTurn) -> dict[str, Any]:
    """A partial turn as plain JSON (for a suspended sample's resume state); routed experts are not kept (the
    continuation's answer carries them for the whole sequence)."""
    meta = turn.meta
    out: dict[str, Any] = {
        "request_id": turn.request_id,
        "finish": turn.finish,
        "token_ids": list(turn.token_ids),
        "logprobs": list(turn.logprobs),
        "meta": {
            "finish_reason": meta.finish_reason,
            "weight_version": meta.weight_version,
            "prompt_tokens": meta.prompt_tokens,
            "completion_tokens": meta.completion_tokens,
            "cached_tokens": meta.cached_tokens,
            "spec_accept_token_num": meta.spec_accept_token_num,
            "spec_draft_token_num": meta.spec_draft_token_num,
            "spec_verify_ct": meta.spec_verify_ct,
            "top_p_token_ids": meta.top_p_token_ids,
            "top_p_token_offsets": meta.top_p_token_offsets,
            "weight_version_spans": None
            if meta.weight_version_spans is None
            else [list(span) for span in meta.weight_version_spans],
        },
    }
    if turn.top_logprobs is not None:
        out["top_logprobs"] = [[list(pair) for pair in top] for top in turn.top_logprobs]
    return out


def turn_from_json(data: Any) -> GeneratedTurn:
    """The inverse of :func:`turn_to_json` (a state written before it kept the finish is a partial turn's:
    ``abort``)."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ValueError(f"a partial turn must be a JSON object with meta, got {type(data).__name__}")
    meta = dict(data["meta"])
    spans = meta.pop("weight_version_spans", None)
    finish = data.get("finish", "abort")
    finish_reason = meta.pop("finish_reason", finish)
    token_ids = [int(token) for token in data["token_ids"]]
    logprobs = [float(value) for value in data["logprobs"]]
    if len(token_ids) != len(logprobs):
        raise ValueError(f"a partial turn has {len(token_ids)} tokens and {len(logprobs)} logprobs")
    kept = data.get("top_logprobs")  # absent from a state written before top candidates were kept
    tops = None if kept is None else [[(int(token), float(value)) for token, value in top] for top in kept]
    if tops is not None and len(tops) != len(token_ids):
        raise ValueError(f"a partial turn has {len(token_ids)} tokens and {len(tops)} top-candidate lists")
    return GeneratedTurn(
        top_logprobs=tops,
        request_id=str(data["request_id"]),
        finish=finish,
        token_ids=token_ids,
        logprobs=logprobs,
        meta=TurnMeta(
            finish_reason=finish_reason,
            weight_version_spans=None if spans is None else tuple((str(v), int(s), int(e)) for v, s, e in spans),
            **meta,
        ),
    )


__all__ = ["Span", "answer_spans", "join_spans", "merge_turns", "shift_spans", "turn_from_json", "turn_to_json"]
