"""Several training sequences from one rollout: ``sample.branches`` and :func:`training_sequences`.

A rollout whose history was rewritten (the ``fork`` and ``per_turn`` history policies) ends with more than one
token sequence. The sample the rollout returns is its *last* sequence; the earlier ones are complete
:class:`~fsm_rollout.sample.Sample` objects in ``sample.branches``, oldest first. Each holds its own ``tokens``,
``loss_mask``, ``rollout_log_probs``, top-p spans, routed experts, ``weight_version_spans`` and multimodal train
inputs, and shares the rollout's ``index``, ``group_index``, ``session_id``, ``reward`` and ``status``
(:func:`share_outcome` keeps these in step); ``metadata["branch"]`` is its position. Every generated token is
trainable (loss mask 1) in exactly one of a rollout's sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fsm_rollout.sample.record import Sample

SEQUENCE_METADATA_KEYS: tuple[str, ...] = ("weight_version_spans", "observations", "routed_expert_spans")
"""``sample.metadata`` keys that describe one sequence's tokens: a closed branch takes them with it."""

_SHARED = ("index", "group_index", "session_id", "reward", "status", "rollout_id")
"""What a rollout's sequences share: the rollout's identity and outcome."""

_LEFT_BEHIND = ("resume_state",)
"""Metadata of the rollout's run, not of a closed sequence."""


def split_branch(sample: Sample, *, response: str, train_inputs: dict[str, Any] | None) -> Sample:
    """Close ``sample``'s current sequence: return it as a new branch (appended to ``sample.branches``) and leave
    ``sample`` with an empty sequence, ready for its next prompt (``tokens`` empty, no response side).

    ``response`` is the branch's generated text and ``train_inputs`` its multimodal train inputs.
    """
    position = len(sample.branches)
    metadata = {key: value for key, value in sample.metadata.items() if key not in _LEFT_BEHIND}
    metadata["branch"] = position
    branch = Sample(
        group_index=sample.group_index,
        index=sample.index,
        rollout_id=sample.rollout_id,
        prompt=sample.prompt,
        tokens=sample.tokens,
        multimodal_inputs=sample.multimodal_inputs,
        multimodal_train_inputs=train_inputs,
        apply_chat_template_kwargs=dict(sample.apply_chat_template_kwargs),
        response=response,
        response_length=sample.response_length,
        label=sample.label,
        reward=sample.reward,
        loss_mask=sample.loss_mask,
        weight_versions=sample.weight_versions,
        rollout_log_probs=sample.rollout_log_probs,
        rollout_top_p_token_ids=sample.rollout_top_p_token_ids,
        rollout_top_p_token_offsets=sample.rollout_top_p_token_offsets,
        rollout_top_p_log_probs=sample.rollout_top_p_log_probs,
        rollout_routed_experts=sample.rollout_routed_experts,
        status=sample.status,
        metadata=metadata,
        generate_function_path=sample.generate_function_path,
        custom_rm_path=sample.custom_rm_path,
        train_metadata=sample.train_metadata,
        session_id=sample.session_id,
    )
    sample.branches.append(branch)
    sample.tokens = []
    sample.loss_mask = []
    sample.rollout_log_probs = []
    sample.response_length = 0
    sample.weight_versions = []
    sample.rollout_top_p_token_ids = None
    sample.rollout_top_p_token_offsets = None
    sample.rollout_top_p_log_probs = None
    sample.rollout_routed_experts = None
    sample.multimodal_train_inputs = None
    for key in SEQUENCE_METADATA_KEYS:
        sample.metadata.pop(key, None)
    return branch


def share_outcome(sample: Sample) -> None:
    """Give ``sample``'s branches the rollout's identity and outcome (index, group, session, reward, status) and
    number them; the last sequence is numbered after them when there are branches."""
    for position, branch in enumerate(sample.branches):
        for name in _SHARED:
            setattr(branch, name, getattr(sample, name))
        branch.metadata["branch"] = position
    if sample.branches:
        sample.metadata["branch"] = len(sample.branches)


def training_sequences(samples: Iterable[Sample]) -> list[Sample]:
    """A batch of rollouts' samples as training sequences: ``[*sample.branches, sample]`` for each, in order.

    Each branch first receives its rollout's reward and status (:func:`share_outcome`), so a reward set on the
    sample after the rollout (a trainer's reward model) reaches every sequence of it.
    """
    out: list[Sample] = []
    for number, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise TypeError(
                f"training_sequences takes the rollouts' Sample objects; item {number} is {type(sample).__name__}"
            )
        share_outcome(sample)
        out.extend(sample.branches)
        out.append(sample)
    return out


__all__ = ["SEQUENCE_METADATA_KEYS", "share_outcome", "split_branch", "training_sequences"]
