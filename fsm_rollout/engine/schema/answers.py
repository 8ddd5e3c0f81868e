"""The client's side of the wire: strict parsing of vLLM's render and generate answers into typed records.

Everything the engine sends is untrusted: shapes, types and lengths are checked here, at the edge, and the rest of
the library only sees :class:`~fsm_rollout.types.RenderedPrompt` and :class:`~fsm_rollout.types.GeneratedTurn`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
from collections.abc import Mapping
from typing import Any

from fsm_rollout.engine.schema.wire import (
    ABORT_FINISH_REASONS,
    TOKEN_TEXT_PREFIX,
    is_int,
    is_int_list,
    is_number,
    is_token_id_list,
)
from fsm_rollout.errors import (
    GenerationError,
    MalformedRenderError,
    MalformedTokensError,
    ModelListError,
    RenderError,
)
from fsm_rollout.types import Finish, GeneratedTurn, RenderedPrompt, ServedModel, TokenIds, TopCandidates, TurnMeta


def coerce_flat_int_token_ids(value: Any) -> TokenIds:
    """Flatten nested lists, tuples, arrays or tensors of token ids into ``list[int]``; None gives ``[]``."""
    if value is None:
        return []
    if is_int_list(value):  # a render answer's flat list: checked in C, the loop below is for the rest
        return list(value)
    if isinstance(value, str | bytes):
        raise MalformedRenderError(f"token_ids must be a sequence of integers, got {type(value).__name__}")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list | tuple):
        flat: TokenIds = []
        for item in value:
            if isinstance(item, list | tuple) or hasattr(item, "tolist"):
                flat.extend(coerce_flat_int_token_ids(item))
            elif not is_int(item):
                raise MalformedRenderError(f"token_ids must hold integers, found {item!r}")
            else:
                flat.append(item)
        return flat
    if not is_int(value):
        raise MalformedRenderError(f"token_ids must hold integers, found {value!r}")
    return [value]


def parse_render_response(data: Any, model: str) -> RenderedPrompt:
    """Turn a render answer into the prompt ids and the body every generate request of the sample reuses.

    Accepts current vLLM's GenerateRequest-shaped dict and the legacy ``[conversation, engine_prompts]`` list.
    """
    if isinstance(data, dict) and isinstance(data.get("token_ids"), list):
        body = dict(data)
        body.setdefault("model", model)
    elif isinstance(data, list) and len(data) >= 2 and isinstance(data[1], list):
        engine_prompts = data[1]
        first = engine_prompts[0] if engine_prompts else None
        if not isinstance(first, dict) or not first:
            raise RenderError("chat/render: legacy answer has no engine prompt")
        ids = first.get("prompt_token_ids") or first.get("token_ids")
        if not ids:
            raise RenderError("chat/render: legacy engine prompt lacks prompt_token_ids/token_ids")
        body = {"token_ids": ids, "model": model}
        if "features" in first:
            body["features"] = first["features"]
        elif first.get("multi_modal_data") is not None:
            with contextlib.suppress(TypeError):  # not JSON-able: the engine gets no features, as in the seed
                body["features"] = json.dumps(first["multi_modal_data"])
        if "cache_salt" in first:
            body["cache_salt"] = first["cache_salt"]
    else:
        raise RenderError(f"chat/render: unexpected JSON shape {type(data).__name__}: {_preview(data)}")
    body.pop("request_id", None)
    token_ids = coerce_flat_int_token_ids(body.get("token_ids"))
    if not token_ids:
        raise RenderError("vLLM render returned empty token_ids")
    body["token_ids"] = token_ids
    return RenderedPrompt(token_ids=token_ids, generate_body=body)


def parse_finish_reason(value: Any) -> Finish:
    """``stop``/``length`` as is; ``abort``/``cancelled`` as ``abort``; anything else is a protocol error."""
    reason = value.get("type") if isinstance(value, dict) else value
    if reason in ABORT_FINISH_REASONS:
        return "abort"
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise GenerationError(f"Unsupported vLLM finish_reason: {reason!r} (expected 'stop', 'length' or 'abort')")


def _require_token_ids(value: Any) -> TokenIds:
    if not is_token_id_list(value):
        raise MalformedTokensError(
            f"choices[0].token_ids must be a list of non-negative integer token ids, got {_preview(value)}"
        )
    return value


def _entry_token_id(entry: Mapping[str, Any]) -> int | None:
    token_id = entry.get("token_id")
    if is_int(token_id):
        return token_id
    token = entry.get("token")
    if isinstance(token, str) and token.startswith(TOKEN_TEXT_PREFIX):
        try:
            return int(token[len(TOKEN_TEXT_PREFIX) :])
        except ValueError:
            return None
    return None


def parse_logprobs(choice: Mapping[str, Any], token_ids: TokenIds) -> list[float]:
    """One logprob per generated token from ``choices[0].logprobs.content`` (either entry shape vLLM uses)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        raise MalformedTokensError("choices[0].logprobs.content must be a list (request logprobs=1)")
    if len(content) != len(token_ids):
        raise GenerationError(f"token/logprob count mismatch: tokens={len(token_ids)}, logprobs={len(content)}")
    values: list[float] = []
    append = values.append
    for index, entry in enumerate(content):
        if type(entry) is dict:
            logprob = entry.get("logprob")
            entry_id = entry.get("token_id")
            # the common shape, checked inline: this loop runs once per generated token
            if type(logprob) is float and type(entry_id) is int and entry_id == token_ids[index]:
                append(logprob)
                continue
        else:
            logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if not is_number(logprob):
            raise MalformedTokensError(f"choices[0].logprobs.content[{index}].logprob must be numeric, got {entry!r}")
        entry_id = _entry_token_id(entry) if isinstance(entry, dict) else None
        if entry_id is not None and entry_id != token_ids[index]:
            raise GenerationError(
                f"choices[0].logprobs.content[{index}] is for token {entry_id}, but token_ids[{index}] is "
                f"{token_ids[index]}"
            )
        append(float(logprob))
    return values


def parse_top_logprobs(choice: Mapping[str, Any], token_ids: TokenIds) -> TopCandidates:
    """Each generated token's top candidates from ``choices[0].logprobs.content[i].top_logprobs``, as
    ``(token_id, logprob)`` pairs in the engine's order (vLLM's: the sampled token first, then the likeliest others
    in rank order). A candidate names its token by ``token_id`` or as ``"token_id:<id>"`` in ``token``."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(token_ids):
        raise MalformedTokensError("choices[0].logprobs.content must hold one entry per generated token")
    tops: TopCandidates = []
    for index, entry in enumerate(content):
        candidates = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(candidates, list):
            raise MalformedTokensError(
                f"choices[0].logprobs.content[{index}].top_logprobs must be a list, got {_preview(candidates)}"
            )
        top: list[tuple[int, float]] = []
        for candidate in candidates:
            token_id = _entry_token_id(candidate) if isinstance(candidate, dict) else None
            logprob = candidate.get("logprob") if isinstance(candidate, dict) else None
            if token_id is None or token_id < 0 or not is_number(logprob):
                raise MalformedTokensError(
                    f"choices[0].logprobs.content[{index}].top_logprobs holds {_preview(candidate)}: each candidate "
                    "needs a token id (token_id, or token as 'token_id:<id>') and a numeric logprob"
                )
            top.append((token_id, float(logprob)))
        tops.append(top)
    return tops


def decode_routed_experts(value: Any) -> Any:
    """Decode ``routed_experts`` (base64 of ``.npy`` bytes) into a numpy array, never unpickling."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, str):
        raise GenerationError(f"routed_experts must be base64 .npy text, got {type(value).__name__}")
    try:
        raw = base64.b64decode(value, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as error:
        raise GenerationError(f"routed_experts is not base64 .npy data: {error}") from error
    if not np.issubdtype(array.dtype, np.integer):
        raise GenerationError(f"routed_experts must hold integers, got dtype {array.dtype}")
    return array


def sampling_mask_to_top_p(mask: Any) -> tuple[TokenIds, list[int]]:
    """Turn ``sampling_mask`` (kept ids per generated token) into flat ids and CSR offsets starting at 0."""
    if not isinstance(mask, list):
        raise GenerationError(f"sampling_mask must be a list of lists of token ids, got {type(mask).__name__}")
    ids: TokenIds = []
    offsets = [0]
    for index, kept in enumerate(mask):
        if not is_int_list(kept):
            raise GenerationError(f"sampling_mask[{index}] must be a list of integer token ids")
        ids.extend(kept)
        offsets.append(len(ids))
    return ids, offsets


def last_span_version(spans: Any) -> Any:
    """The weight version that produced a turn's last token, from vLLM's ``weight_versions`` spans."""
    if isinstance(spans, list) and spans and isinstance(spans[-1], dict):
        return spans[-1].get("version")
    return None


def parse_weight_version_spans(spans: Any) -> tuple[tuple[str, int, int], ...] | None:
    """``choices[0].weight_versions`` as ``(version, start, end)`` triples (None when absent)."""
    if spans is None:
        return None
    if not isinstance(spans, list):
        raise GenerationError(f"choices[0].weight_versions must be a list of spans, got {_preview(spans)}")
    parsed: list[tuple[str, int, int]] = []
    for index, span in enumerate(spans):
        version = span.get("version") if isinstance(span, dict) else None
        start = span.get("start") if isinstance(span, dict) else None
        end = span.get("end") if isinstance(span, dict) else None
        if version is None or not is_int(start) or not is_int(end) or not 0 <= start <= end:
            raise GenerationError(
                f"choices[0].weight_versions[{index}] must be {{version, start, end}} with 0 <= start <= end, "
                f"got {_preview(span)}"
            )
        parsed.append((str(version), start, end))
    return tuple(parsed)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    return value if is_int(value) else None


def _first_int(mapping: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = _int_or_none(mapping.get(key))
        if value is not None:
            return value
    return None


def parse_turn_meta(output: Mapping[str, Any], choice: Mapping[str, Any], finish: Finish) -> TurnMeta:
    """Collect usage, weight version, speculative-decoding stats, routed experts and top-p spans of a turn."""
    usage = _mapping(output.get("usage"))
    details = _mapping(usage.get("prompt_tokens_details"))
    spec = _mapping(_mapping(output.get("metrics")).get("speculative_decoding"))
    weight_version = output.get("weight_version")
    if weight_version is None:
        weight_version = last_span_version(choice.get("weight_versions"))
    # vime's top-level version wins over the spans; then the answer's tokens all carry it
    spans = parse_weight_version_spans(choice.get("weight_versions")) if output.get("weight_version") is None else None
    routed = choice.get("routed_experts")
    mask = choice.get("sampling_mask")
    top_p_ids, top_p_offsets = sampling_mask_to_top_p(mask) if mask is not None else (None, None)
    return TurnMeta(
        finish_reason=finish,
        weight_version=None if weight_version is None else str(weight_version),
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        cached_tokens=_int_or_none(details.get("cached_tokens")),
        spec_accept_token_num=_first_int(spec, "spec_accept_token_num", "num_accepted_tokens"),
        spec_draft_token_num=_first_int(spec, "spec_draft_token_num", "num_draft_tokens"),
        spec_verify_ct=_first_int(spec, "spec_verify_ct", "num_drafts"),
        routed_experts=None if routed is None else decode_routed_experts(routed),
        top_p_token_ids=top_p_ids,
        top_p_token_offsets=top_p_offsets,
        weight_version_spans=spans,
    )


def parse_generate_response(output: Any, request_id: str, *, top_logprobs: bool = False) -> GeneratedTurn:
    """Validate a generate answer and keep ``choices[0]``; with ``top_logprobs`` (the request asked for top
    candidates), each token's candidates too (:func:`parse_top_logprobs`).

    An aborted turn keeps the tokens and logprobs it produced when they parse (a suspended rollout continues from
    them); an abort answer is never an error, so anything else about it that does not parse leaves it without
    tokens, as the seed reads every abort.
    """
    choices = output.get("choices") if isinstance(output, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise GenerationError(f"vLLM generate response must contain choices[0], got {_preview(output)}")
    choice = choices[0]
    finish = parse_finish_reason(choice.get("finish_reason"))
    if finish == "abort":
        return _aborted_turn(output, choice, request_id, top_logprobs=top_logprobs)
    meta = parse_turn_meta(output, choice, finish)
    token_ids = _require_token_ids(choice.get("token_ids"))
    logprobs = parse_logprobs(choice, token_ids)
    tops = parse_top_logprobs(choice, token_ids) if top_logprobs else None
    if meta.top_p_token_offsets is not None and len(meta.top_p_token_offsets) != len(token_ids) + 1:
        raise GenerationError(
            f"sampling_mask has {len(meta.top_p_token_offsets) - 1} entries for {len(token_ids)} generated tokens"
        )
    return GeneratedTurn(
        request_id=request_id, finish=finish, token_ids=token_ids, logprobs=logprobs, meta=meta, top_logprobs=tops
    )


def _aborted_turn(
    output: Mapping[str, Any], choice: Mapping[str, Any], request_id: str, *, top_logprobs: bool
) -> GeneratedTurn:
    try:
        meta = parse_turn_meta(output, choice, "abort")
    except GenerationError:
        meta = TurnMeta(finish_reason="abort")
    tops: TopCandidates | None = [] if top_logprobs else None
    try:
        token_ids = _require_token_ids(choice.get("token_ids"))
        logprobs = parse_logprobs(choice, token_ids) if token_ids else []
        if top_logprobs and token_ids:
            tops = parse_top_logprobs(choice, token_ids)
    except GenerationError:
        token_ids, logprobs, tops = [], [], [] if top_logprobs else None
    spans = meta.weight_version_spans
    offsets = meta.top_p_token_offsets
    if (spans is not None and sum(end - start for _, start, end in spans) != len(token_ids)) or (
        offsets is not None and len(offsets) != len(token_ids) + 1
    ):
        token_ids, logprobs, tops = [], [], [] if top_logprobs else None
    return GeneratedTurn(
        request_id=request_id, finish="abort", token_ids=token_ids, logprobs=logprobs, meta=meta, top_logprobs=tops
    )


def parse_model_list(data: Any) -> list[ServedModel]:
    """The models of a ``GET /v1/models`` answer (``{"data": [{"id", ...}, ...]}``), in the order listed.

    Every card needs a string ``id``; the other fields are kept when they have the right type and dropped otherwise
    (they only fill in defaults the caller can also give itself).
    """
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        raise ModelListError(f"GET /v1/models must answer {{'data': [...]}}, got {_preview(data)}")
    models: list[ServedModel] = []
    for card in cards:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str) or not card["id"]:
            raise ModelListError(f"GET /v1/models lists a model without a string id: {_preview(card)}")
        models.append(
            ServedModel(
                name=card["id"],
                root=_optional_str(card.get("root")),
                max_model_len=_optional_positive_int(card.get("max_model_len")),
                tokenizer=_optional_str(card.get("tokenizer")),
                image_merge_size=_optional_positive_int(card.get("image_merge_size")),
            )
        )
    return models


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _optional_positive_int(value: Any) -> int | None:
    return value if is_int(value) and value > 0 else None


def error_message(body: Any) -> str:
    """The human message of a vLLM/OpenAI error body (``{"error": {"message"}}``, ``{"error": "..."}`` as vLLM's
    API-key check answers, or ``{"message"}``)."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return str(body["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return _preview(body)


def _preview(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
