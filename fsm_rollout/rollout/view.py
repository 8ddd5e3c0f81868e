"""What hooks see of a rollout: a read-only view (:class:`fsm_rollout.hooks.RolloutView`)."""

from __future__ import annotations

from typing import Any

from fsm_rollout.rollout.context import RolloutContext
from fsm_rollout.sample import Sample
from fsm_rollout.types import GeneratedTurn


class View:
    """A rollout's state, reason, turn, suspensions, sample and ids, read-only.

    A view stands for its rollout: it is equal to it and hashes like it, so an observer may keep rollouts in a set
    and remove one by the view its hook was given.
    """

    __slots__ = ("_ctx", "_owner", "_uid")

    def __init__(self, ctx: RolloutContext, *, rollout_uid: str, owner: object) -> None:
        self._ctx = ctx
        self._uid = rollout_uid
        self._owner = owner

    @property
    def state(self) -> str:
        return self._ctx.state

    @property
    def reason(self) -> str | None:
        return self._ctx.reason

    @property
    def turn_index(self) -> int:
        return self._ctx.turn_index

    @property
    def turn(self) -> GeneratedTurn | None:
        return self._ctx.turn

    @property
    def prompt_length(self) -> int | None:
        return self._ctx.prompt_length

    @property
    def suspensions(self) -> int:
        return self._ctx.suspensions

    @property
    def sample(self) -> Sample:
        return self._ctx.sample

    @property
    def sample_id(self) -> str:
        return self._ctx.sample_id

    @property
    def rollout_uid(self) -> str:
        return self._uid

    @property
    def request_prefix(self) -> str:
        return self._ctx.request_prefix

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, View):
            return other._owner is self._owner
        return other is self._owner

    def __hash__(self) -> int:
        return hash(self._owner)

    def __repr__(self) -> str:
        return f"<rollout {self._ctx.sample_id} in {self._ctx.state}>"


__all__ = ["View"]
