"""Internal: a group's members (the copies :meth:`~fsm_rollout.runtime.runner.RolloutRunner.run_group` runs for one
prompt, with their ids) and their seeds, shared by the runner, the CLI and the Ray pool."""

from __future__ import annotations

import copy
import uuid

from fsm_rollout.errors import ConfigError
from fsm_rollout.sample import Sample


def group_members(sample: Sample, n: int) -> tuple[list[Sample], list[str | None]]:
    """The ``n`` copies :meth:`RolloutRunner.run_group` runs for ``sample`` and the ids that name them: one group
    index (the sample's, else its index), a fresh session id each, ``metadata["group_member"]`` their position."""
    group_index = sample.group_index if sample.group_index is not None else sample.index
    copies: list[Sample] = []
    for member in range(positive_count(n)):
        duplicate = copy.deepcopy(sample)
        duplicate.group_index = group_index
        duplicate.session_id = str(uuid.uuid4())
        duplicate.metadata = {**(duplicate.metadata or {}), "group_member": member}
        copies.append(duplicate)
    ids = [f"{sample.index}.{member}" if sample.index is not None else None for member in range(n)]
    return copies, ids


def group_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of a group's ``n`` members: ``seed + m`` for member ``m``, none without ``seed``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    return [] if seed is None else [seed + member for member in range(n)]


def positive_count(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"expected a positive integer, got {value!r}")
    return value
