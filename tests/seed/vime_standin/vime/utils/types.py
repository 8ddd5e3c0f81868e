"""Stand-in for ``vime.utils.types``: the ``Sample`` record and its append rules (seed contract section 11).

Only what the seed rollout exercises is implemented with care; score centering is refused outright
(``NotImplementedError``) because the seed never enables it and the stand-in should not guess at it.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _as_list(values: Any) -> list[Any]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


def decode_int32_meta_array(value: Any) -> np.ndarray:
    """Decode a replay array from base64 text, raw bytes, a tensor, a numpy array or a list into int32."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype=np.int32).copy()
    if isinstance(value, bytes | bytearray):
        return np.frombuffer(bytes(value), dtype=np.int32).copy()
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value).astype(np.int32)


@dataclass
class SpecInfo:
    """Speculative-decoding counters, summed over turns."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num") or 0)
        self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num") or 0)
        self.spec_verify_ct += int(meta_info.get("spec_verify_ct") or 0)
        self.completion_token_num += int(meta_info.get("completion_tokens") or 0)

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0


@dataclass
class PrefixCacheInfo:
    """Prefix-cache counters, summed over turns."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        self.cached_tokens += int(meta_info.get("cached_tokens") or 0)
        self.total_prompt_tokens += int(meta_info.get("prompt_tokens") or 0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0


class _Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_STATUS_BY_FINISH = {
    "length": _Status.TRUNCATED,
    "abort": _Status.ABORTED,
    "stop": _Status.COMPLETED,
}


@dataclass
class Sample:
    """One rollout sample, with vime's field names and defaults."""

    Status = _Status

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None

    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: Any = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None

    rollout_topk_token_ids: Any = None
    rollout_topk_log_probs: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_top_p_log_probs: Any = None
    rollout_routed_experts: Any = None

    remove_sample: bool = False
    teacher_log_probs: Any = None
    status: _Status = _Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response-side tokens with their mask and logprobs, then apply the turn's metadata."""
        new_tokens = [int(token) for token in _as_list(tokens)] if tokens is not None else []
        new_log_probs = [float(value) for value in _as_list(log_probs)] if log_probs is not None else None
        count = len(new_tokens)
        if new_log_probs is not None and len(new_log_probs) != count:
            raise ValueError(f"log_probs length {len(new_log_probs)} does not match token count {count}")
        if trainable and new_log_probs is None:
            raise ValueError("trainable tokens need log_probs")
        if not trainable:
            if new_log_probs is not None:
                raise ValueError("non-trainable tokens must not carry log_probs")
            new_log_probs = [0.0] * count
        if args is not None and getattr(args, "use_score_centering", False):
            raise NotImplementedError("the vime stand-in does not implement score centering")

        if text is not None:
            self.response += text

        previous = self.response_length
        if self.loss_mask is None:
            self.loss_mask = [1] * previous
        if self.rollout_log_probs is None:
            if trainable and count and previous:
                raise ValueError("cannot append trainable log_probs after tokens that have none")
            self.rollout_log_probs = [0.0] * previous

        self.tokens = [*self.tokens, *new_tokens]
        self.response_length += count
        self.loss_mask = [*self.loss_mask, *([1 if trainable else 0] * count)]
        self.rollout_log_probs = [*self.rollout_log_probs, *new_log_probs]

        if meta_info is not None or not trainable:
            self._apply_meta_info(
                args,
                dict(meta_info or {}),
                new_token_count=count,
                trainable=trainable,
                update_terminal_info=update_terminal_info,
            )
        self._validate_response_metadata_lengths()

    def _apply_meta_info(
        self,
        args: Any,
        meta_info: dict[str, Any],
        *,
        new_token_count: int,
        trainable: bool,
        update_terminal_info: bool,
    ) -> None:
        self._apply_top_p(meta_info, new_token_count, trainable)
        self._apply_routed_experts(args, meta_info)

        finish_reason = meta_info.get("finish_reason")
        if not update_terminal_info or finish_reason is None:
            return
        if args is not None and getattr(args, "vllm_speculative_config", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if new_token_count > 0 and meta_info.get("weight_version") is not None:
            self.weight_versions.append(meta_info["weight_version"])
        finish_type = finish_reason.get("type") if isinstance(finish_reason, dict) else finish_reason
        status = _STATUS_BY_FINISH.get(finish_type)
        if status is not None:
            self.status = status

    def _apply_top_p(self, meta_info: dict[str, Any], count: int, trainable: bool) -> None:
        raw_ids = meta_info.get("top_p_token_ids", meta_info.get("top_p_kept_token_ids"))
        raw_offsets = meta_info.get("top_p_token_offsets", meta_info.get("top_p_kept_token_offsets"))
        if (raw_ids is None) != (raw_offsets is None):
            raise ValueError("top-p token ids and offsets must be given together")
        if raw_ids is None:
            if not trainable and count and self.rollout_top_p_token_offsets is not None:
                last = self.rollout_top_p_token_offsets[-1]
                self.rollout_top_p_token_offsets = [*self.rollout_top_p_token_offsets, *([last] * count)]
            return

        ids = [int(value) for value in decode_int32_meta_array(raw_ids).reshape(-1)]
        offsets = [int(value) for value in decode_int32_meta_array(raw_offsets).reshape(-1)]
        if not offsets or offsets[0] != 0 or offsets[-1] != len(ids) or len(offsets) != count + 1:
            raise ValueError(
                f"top-p offsets must start at 0, end at {len(ids)} and hold {count + 1} entries, got {offsets}"
            )
        if self.rollout_top_p_token_offsets is None:
            # Tokens appended before the first top-p data get empty spans.
            self.rollout_top_p_token_ids = []
            self.rollout_top_p_token_offsets = [0] * (self.response_length - count + 1)
        base = self.rollout_top_p_token_offsets[-1]
        self.rollout_top_p_token_ids = [*self.rollout_top_p_token_ids, *ids]
        self.rollout_top_p_token_offsets = [*self.rollout_top_p_token_offsets, *(base + o for o in offsets[1:])]

    def _apply_routed_experts(self, args: Any, meta_info: dict[str, Any]) -> None:
        raw = meta_info.get("routed_experts")
        if raw is None:
            return
        if args is None:
            raise ValueError("routed_experts need args (num_layers, moe_router_topk)")
        start = int(meta_info.get("routed_experts_start_len") or 0)
        if start < 0:
            raise ValueError(f"routed_experts_start_len must be >= 0, got {start}")
        experts = decode_int32_meta_array(raw)
        layers, topk = int(args.num_layers), int(args.moe_router_topk)
        rows = len(self.tokens) - 1 - start
        if experts.size != rows * layers * topk:
            raise ValueError(
                f"routed_experts element count {experts.size} != rows {rows} x layers {layers} x topk {topk}"
            )
        block = experts.reshape(rows, layers, topk)
        if start == 0 or self.rollout_routed_experts is None:
            self.rollout_routed_experts = block
        else:
            self.rollout_routed_experts = np.concatenate([np.asarray(self.rollout_routed_experts)[:start], block])

    def _validate_response_metadata_lengths(self) -> None:
        expected = self.response_length
        for name in ("loss_mask", "rollout_log_probs", "rollout_topk_token_ids", "rollout_topk_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != expected:
                raise ValueError(f"{name} has {len(value)} entries, expected response_length={expected}")
        offsets = self.rollout_top_p_token_offsets
        if offsets is not None:
            id_count = len(self.rollout_top_p_token_ids or [])
            if len(offsets) != expected + 1 or offsets[-1] != id_count:
                raise ValueError(
                    f"top-p offsets have {len(offsets)} entries ending at {offsets[-1]}; "
                    f"expected {expected + 1} entries ending at {id_count}"
                )
            log_probs = self.rollout_top_p_log_probs
            if log_probs is not None and len(log_probs) != id_count:
                raise ValueError(f"top-p log_probs have {len(log_probs)} entries for {id_count} ids")
