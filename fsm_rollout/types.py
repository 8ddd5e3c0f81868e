"""The domain's nouns as small typed records: what the engine returned, parsed once at the edge.

The engine client turns untrusted JSON into these records; the lifecycle core never handles raw response dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TokenIds = list[int]
"""Token ids exactly as the engine produced them; never re-tokenized."""

Logprobs = list[float]
"""One log-probability per generated token (0.0 for masked, non-generated tokens)."""

TopCandidates = list[list[tuple[int, float]]]
"""Each generated token's top candidates as ``(token_id, logprob)`` pairs, in the engine's order."""

Finish = Literal["stop", "length", "abort"]
"""How a generation turn ended: a stop condition, the token limit, or a server-side abort/cancel."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnMeta:
    """Per-turn bookkeeping from a generate answer that the sample accumulates.

    ``weight_version`` is vime's top-level ``weight_version``, else the version of the last span of
    ``choices[0].weight_versions`` (what upstream vLLM sends).

    ``weight_version_spans`` are ``choices[0].weight_versions`` as ``(version, start, end)`` over the answer's output
    tokens (None when the engine sent none).

    ``routed_experts`` is the decoded ``.npy`` array (any integer dtype) or None; ``top_p_token_ids`` and
    ``top_p_token_offsets`` are the CSR form of ``choices[0].sampling_mask`` (offsets start at 0).

    ``routed_expert_spans`` says, for a turn merged from several requests, which request and weight version each
    run of ``routed_experts`` rows came from, as ``(request_id, version, start_row, end_row)``
    (:func:`fsm_rollout.weights.partial_turn.merge_turns`); None for a turn of one request.
    """

    finish_reason: Finish
    weight_version: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    spec_accept_token_num: int | None = None
    spec_draft_token_num: int | None = None
    spec_verify_ct: int | None = None
    routed_experts: Any = None
    top_p_token_ids: TokenIds | None = None
    top_p_token_offsets: list[int] | None = None
    weight_version_spans: tuple[tuple[str, int, int], ...] | None = None
    routed_expert_spans: tuple[tuple[str, str, int, int], ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratedTurn:
    """One parsed generate answer: the model's tokens, their logprobs, and how the turn ended.

    For ``finish == "abort"`` the tokens and logprobs are what the engine produced before the abort (vLLM sends
    them), or empty when the answer has none that parse. A turn continued after a suspension is the merge of its
    answers (:mod:`fsm_rollout.weights.partial_turn`).

    ``top_logprobs`` holds each token's top candidates when the request asked for them (an agent's
    ``top_logprobs``), else None; they are only handed to whoever asked, never stored on the sample.
    """

    request_id: str
    finish: Finish
    token_ids: TokenIds
    logprobs: Logprobs
    meta: TurnMeta
    top_logprobs: TopCandidates | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RenderedPrompt:
    """The render endpoint's answer: the prompt ids and the body every generate request of the sample reuses.

    ``generate_body`` is the render answer with ``request_id`` removed and ``model`` filled in; it is shared,
    never mutated, and copied shallowly per request.
    """

    token_ids: TokenIds
    generate_body: dict[str, Any] = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedModel:
    """One model an engine lists in ``GET /v1/models``.

    ``root`` is where the engine loaded the model from (vLLM's ``--model`` path or hub id). ``tokenizer`` and
    ``image_merge_size`` are sent by the embedded engine only; None when the engine does not say.
    """

    name: str
    root: str | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    image_merge_size: int | None = None
