"""A sample whose rollout could not be built: it leaves ``pending`` by the table's ``fail`` edge, traced.

The runner makes a :class:`~fsm_rollout.rollout.Rollout` when a sample gets its slot; when that raises (a sample
that cannot start, a sampling parameter the config refuses, a template the history policy cannot follow), there is
no rollout to fail. :class:`UnbuiltRollout` is the least context the ``fail`` edge needs: the sample and the error.
Firing it runs the edge's actions as for any failure (the error recorded, the data so far kept, the environment,
were one made, closed once) and gives the tracer and the hooks (metrics, recorder) the one transition
``pending --fail--> failed``, so traces, tapes, replay and ``inspect`` see the sample like any other that failed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from structlog.contextvars import bind_contextvars, reset_contextvars

from fsm_rollout.config import RolloutConfig
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout import steps
from fsm_rollout.rollout.context import Deps, RolloutContext
from fsm_rollout.rollout.events import event_fields
from fsm_rollout.rollout.gating import GatePoint
from fsm_rollout.rollout.setup import default_request_prefix, default_sample_id
from fsm_rollout.rollout.view import View
from fsm_rollout.sample import Sample
from fsm_rollout.trace import NULL_TRACER, Tracer


class UnbuiltRollout:
    """A pending sample and the error that kept its rollout from being built; :meth:`fail` ends it ``failed``.

    It has what a recorder's ``begin`` and a replay's outcome comparison read of a rollout (``sample``,
    ``tokenizer``, ``processor``, ``state``, ``reason``, ``prompt_length``, ``turn_index``).
    """

    processor: Any = None

    def __init__(
        self,
        sample: Sample,
        error: BaseException,
        *,
        config: RolloutConfig,
        tokenizer: Any = None,
        tracer: Tracer | None = None,
        hooks: RolloutHooks | None = None,
        sample_id: str | None = None,
        request_prefix: str | None = None,
        env: Any = None,
    ) -> None:
        self.sample = sample
        self.tokenizer = tokenizer
        self.tracer = tracer if tracer is not None else NULL_TRACER
        self._hooks = hooks
        self.rollout_uid = uuid.uuid4().hex[:16]
        deps = Deps(config=config, params={}, encoder=None, tokenizer=tokenizer, processor=None, gate=GatePoint(None))
        self.ctx = RolloutContext(
            sample=sample,
            deps=deps,
            env=env,
            sample_id=sample_id if sample_id is not None else default_sample_id(sample),
            request_prefix=request_prefix if request_prefix is not None else default_request_prefix(sample),
            error=error,
            failed_state=lifecycle.INITIAL,
        )

    state = property(lambda self: self.ctx.state)
    reason = property(lambda self: self.ctx.reason)
    error = property(lambda self: self.ctx.error)
    prompt_length = property(lambda self: self.ctx.prompt_length)
    turn_index = property(lambda self: self.ctx.turn_index)

    def fail(self) -> Sample:
        """Fire ``fail`` from ``pending`` (once), trace it and tell the hooks; returns the sample."""
        ctx = self.ctx
        if ctx.state != lifecycle.INITIAL:
            return self.sample
        sample = self.sample  # metadata that is no dict (a buggy data loader's) is what the error is about
        sample.metadata = dict(sample.metadata) if isinstance(sample.metadata, Mapping) else {}
        context = bind_contextvars(
            sample_id=ctx.sample_id, session_id=self.sample.session_id, rollout_uid=self.rollout_uid
        )
        try:
            steps.MACHINE.events["fail"].trigger(ctx, ctx)
            wants_events = self._hooks is not None and self._hooks.wants_events
            fields = None
            if self.tracer.enabled or wants_events:
                fields = event_fields(ctx, "fail", lifecycle.INITIAL, 0.0, suspended_since=None, now=0.0)
            if fields is not None and self.tracer.enabled:
                self.tracer.emit(dict(fields) if wants_events else fields)
            if self._hooks is not None:
                self._hooks.transition(
                    View(ctx, rollout_uid=self.rollout_uid, owner=self), "fail", "pending", 0.0, fields
                )
        finally:
            reset_contextvars(**context)
        self.tracer.flush()
        return self.sample


__all__ = ["UnbuiltRollout"]
