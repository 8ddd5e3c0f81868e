"""The training sample a rollout fills in: a slime/vime-compatible ``Sample``, its ``Status`` and statistics.

``Sample`` keeps the field names and defaults of ``vime.utils.types.Sample`` so a trainer written against
vime can consume it unchanged. ``Sample.append_response_tokens`` is the only way the rollout grows the
response side: it keeps ``tokens``, ``loss_mask``, ``rollout_log_probs``, the top-p replay spans and the
routed experts in step, and applies one turn's ``TurnMeta`` (status, weight version, cache and
speculative-decoding statistics).
An append either succeeds completely or raises before changing the sample.

Importing this module needs numpy only; torch is imported lazily, and only to restore serialised tensors.

The parts: :mod:`~fsm_rollout.sample.record` (``Sample``), :mod:`~fsm_rollout.sample.status` (``Status`` and the
statistics), :mod:`~fsm_rollout.sample.append_inputs` (what an append receives, checked) and
:mod:`~fsm_rollout.sample.serialise` (``to_dict``/``from_dict`` values), :mod:`~fsm_rollout.sample.branches` (a
rollout's several training sequences). Their public names are importable from
here.

Its modules are internal: import from this package (or :mod:`fsm_rollout`).
"""

from fsm_rollout.sample.append_inputs import FloatsLike, IntsLike
from fsm_rollout.sample.branches import training_sequences
from fsm_rollout.sample.record import Sample
from fsm_rollout.sample.status import PrefixCacheInfo, SpecInfo, Status

__all__ = ["FloatsLike", "IntsLike", "PrefixCacheInfo", "Sample", "SpecInfo", "Status", "training_sequences"]
