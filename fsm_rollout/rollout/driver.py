"""The driver of one sample's rollout: run the state's activity, fire its trigger, trace the transition.

The lifecycle table (:mod:`fsm_rollout.machine.lifecycle`) decides every branch; guards and actions are functions of the
context (:mod:`~fsm_rollout.rollout.steps`), the I/O is in :mod:`~fsm_rollout.rollout.activities`, every await
goes through one :mod:`~fsm_rollout.rollout.cancel` scope, and the weight-update gate is met around the generate
request (:mod:`~fsm_rollout.rollout.gating`). What is left here: starting and ending, stops (abort, timeouts,
cancellation), awaiting what a state awaits on the way in (scoring), and the trace of each transition.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from structlog.contextvars import bind_contextvars, reset_contextvars

from fsm_rollout.config import RolloutConfig, build_inference_sampling_params
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.envs.protocol import EnvFactory
from fsm_rollout.errors import ConfigError, RolloutError
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout import steps
from fsm_rollout.rollout.activities import ACTIVITIES, Activities
from fsm_rollout.rollout.cancel import CancelScope, Stopped, TimedOut
from fsm_rollout.rollout.clock import RolloutClock
from fsm_rollout.rollout.context import Deps, RolloutContext
from fsm_rollout.rollout.events import event_fields
from fsm_rollout.rollout.gating import GatePoint
from fsm_rollout.rollout.setup import (
    check_startable,
    default_request_prefix,
    default_sample_id,
    observation_encoder_for,
    restore,
)
from fsm_rollout.rollout.view import View
from fsm_rollout.runtime import gc_policy
from fsm_rollout.runtime.admission import AdmissionPoint
from fsm_rollout.runtime.pacing import pacer_for
from fsm_rollout.sample import Sample
from fsm_rollout.tokens.chat import ObservationEncoder
from fsm_rollout.trace import NULL_TRACER, Tracer, get_tracer
from fsm_rollout.types import TokenIds
from fsm_rollout.weights.resume_state import RESUME_STATE_KEY
from fsm_rollout.weights.suspension import SuspensionGate

_STOPPING_TRIGGERS = frozenset({"abort", "env_timeout", "rollout_timeout"})


def _context_field(name: str, doc: str = "") -> Any:
    """A driver attribute that is the context's field ``name`` (read and written there)."""
    return property(
        lambda self: getattr(self.ctx, name),
        lambda self, value: setattr(self.ctx, name, value),
        doc=doc or f"The context's ``{name}``.",
    )


class Rollout:
    """Drives one sample through the lifecycle against one engine client.

    Create it, then ``await rollout.run()``; the sample is mutated in place and returned. ``await
    rollout.abort(reason)`` (from another task) ends it ``aborted`` with that reason: the request in flight is
    cancelled and named to the server's abort endpoint, and no further request is sent. Errors end it ``failed``
    (data so far kept, environment closed once) and are then raised to the caller of :meth:`run`.

    The rollout knows nothing of recording or replay: those plug in as the client's transport, the environment
    factory and ``hooks`` (:mod:`fsm_rollout.recording`, :mod:`fsm_rollout.replay`).

    ``admission`` is the rollout's side of adaptive admission (:mod:`fsm_rollout.runtime.admission`): each edge into
    ``generating`` waits for a slot at its server, given back when the answer is in.

    ``suspender`` is the gate a weight update closes (:mod:`fsm_rollout.weights.suspension`): the rollout then suspends
    when it is generating or next about to (the request in flight aborted, its tokens kept as the partial turn) and
    continues the same turn when the gate opens, or is handed back (the ``hand_back`` edge). A sample handed back
    (``metadata["resume_state"]``) resumes where it stopped.
    """

    state = _context_field("state", "The lifecycle state.")
    reason = _context_field("reason", "The terminal state's reason.")
    error = _context_field("error", "The error that ended the rollout ``failed``.")
    env = _context_field("env", "The environment, once built.")
    turn_index = _context_field("turn_index")
    turn = _context_field("turn", "The last turn generated.")
    prompt_length = _context_field("prompt_length")
    budget = _context_field("budget")
    rendered = _context_field("rendered")
    suspensions = _context_field("suspensions", "How often this rollout was suspended.")
    partial_turn = _context_field("partial_turn")
    sample_id = _context_field("sample_id", "How traces, tapes and errors name this sample.")
    request_prefix = _context_field("request_prefix", "Generate request ids are ``<request_prefix>-turn<N>``.")

    def __init__(
        self,
        sample: Sample,
        *,
        config: RolloutConfig,
        sampling_params: Mapping[str, Any],
        client: VLLMClient,
        tokenizer: Any,
        env_factory: EnvFactory | None = None,
        env_args: Any = None,
        processor: Any = None,
        tracer: Tracer | None = None,
        encoder: ObservationEncoder | None = None,
        hooks: RolloutHooks | None = None,
        sample_id: str | None = None,
        request_prefix: str | None = None,
        suspender: SuspensionGate | None = None,
        admission: AdmissionPoint | None = None,
    ) -> None:
        check_startable(sample)
        if config.record and (hooks is None or not hooks.records_io):
            raise ConfigError(
                "config.record is set but this rollout is not recorded: build it with RolloutRunner or "
                "fsm_rollout.recording.recorded_rollout, which wire the recorder in"
            )
        self.sample = sample
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.inference_params = build_inference_sampling_params(sampling_params)
        config.check_sampling(self.inference_params)
        self.encoder = encoder or observation_encoder_for(tokenizer)
        self.tracer = tracer if tracer is not None else get_tracer(config.trace) if config.trace else NULL_TRACER
        self._hooks = hooks
        self._wants_events = hooks is not None and hooks.wants_events

        sample.metadata = dict(sample.metadata or {})
        # No template probe here: a rollout refuses a template only where its boundary cannot be cut, at the
        # observation (as the seed does); the runner probes once per tool set and chooses the history policy.
        headers: dict[str, str] | None = None
        if config.router_policy == "consistent_hash":
            sample.session_id = sample.session_id or str(uuid.uuid4())
            headers = {"x-session-id": sample.session_id}
        self.rollout_uid = uuid.uuid4().hex[:16]
        """Unique to this rollout (a sample index may repeat across a trainer's steps): traces and tapes carry it."""
        self._gate = GatePoint(suspender)
        deps = Deps(
            config=config,
            params=self.inference_params,
            encoder=self.encoder,
            tokenizer=tokenizer,
            processor=processor,
            gate=self._gate,
            admission=admission,
        )
        name = sample_id if sample_id is not None else default_sample_id(sample)
        resume_state = sample.metadata.get(RESUME_STATE_KEY)
        if resume_state is not None:  # raises before changing the sample when it cannot resume
            self.ctx = restore(resume_state, sample=sample, deps=deps, sample_id=name)
        else:
            self.ctx = RolloutContext(
                sample=sample,
                deps=deps,
                sample_id=name,
                request_prefix=request_prefix if request_prefix is not None else default_request_prefix(sample),
            )
        self._scope = CancelScope()
        self._io = Activities(
            self.ctx,
            client=client,
            headers=headers,
            scope=self._scope,
            env_factory=env_factory,
            env_args=env_args if env_args is not None else config,
            start_clock=lambda: self._clock.start(),
        )
        self._view = View(self.ctx, rollout_uid=self.rollout_uid, owner=self)
        self._entered_at = time.perf_counter()
        self._running = False
        self._done = asyncio.Event()
        self._start_waiter: asyncio.Future[None] | None = None
        self._gate_waiter: asyncio.Future[None] | None = None
        limit = config.rollout_timeout_s
        self._clock = RolloutClock(limit, lambda: self._time_out("rollout_timeout", "rollout", limit or 0.0))
        self.suspended_since: float | None = None

    # ------------------------------------------------------------------ what callers and tests read

    client = property(lambda self: self._io.client, lambda self, value: setattr(self._io, "client", value))
    headers = property(lambda self: self._io.headers)
    _env_factory = property(
        lambda self: self._io.env_factory, lambda self, value: setattr(self._io, "env_factory", value)
    )

    @property
    def _inflight(self) -> asyncio.Future[Any] | None:
        return self._scope.inflight

    @property
    def remaining_budget(self) -> int | None:
        """Response-side tokens still allowed, or None when unbounded."""
        return self.ctx.remaining_budget

    @property
    def terminal(self) -> bool:
        """Whether the rollout has ended."""
        return self.ctx.state in lifecycle.TERMINAL

    def _stop_string_end(self, token_ids: TokenIds) -> int | None:
        return self._io.stop_string_end(token_ids)

    # ------------------------------------------------------------------ transitions

    def _fire(self, trigger: str) -> None:
        src = self.ctx.state
        self._trigger(trigger)
        self._noted(trigger, src)

    def _trigger(self, trigger: str) -> None:
        if trigger == "abort":
            self.ctx.stop_reason = self._scope.abort_reason or self._scope.timeout or "cancelled"
        steps.MACHINE.events[trigger].trigger(self.ctx, self.ctx)

    async def _take(self, trigger: str) -> None:
        """Fire ``trigger``; an edge whose destination awaits activities on the way in (scoring) has them awaited,
        then completes (:data:`~fsm_rollout.machine.lifecycle.ENTER`)."""
        ctx = self.ctx
        src = ctx.state
        self._trigger(trigger)
        if ctx.entering is not None:
            try:
                for name in lifecycle.STATE_BY_NAME[lifecycle.TRANSITIONS[ctx.entering].dest].awaits:
                    await ACTIVITIES[name](self._io)
            except BaseException:
                ctx.entering = None  # the edge is not taken: the rollout stops or fails from ``src``
                raise
            steps.MACHINE.events[lifecycle.ENTER].trigger(ctx, ctx)
        self._noted(trigger, src)

    def _noted(self, trigger: str, src: str) -> None:
        """Trace the transition ``src --trigger--> state`` and tell the hooks."""
        ctx = self.ctx
        now = time.perf_counter()
        if ctx.state == "suspended" and src != "suspended":
            self._clock.stop()
            self.suspended_since = now
        if self.config.check_invariants and ctx.prompt_length is not None:
            self.sample.check_invariants(ctx.prompt_length)
        dwell_ms = (now - self._entered_at) * 1000.0
        fields = None
        if self.tracer.enabled or self._wants_events:
            fields = event_fields(ctx, trigger, src, dwell_ms, suspended_since=self.suspended_since, now=now)
        if fields is not None and self.tracer.enabled:
            self.tracer.emit(dict(fields) if self._wants_events else fields)  # the sink adds to the dict it is given
        if self._hooks is not None:
            self._hooks.transition(self._view, trigger, src, dwell_ms, fields)
        self._entered_at = now

    def _fail(self, error: BaseException, trigger: str | None) -> None:
        self.ctx.error = error
        self.ctx.failed_state = self.ctx.state
        self.ctx.failed_trigger = trigger
        self._fire("fail")

    def _end_now(self) -> None:
        """End a rollout that is not running: ``abort`` at once, synchronously."""
        try:
            self._fire("abort")
        except Exception as error:
            self._fail(error, "abort")

    async def _send_abort_notice(self) -> None:
        request_id = self._scope.take_cancelled_request()
        if request_id is None:
            return
        try:
            await asyncio.wait_for(
                self._io.client.abort([request_id], headers=self._io.headers), self.config.abort_notice_timeout_s
            )
        except (Exception, asyncio.CancelledError) as error:  # the rollout is ending either way
            self.sample.metadata["abort_notice_error"] = f"{type(error).__name__}: {error}"

    async def _drive(self) -> None:
        cancelled_by_caller = False
        scope = self._scope
        io = self._io
        try:
            while self.ctx.state not in lifecycle.TERMINAL:
                trigger = scope.trigger or lifecycle.STATE_BY_NAME[self.ctx.state].trigger
                assert trigger is not None
                try:
                    if trigger not in _STOPPING_TRIGGERS:
                        for name in lifecycle.STATE_BY_NAME[self.ctx.state].activity:
                            await ACTIVITIES[name](io)
                        # a stop asked for during the activity wins over what its outcome chose
                        trigger = scope.trigger or steps.state_trigger(self.ctx)
                    await self._take(trigger)
                except Stopped:
                    await self._send_abort_notice()
                except TimedOut as timeout:
                    self._time_out("env_timeout", timeout.what, timeout.limit_s)
                except asyncio.CancelledError:
                    cancelled_by_caller = True
                    scope.abort("cancelled")
                    await self._send_abort_notice()
                except Exception as error:
                    self._fail(error, trigger)
                    raise
        finally:
            if self.ctx.state not in lifecycle.TERMINAL:  # cancelled again while ending: end it synchronously
                self._end_now()
        if cancelled_by_caller:
            raise asyncio.CancelledError

    # ------------------------------------------------------------------ time limits (fsm_rollout.rollout.clock)

    def _time_out(self, trigger: str, what: str, limit_s: float) -> None:
        """A limit ran out: end the rollout ``truncated`` by ``trigger`` (the request in flight, if any, is
        cancelled and named to the server)."""
        if self.terminal or self._scope.stopping:
            return
        self.sample.metadata["rollout_timeout"] = {"what": what, "limit_s": limit_s, "state": self.ctx.state}
        self._scope.time_out(trigger)

    # ------------------------------------------------------------------ running and stopping

    async def _wait_before_start(self, waiter: asyncio.Future[None], attribute: str) -> None:
        """Wait on ``waiter`` before anything started; an abort meanwhile ends the rollout at once."""
        setattr(self, attribute, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if not self.terminal:
                self.request_abort("cancelled")
                raise
        finally:
            setattr(self, attribute, None)

    async def run(self) -> Sample:
        """Run the rollout to a terminal state and return the sample (mutated in place).

        Raises the error that ended the rollout ``failed`` (after the sample reached ``failed``), and re-raises
        ``asyncio.CancelledError`` when the calling task was cancelled (after the sample reached ``aborted`` with
        reason ``cancelled``).
        """
        if self._running or self._start_waiter is not None:
            raise RolloutError(f"sample {self.ctx.sample_id}: the rollout is already running")
        if self.terminal:
            return self.sample
        if self.config.loop_slice_ms is not None:
            pacer = self._scope.pacer = pacer_for(asyncio.get_running_loop(), self.config.loop_slice_ms)
            # Starting waits its turn like every other piece of work. A rollout waiting here has not started:
            # an abort ends it at once (nothing built, nothing sent), as before any start.
            waiter = pacer.admit()
            if waiter is not None:
                await self._wait_before_start(waiter, "_start_waiter")
            if self.terminal:
                return self.sample
        if self.ctx.state == lifecycle.INITIAL and self._gate.closed():
            # Not started yet: wait for the weight update to end. An abort ends it at once, as before any start.
            await self._wait_before_start(asyncio.ensure_future(self._gate.wait_to_start()), "_gate_waiter")
            if self.terminal:
                return self.sample
        self._running = True
        self._done.clear()
        context = bind_contextvars(
            sample_id=self.ctx.sample_id, session_id=self.sample.session_id, rollout_uid=self.rollout_uid
        )
        tuning_gc = self.config.tune_gc
        if tuning_gc:
            gc_policy.rollout_started()
        try:
            if self.ctx.state != "suspended":  # a resumed rollout's clock starts when it resumes
                self._clock.start()
            await self._drive()
        finally:
            self._clock.stop()
            if self.ctx.deps.admission is not None:  # an admission slot held when the rollout ended is given back
                self.ctx.deps.admission.finish()
            closing, self.ctx.closing = self.ctx.closing, None
            if closing is not None:
                try:
                    await closing
                except Exception as close_error:  # the sample has ended: the error is kept, not raised
                    self.sample.metadata["env_close_error"] = f"{type(close_error).__name__}: {close_error}"
            if tuning_gc:
                gc_policy.rollout_ended()
            reset_contextvars(**context)
            self._running = False
            self._done.set()
            self.tracer.flush()
        return self.sample

    def request_abort(self, reason: str = "cancelled") -> None:
        """Ask the rollout to end ``aborted`` with ``reason``; cancels the engine request in flight, if any.

        A rollout that has not started ends at once, without sending anything.
        """
        scope = self._scope
        if self.terminal or scope.stopping:
            return
        if self._hooks is not None:
            self._hooks.abort_requested(self._view, reason, running=self._running, in_flight=scope.inflight is not None)
        had_inflight = scope.inflight is not None
        scope.abort(reason)
        if had_inflight or self._running:
            return
        context = bind_contextvars(
            sample_id=self.ctx.sample_id, session_id=self.sample.session_id, rollout_uid=self.rollout_uid
        )
        try:
            self._end_now()
        finally:
            reset_contextvars(**context)
            if self.ctx.deps.admission is not None:
                self.ctx.deps.admission.finish()
        self._done.set()
        self.tracer.flush()
        if self._start_waiter is not None and not self._start_waiter.done():
            self._start_waiter.set_result(None)  # waiting for the pacer to start: return now, it has ended
        if self._gate_waiter is not None and not self._gate_waiter.done():
            self._gate_waiter.cancel()  # waiting for a weight update to end: return now, it has ended

    async def abort(self, reason: str = "cancelled") -> None:
        """End the rollout ``aborted`` with ``reason`` and wait until it has (no request is sent after this)."""
        self.request_abort(reason)
        if self._running:
            await self._done.wait()


__all__ = ["Rollout"]
