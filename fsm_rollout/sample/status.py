"""A sample's status, with vime's values, and the engine statistics summed over its turns."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fsm_rollout.types import Finish


class Status(enum.StrEnum):
    """Where a sample stands; the values are vime's, so ``Status("completed")`` and JSON both work."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


STATUS_BY_FINISH: dict[Finish, Status] = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}
"""The status a turn's finish reason gives the sample."""


@dataclass
class PrefixCacheInfo:
    """Prompt tokens the engine served from its prefix cache, summed over a sample's turns."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    def add(self, cached_tokens: int, prompt_tokens: int) -> None:
        """Count one request: ``cached_tokens`` of its ``prompt_tokens`` came from the cache."""
        self.cached_tokens += cached_tokens
        self.total_prompt_tokens += prompt_tokens

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache; 0.0 before any prompt token was counted."""
        if self.total_prompt_tokens == 0:
            return 0.0
        return self.cached_tokens / self.total_prompt_tokens


@dataclass
class SpecInfo:
    """Speculative-decoding counters summed over a sample's turns."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    def add(self, accept_tokens: int, draft_tokens: int, verify_count: int, completion_tokens: int) -> None:
        """Count one request's accepted and drafted tokens, verification steps and generated tokens."""
        self.spec_accept_token_num += accept_tokens
        self.spec_draft_token_num += draft_tokens
        self.spec_verify_ct += verify_count
        self.completion_token_num += completion_tokens

    @property
    def accept_rate(self) -> float:
        """Share of drafted tokens the target model accepted; 0.0 when nothing was drafted."""
        if self.spec_draft_token_num == 0:
            return 0.0
        return self.spec_accept_token_num / self.spec_draft_token_num

    @property
    def accept_length(self) -> float:
        """Generated tokens per verification step; 0.0 when no step was counted."""
        if self.spec_verify_ct == 0:
            return 0.0
        return self.completion_token_num / self.spec_verify_ct
