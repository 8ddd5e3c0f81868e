"""Stand-in for the ``vime.rollout.vllm_rollout`` helpers the seed imports (seed contract sections 2, 4, 5, 10).

``GenerateState`` does not load anything from ``args.hf_checkpoint``: the test assigns the tokenizer (and, if
wanted, the processor) to the module-level ``TOKENIZER`` / ``PROCESSOR`` before the first ``GenerateState``.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
from typing import Any, ClassVar

import numpy as np

TOKENIZER: Any = None
"""The tokenizer every ``GenerateState`` hands out; set by the test."""

PROCESSOR: Any = None
"""The processor every ``GenerateState`` hands out; None for the text-only test model."""


class GenerateState:
    """Per-process singleton: the first construction wins, later ``args`` are ignored (like vime's SingletonMeta)."""

    _instance: ClassVar[GenerateState | None] = None

    tokenizer: Any
    processor: Any

    def __new__(cls, args: Any) -> GenerateState:
        if cls._instance is None:
            if TOKENIZER is None:
                raise RuntimeError("vime stand-in: set vllm_rollout.TOKENIZER before the first GenerateState")
            instance = super().__new__(cls)
            instance.tokenizer = TOKENIZER
            instance.processor = PROCESSOR
            cls._instance = instance
        return cls._instance


def _build_inference_sampling_params(sp: dict[str, Any], logprobs: int = 1) -> dict[str, Any]:
    """Map trainer sampling params to a vLLM ``SamplingParams`` JSON object (section 5's table)."""
    params: dict[str, Any] = {
        "max_tokens": sp["max_new_tokens"],
        "temperature": sp["temperature"],
        "top_p": sp["top_p"],
        "logprobs": logprobs,
    }
    top_k = sp.get("top_k")
    if top_k is not None and (top_k > 0 or top_k == -1):
        params["top_k"] = top_k
    stop = sp.get("stop")
    if stop:
        params["stop"] = stop
        if sp.get("no_stop_trim"):
            params["include_stop_str_in_output"] = True
    if sp.get("stop_token_ids"):
        params["stop_token_ids"] = sp["stop_token_ids"]
    if sp.get("seed") is not None:
        params["seed"] = sp["seed"]
    if sp.get("min_new_tokens") is not None:
        params["min_tokens"] = sp["min_new_tokens"]
    if sp.get("repetition_penalty") is not None:
        params["repetition_penalty"] = sp["repetition_penalty"]
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if sp.get(name) is not None:
            params[name] = bool(sp[name])
    return params


def _coerce_flat_int_token_ids(ids: Any) -> list[int]:
    """Flatten nested lists, tuples, arrays and tensors into a flat list of ints; None gives []."""
    if ids is None:
        return []
    if isinstance(ids, str):
        raise TypeError("token ids must not be a string")
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, list | tuple):
        flat: list[int] = []
        for item in ids:
            flat.extend(_coerce_flat_int_token_ids(item))
        return flat
    return [int(ids)]


def _inference_generate_meta_info(output: dict[str, Any]) -> dict[str, Any]:
    """The per-turn metadata ``Sample.append_response_tokens`` consumes, built from a generate answer."""
    choice = output["choices"][0]
    finish = choice.get("finish_reason")
    if isinstance(finish, dict):
        finish_reason = finish
    elif finish == "length":
        finish_reason = {"type": "length"}
    elif finish in ("abort", "cancelled"):
        finish_reason = {"type": "abort"}
    else:
        finish_reason = {"type": "stop"}
    meta: dict[str, Any] = {"finish_reason": finish_reason}

    if output.get("weight_version") is not None:
        meta["weight_version"] = str(output["weight_version"])

    usage = output.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        meta["prompt_tokens"] = usage["prompt_tokens"]
    if usage.get("completion_tokens") is not None:
        meta["completion_tokens"] = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    meta["cached_tokens"] = details.get("cached_tokens") or 0

    spec = (output.get("metrics") or {}).get("speculative_decoding") or {}
    for key, fallbacks in (
        ("spec_accept_token_num", ("num_accepted_tokens", "accepted_tokens")),
        ("spec_draft_token_num", ("num_draft_tokens", "draft_tokens")),
        ("spec_verify_ct", ("num_verify", "verify_ct")),
    ):
        for name in (key, *fallbacks):
            if spec.get(name) is not None:
                meta[key] = spec[name]
                break

    routed = choice.get("routed_experts")
    if routed is not None:
        meta["routed_experts"] = np.load(io.BytesIO(base64.b64decode(routed)), allow_pickle=False)

    mask = choice.get("sampling_mask")
    if mask is not None:
        ids: list[int] = []
        offsets = [0]
        for kept in mask:
            ids.extend(int(token) for token in kept)
            offsets.append(len(ids))
        meta["top_p_token_ids"] = ids
        meta["top_p_token_offsets"] = offsets
    return meta


def _mm_render_response_to_generate_body(render_data: Any, model: str) -> dict[str, Any]:
    """Turn a ``/v1/chat/completions/render`` answer into a ``/inference/v1/generate`` body (section 4)."""
    if isinstance(render_data, dict) and isinstance(render_data.get("token_ids"), list):
        body = copy.deepcopy(render_data)
        body.setdefault("model", model)
        return body
    if isinstance(render_data, list) and len(render_data) == 2:
        engine_prompts = render_data[1]
        first = engine_prompts[0] if isinstance(engine_prompts, list) and engine_prompts else None
        if not isinstance(first, dict) or not first:
            raise ValueError(f"chat/render: unexpected JSON shape (engine prompts {engine_prompts!r})")
        token_ids = first.get("prompt_token_ids") or first.get("token_ids")
        if not token_ids:
            raise ValueError("chat/render: unexpected JSON shape (no prompt token ids)")
        body = {"model": model, "token_ids": list(token_ids)}
        if "features" in first:
            body["features"] = first["features"]
        elif first.get("multi_modal_data") is not None:
            with contextlib.suppress(TypeError):  # unserialisable data: leave features out
                body["features"] = json.dumps(first["multi_modal_data"])
        if "cache_salt" in first:
            body["cache_salt"] = first["cache_salt"]
        return body
    raise ValueError(f"chat/render: unexpected JSON shape {type(render_data).__name__}")
