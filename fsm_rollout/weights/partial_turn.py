"""Internal: one turn generated in several requests, the partial turn a suspension keeps, and the continuation
merged onto it.

When a rollout is suspended mid-turn, the engine answers the aborted request with the tokens it produced so far.
Those are kept; the continuation request carries them as part of its prompt and asks only for the remaining budget.
:func:`merge_turns` joins the answers into the one turn an uninterrupted request would have produced: tokens,
logprobs and metadata in order, the weight-version spans shifted onto the merged positions, and a stop string that
spans two answers found where the engine would have stopped (each answer's engine only saw its own output).

Routed experts are spliced, not taken from the last answer. vLLM's ``routed_experts`` has one row per token of
prompt plus output, less the last (row ``i`` is the routing of the forward pass that took token ``i`` as input),
so every answer covers the whole sequence up to its own output. Each request keeps the rows whose forward passes
produced its own tokens: the first request rows ``[0, P1 - 1)``, request ``k`` rows ``[Pk - 1, Pk+1 - 1)``, where
``Pk`` is request ``k``'s prompt length. So a token's logprob and the routing that produced it come from the same
request, and the prompt keeps the routing of the first request that prefilled it. A request whose answer has no
routes (an aborted one, or one restored from a state without them) leaves its rows to the next request that has
them, the first later one that prefilled them.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fsm_rollout.engine.schema import DEFAULT_WEIGHT_VERSION, decode_routed_experts
from fsm_rollout.errors import GenerationError
from fsm_rollout.types import GeneratedTurn, TopCandidates, TurnMeta

Span = tuple[str, int, int]
RouteSpan = tuple[str, str, int, int]
"""``(request_id, weight_version, start_row, end_row)``: which request's routing a run of routed-expert rows holds."""


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
    prompt_length: int | None = None,
) -> tuple[GeneratedTurn, list[Span]]:
    """One turn from the answers of its requests (the first ones aborted for a suspension), and its spans.

    ``cut_at_stop`` (``token_ids -> length or None``) finds the shortest prefix that ends on a stop string; when a
    merged turn holds one before its end, the turn ends there with ``stop`` as the engine would have ended it.

    ``prompt_length`` is the first request's prompt length; with it the routed experts are spliced per request
    (the module's docstring), else the last answer's are kept whole.
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
    keep: int | None = None
    if len(parts) > 1 and cut_at_stop is not None and finish != "abort":
        end = cut_at_stop(token_ids)
        if end is not None and end < len(token_ids):
            keep = end
            token_ids, logprobs, finish = token_ids[:end], logprobs[:end], "stop"
            tops = None if tops is None else tops[:end]
            spans = [(v, s, min(e, end)) for v, s, e in spans if s < end]
    meta = _merged_meta([part.meta for part in parts], finish, keep_tokens=keep)
    if prompt_length is not None:
        routes, route_spans = splice_routes(parts, prompt_length, fallback_version, keep_tokens=keep)
        meta = replace(meta, routed_experts=routes, routed_expert_spans=tuple(route_spans) if route_spans else None)
    turn = GeneratedTurn(
        request_id=request_id, finish=finish, token_ids=token_ids, logprobs=logprobs, meta=meta, top_logprobs=tops
    )
    return turn, spans


def route_rows(prompt_length: int, token_count: int) -> int:
    """How many routed-expert rows vLLM gives a request: one per prompt and output token, less the last."""
    return max(prompt_length + token_count - 1, 0)


def request_route_spans(
    part: GeneratedTurn, prompt_length: int, start: int, end: int, fallback_version: str | None
) -> list[RouteSpan]:
    """The route spans of rows ``[start, end)`` taken from ``part``, whose prompt had ``prompt_length`` tokens.

    A prefill row (before ``prompt_length - 1``) carries the version the request started with; a decode row the
    version of the token it produced (a request frozen across a weight update has two).
    """
    versions = answer_spans(part, fallback_version)
    first = versions[0][0] if versions else part.meta.weight_version or fallback_version or DEFAULT_WEIGHT_VERSION
    spans: list[RouteSpan] = []

    def add(version: str, lo: int, hi: int) -> None:
        lo, hi = max(lo, start), min(hi, end)
        if hi <= lo:
            return
        if spans and spans[-1][1] == version and spans[-1][3] == lo:
            spans[-1] = (part.request_id, version, spans[-1][2], hi)
        else:
            spans.append((part.request_id, version, lo, hi))

    add(first, 0, prompt_length - 1)
    for version, token_start, token_end in versions:  # token t was produced by row prompt_length + t - 1
        add(version, prompt_length + token_start - 1, prompt_length + token_end - 1)
    return spans


def route_spans(turn: GeneratedTurn, prompt_length: int, fallback_version: str | None) -> list[RouteSpan]:
    """Where each row of ``turn.meta.routed_experts`` came from: the merged turn's spans, else all from its one
    request (empty without routes)."""
    if turn.meta.routed_experts is None:
        return []
    if turn.meta.routed_expert_spans is not None:
        return list(turn.meta.routed_expert_spans)
    rows = route_rows(prompt_length, len(turn.token_ids))
    return request_route_spans(turn, prompt_length, 0, rows, fallback_version)


def splice_routes(
    parts: Sequence[GeneratedTurn],
    prompt_length: int,
    fallback_version: str | None,
    *,
    keep_tokens: int | None = None,
) -> tuple[Any, list[RouteSpan]]:
    """The routed experts of a turn made of ``parts``, each row from the request that owns it (the module's
    docstring), and where each run came from; ``(None, [])`` when no answer has routes.

    ``keep_tokens`` cuts the turn's output to its first tokens (a stop string found across answers). Raises
    ``GenerationError`` when an answer's routes do not have one row per prompt and output token, less the last.
    """
    counts = [len(part.token_ids) for part in parts]
    prompts = [prompt_length + sum(counts[:k]) for k in range(len(parts))]
    total = sum(counts) if keep_tokens is None else keep_tokens
    rows = route_rows(prompt_length, total)
    routed = [part.meta.routed_experts for part in parts]
    last_with = max((k for k, value in enumerate(routed) if value is not None), default=None)
    if last_with is None:
        return None, []
    reference = np.asarray(routed[last_with])
    full = route_rows(prompts[last_with], counts[last_with])
    if full == 0 or reference.size % full:
        _raise_route_size(parts[last_with], reference.size, full)
    width = reference.size // full
    tables: list[Any] = []
    for k, value in enumerate(routed):
        if value is None:
            tables.append(None)
            continue
        expected = route_rows(prompts[k], counts[k])
        array = np.asarray(value)
        if array.size != expected * width:
            _raise_route_size(parts[k], array.size, expected, width)
        tables.append(array.reshape(expected, width))
    bounds = [0, *(prompt - 1 for prompt in prompts[1:]), rows]
    pieces: list[Any] = []
    spans: list[RouteSpan] = []
    for k in range(len(parts)):
        lo, hi = bounds[k], min(bounds[k + 1], rows)
        if hi <= lo:
            continue
        # rows this request owns but did not send come from the first later request that prefilled them
        sources = [j for j in range(k, len(parts)) if tables[j] is not None and tables[j].shape[0] >= hi]
        if not sources:  # no later answer has them either (the last one came without routes)
            return None, []
        source = sources[0]
        pieces.append(tables[source][lo:hi])
        for span in request_route_spans(parts[source], prompts[source], lo, hi, fallback_version):
            if spans and spans[-1][:2] == span[:2] and spans[-1][3] == span[2]:
                spans[-1] = (*span[:2], spans[-1][2], span[3])
            else:
                spans.append(span)
    spliced = np.concatenate(pieces) if pieces else np.zeros((0, width), dtype=reference.dtype)
    if reference.ndim >= 2 and reference.shape[0] == full:  # keep the engine's (rows, layers, topk) shape
        spliced = spliced.reshape(rows, *reference.shape[1:])
    elif reference.ndim < 2:
        spliced = spliced.reshape(-1)
    return spliced.astype(reference.dtype, copy=False), spans


def _raise_route_size(part: GeneratedTurn, size: int, rows: int, width: int | None = None) -> None:
    expected = "a multiple of" if width is None else f"{width} x"
    raise GenerationError(
        f"routed_experts of request {part.request_id} has {size} values; expected {expected} {rows} rows (one per "
        "prompt and output token, less the last)"
    )


def _sum(values: Sequence[int | None]) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def _merged_meta(metas: Sequence[TurnMeta], finish: Any, *, keep_tokens: int | None = None) -> TurnMeta:
    """The engine bookkeeping of a turn made in several requests: counters summed (each request was real engine
    work), the last request's weight version and routed experts (:func:`merge_turns` splices the routes when it
    knows the prompt length), top-p spans in order."""
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
    """A partial turn as plain JSON (for a suspended sample's resume state); routed experts as base64 ``.npy``, as
    vLLM sends them, so a resumed turn splices them like one that never left."""
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
            "routed_experts": None if meta.routed_experts is None else _npy_base64(meta.routed_experts),
            "routed_expert_spans": None
            if meta.routed_expert_spans is None
            else [list(span) for span in meta.routed_expert_spans],
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
    routed = meta.pop("routed_experts", None)  # absent from a state written before routes were kept
    routed_spans = meta.pop("routed_expert_spans", None)
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
            routed_experts=None if routed is None else decode_routed_experts(routed),
            routed_expert_spans=None
            if routed_spans is None
            else tuple((str(r), str(v), int(s), int(e)) for r, v, s, e in routed_spans),
            **meta,
        ),
    )


def _npy_base64(array: Any) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


__all__ = [
    "RouteSpan",
    "Span",
    "answer_spans",
    "join_spans",
    "merge_turns",
    "request_route_spans",
    "route_rows",
    "route_spans",
    "shift_spans",
    "splice_routes",
    "turn_from_json",
    "turn_to_json",
]
