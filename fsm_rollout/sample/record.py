"""The slime/vime-compatible ``Sample``: its fields, the append that grows its response side, its invariant
checks and its ``to_dict``/``from_dict``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from fsm_rollout.errors import InvariantViolation, SampleAppendError
from fsm_rollout.sample.append_inputs import (
    FloatsLike,
    IntsLike,
    describe,
    float_list,
    int_list,
    routed_experts_array,
    top_p_spans,
)
from fsm_rollout.sample.serialise import decode, encode
from fsm_rollout.sample.status import STATUS_BY_FINISH, PrefixCacheInfo, SpecInfo, Status
from fsm_rollout.types import Logprobs, TokenIds, TurnMeta

# Inside ``Sample`` the name ``Status`` is the class attribute ``Sample.Status``; fields use this alias.
_Status = Status


@dataclass(eq=False)
class Sample:
    """One prompt and everything a rollout produced for it, in the shape slime/vime trainers consume.

    The response side grows only through ``append_response_tokens``. After each append ``loss_mask`` and
    ``rollout_log_probs`` hold one entry per response token (``response_length`` of them), and the top-p
    spans, when present, hold ``response_length + 1`` offsets. ``tokens`` is the whole context (prompt plus
    response side); ``response`` is the text the rollout decoded, which the append does not touch.

    Attributes set on an instance beyond these fields survive ``to_dict``/``from_dict``, as in vime.
    """

    Status: ClassVar[type[_Status]] = _Status
    """``Sample.Status`` is the module's ``Status``, as in vime (``Sample.Status.COMPLETED``)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None

    prompt: str | list[dict[str, Any]] = ""
    tokens: TokenIds = field(default_factory=list)
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
    rollout_log_probs: Logprobs | None = None

    rollout_topk_token_ids: Any = None
    rollout_topk_log_probs: Any = None
    rollout_top_p_token_ids: TokenIds | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_top_p_log_probs: Any = None
    rollout_routed_experts: npt.NDArray[np.int32] | None = None

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
    branches: list[Sample] = field(default_factory=list)
    """The rollout's earlier training sequences, oldest first, when its history was rewritten (a fork): complete
    samples of their own (:mod:`fsm_rollout.sample.branches`). Empty for a rollout of one sequence."""

    def append_response_tokens(
        self,
        tokens: IntsLike,
        log_probs: FloatsLike | None = None,
        *,
        trainable: bool = True,
        meta: TurnMeta | None = None,
        expert_dims: tuple[int, int] | None = None,
        track_spec_stats: bool = False,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response-side tokens: generated (``trainable``) or injected (EOS, observation tokens).

        Trainable tokens need one logprob each and get loss mask 1. Non-trainable tokens take no logprobs and
        get logprob 0.0 and loss mask 0; when top-p spans exist they get empty spans.

        ``meta`` is the turn's engine bookkeeping. Its top-p spans are merged onto the existing ones. Its
        ``routed_experts`` replace ``rollout_routed_experts``, shaped ``(len(tokens) - 1, num_layers, topk)``
        after the append, with ``(num_layers, topk) = expert_dims``; without ``expert_dims`` the routing shape
        is unknown and the routing is ignored. With ``update_terminal_info`` the meta also sets the status
        from the finish reason, records the weight version (when tokens were added), adds prefix-cache
        statistics and, with ``track_spec_stats``, speculative-decoding statistics.

        Raises ``SampleAppendError`` for tokens, logprobs or top-p spans that break these rules,
        ``RoutingReplayError`` for routed experts of the wrong type or size, and ``InvariantViolation`` when
        the sample's arrays did not line up before the append. Nothing is changed when an error is raised.
        """
        new_tokens = int_list(tokens, "tokens", self)
        new_log_probs = None if log_probs is None else float_list(log_probs, "log_probs", self)
        self._check_append_arguments(new_tokens, new_log_probs, trainable)
        self._validate_response_metadata_lengths()

        top_p_extension = self._top_p_extension(meta, len(new_tokens), trainable)
        routed_experts = None
        if meta is not None:
            rows = max(len(self.tokens) + len(new_tokens) - 1, 0)
            routed_experts = routed_experts_array(meta.routed_experts, expert_dims, rows, self)

        # Everything is validated; from here on the append cannot fail half-way.
        existing = self.response_length
        if self.loss_mask is None:
            self.loss_mask = [1] * existing
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * existing
        self.tokens.extend(new_tokens)
        self.response_length += len(new_tokens)
        self.loss_mask.extend([1 if trainable else 0] * len(new_tokens))
        self.rollout_log_probs.extend(new_log_probs if new_log_probs is not None else [0.0] * len(new_tokens))
        if top_p_extension is not None:
            if self.rollout_top_p_token_ids is None or self.rollout_top_p_token_offsets is None:
                # Earlier response tokens had no spans: give each an empty one.
                self.rollout_top_p_token_ids = []
                self.rollout_top_p_token_offsets = [0] * (existing + 1)
            ids, offsets = top_p_extension
            self.rollout_top_p_token_ids.extend(ids)
            self.rollout_top_p_token_offsets.extend(offsets)
        if routed_experts is not None:
            self.rollout_routed_experts = routed_experts
        if update_terminal_info and meta is not None:
            self._apply_terminal_info(meta, len(new_tokens), track_spec_stats)

        self._validate_response_metadata_lengths()

    def check_invariants(self, prompt_length: int | None = None) -> None:
        """Raise ``InvariantViolation`` unless the response-side arrays line up.

        Checks ``response_length == len(loss_mask) == len(rollout_log_probs)`` (None counts as empty only
        while there is no response), that the loss mask holds only 0s and 1s, that top-p offsets cover every
        response token, that ``metadata["weight_version_spans"]`` (when present) covers exactly the positions with
        loss mask 1, and, given ``prompt_length``, that ``len(tokens) - prompt_length == response_length``.
        """
        length = self.response_length
        mask_length = None if self.loss_mask is None else len(self.loss_mask)
        log_prob_length = None if self.rollout_log_probs is None else len(self.rollout_log_probs)
        if length != 0 and (mask_length is None or log_prob_length is None):
            raise InvariantViolation(
                f"{self._describe()}: expected loss_mask and rollout_log_probs with response_length={length} "
                f"entries each; got loss_mask={self._length_text(self.loss_mask)}, "
                f"rollout_log_probs={self._length_text(self.rollout_log_probs)}"
            )
        if not (length == (mask_length or 0) == (log_prob_length or 0)):
            raise InvariantViolation(
                f"{self._describe()}: expected response_length == len(loss_mask) == len(rollout_log_probs); "
                f"got {length}, {mask_length}, {log_prob_length}"
            )
        bad_mask_values = sorted({repr(v) for v in self.loss_mask or [] if v not in (0, 1)})
        if bad_mask_values:
            raise InvariantViolation(
                f"{self._describe()}: loss_mask must hold only 0 and 1; got {', '.join(bad_mask_values)}"
            )
        self._validate_top_p_spans()
        self._validate_weight_version_spans()
        if prompt_length is not None and len(self.tokens) - prompt_length != length:
            raise InvariantViolation(
                f"{self._describe()}: expected len(tokens) - prompt_length == response_length; got "
                f"{len(self.tokens)} - {prompt_length} = {len(self.tokens) - prompt_length}, not {length}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The sample as JSON-compatible data, including attributes set beyond the dataclass fields.

        The status becomes its value and the statistics plain dicts. Numpy arrays become
        ``{"__ndarray__": True, "dtype", "shape", "data"}`` and tensors
        ``{"__tensor__": True, "dtype", "shape", "data"}``, with ``data`` flattened; tuples become lists.
        ``branches`` become a list of their own ``to_dict`` output.
        """
        data = {name: encode(value) for name, value in vars(self).items() if name != "branches"}
        data["branches"] = [branch.to_dict() for branch in self.branches]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        """Rebuild a sample from ``to_dict`` output (possibly after a JSON round trip).

        Keys that are not dataclass fields are set as attributes. Tensors are restored with torch, which is
        imported only when the data holds one.
        """
        field_names = {f.name for f in fields(cls)}
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, raw in data.items():
            if key == "branches":  # samples of their own, each written by its to_dict
                known[key] = [branch if isinstance(branch, Sample) else cls.from_dict(branch) for branch in raw or ()]
                continue
            (known if key in field_names else extra)[key] = decode(raw)
        if "status" in known:
            known["status"] = Status(known["status"])
        if isinstance(known.get("spec_info"), Mapping):
            known["spec_info"] = SpecInfo(**known["spec_info"])
        if isinstance(known.get("prefix_cache_info"), Mapping):
            known["prefix_cache_info"] = PrefixCacheInfo(**known["prefix_cache_info"])
        sample = cls(**known)
        for key, value in extra.items():
            setattr(sample, key, value)
        return sample

    @staticmethod
    def _length_text(values: Sequence[Any] | None) -> str:
        return "None" if values is None else f"{len(values)} entries"

    def _describe(self) -> str:
        return describe(self)

    def _check_append_arguments(self, new_tokens: TokenIds, new_log_probs: Logprobs | None, trainable: bool) -> None:
        count = len(new_tokens)
        if new_log_probs is not None and len(new_log_probs) != count:
            raise SampleAppendError(
                f"{self._describe()}: expected one logprob per token; got {count} tokens "
                f"and {len(new_log_probs)} log_probs"
            )
        if trainable and new_log_probs is None:
            raise SampleAppendError(
                f"{self._describe()}: trainable tokens need log_probs; got {count} tokens and log_probs=None"
            )
        if not trainable and new_log_probs is not None:
            raise SampleAppendError(
                f"{self._describe()}: non-trainable tokens take no log_probs (they get 0.0); "
                f"got {len(new_log_probs)} log_probs"
            )
        if trainable and self.rollout_log_probs is None and self.response_length > 0:
            raise SampleAppendError(
                f"{self._describe()}: cannot append trainable tokens after {self.response_length} "
                "response tokens that have no rollout_log_probs; expected rollout_log_probs to be a list"
            )

    def _top_p_extension(
        self, meta: TurnMeta | None, new_count: int, trainable: bool
    ) -> tuple[TokenIds, list[int]] | None:
        """Ids and offsets (already shifted) to append to the top-p spans; None when they stay as they are.

        New spans come from the meta. Without them, non-trainable tokens get empty spans when spans exist;
        trainable tokens cannot go without spans once the sample has them.
        """
        spans = top_p_spans(meta, new_count, self) if meta is not None else None
        if spans is not None:
            ids, offsets = spans
            shift = len(self.rollout_top_p_token_ids or [])
            return ids, [offset + shift for offset in offsets[1:]]
        if self.rollout_top_p_token_offsets is None or new_count == 0:
            return None
        if trainable:
            raise SampleAppendError(
                f"{self._describe()}: the sample has top-p spans, so {new_count} trainable tokens need "
                "top_p_token_ids and top_p_token_offsets in their meta; got none"
            )
        last = self.rollout_top_p_token_offsets[-1]
        return [], [last] * new_count

    def _apply_terminal_info(self, meta: TurnMeta, new_count: int, track_spec_stats: bool) -> None:
        spec_counts = (meta.spec_accept_token_num, meta.spec_draft_token_num, meta.spec_verify_ct)
        if track_spec_stats and any(count is not None for count in spec_counts):
            self.spec_info.add(
                meta.spec_accept_token_num or 0,
                meta.spec_draft_token_num or 0,
                meta.spec_verify_ct or 0,
                meta.completion_tokens if meta.completion_tokens is not None else new_count,
            )
        if meta.prompt_tokens is not None:
            self.prefix_cache_info.add(meta.cached_tokens or 0, meta.prompt_tokens)
        if new_count > 0 and meta.weight_version is not None:
            self.weight_versions.append(meta.weight_version)
        # A finish reason outside the Finish literal (only possible by ignoring the types) keeps the status.
        status = STATUS_BY_FINISH.get(meta.finish_reason)
        if status is not None:
            self.status = status

    def _validate_weight_version_spans(self) -> None:
        """``metadata["weight_version_spans"]``, when present, covers exactly the generated (mask 1) positions."""
        spans = self.metadata.get("weight_version_spans") if isinstance(self.metadata, dict) else None
        if spans is None:
            return
        covered = [position for span in spans for position in range(span["start"], span["end"])]
        generated = [position for position, mask in enumerate(self.loss_mask or []) if mask == 1]
        if covered != generated:
            raise InvariantViolation(
                f"{self._describe()}: weight_version_spans must cover each generated position once, in order; they "
                f"cover {len(covered)} positions for {len(generated)} generated ones"
            )

    def _validate_response_metadata_lengths(self) -> None:
        length = self.response_length
        for name, values in (("loss_mask", self.loss_mask), ("rollout_log_probs", self.rollout_log_probs)):
            if values is not None and len(values) != length:
                raise InvariantViolation(
                    f"{self._describe()}: expected {name} to have response_length={length} entries; got {len(values)}"
                )
        self._validate_top_p_spans()

    def _validate_top_p_spans(self) -> None:
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if (ids is None) != (offsets is None):
            raise InvariantViolation(
                f"{self._describe()}: rollout_top_p_token_ids and rollout_top_p_token_offsets must both be "
                f"set or both be None; got ids={'None' if ids is None else 'set'}, "
                f"offsets={'None' if offsets is None else 'set'}"
            )
        if ids is None or offsets is None:
            return
        if len(offsets) != self.response_length + 1:
            raise InvariantViolation(
                f"{self._describe()}: expected {self.response_length + 1} top-p offsets "
                f"(response_length + 1); got {len(offsets)}"
            )
        if offsets[-1] != len(ids):
            raise InvariantViolation(
                f"{self._describe()}: expected the last top-p offset to equal the {len(ids)} top-p ids; "
                f"got {offsets[-1]}"
            )
