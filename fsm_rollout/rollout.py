"""One sample's multi-turn rollout: the guards, actions and activities of the lifecycle, and the driver.

The lifecycle table (:mod:`fsm_rollout.lifecycle`) decides every branch. This module implements the names it uses:
guards are pure predicates over the rollout, actions change the sample, and activities are the work the driver
does while the sample sits in a state (render, generate, step the environment, encode the observation). The
driver runs the current state's activity, fires the state's trigger, and traces the transition, until a terminal
state is reached.

The module is longer than most because it is one class: every guard, action and activity the table names is a
method reading the same sample's state, and keeping them together keeps each name the table uses in one place.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from structlog.contextvars import bind_contextvars, reset_contextvars

from fsm_rollout import gc_policy, lifecycle
from fsm_rollout.chat import ObservationEncoder, record_observation, stop_string_eos_due, validate_observation
from fsm_rollout.config import (
    DEFAULT_ENV_MODULE,
    RolloutConfig,
    build_inference_sampling_params,
    response_budget,
)
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.env import EnvFactory, check_environment, env_thread_pool, load_env_factory, unpack_step_info
from fsm_rollout.errors import (
    BudgetExceededError,
    ConfigError,
    RenderError,
    ResumeError,
    RolloutError,
    RoutingReplayError,
    SampleStateError,
)
from fsm_rollout.hooks import RolloutHooks
from fsm_rollout.multimodal import (
    build_initial_messages,
    decode_train_features,
    prepare_render_messages,
    validate_image_tokens,
)
from fsm_rollout.pacing import LoopPacer, pacer_for
from fsm_rollout.partial_turn import Span, answer_spans, join_spans, merge_turns, shift_spans
from fsm_rollout.resume_state import RESUME_STATE_KEY, capture_resume_state, restore_resume_state
from fsm_rollout.sample import Sample, Status
from fsm_rollout.suspension import HandBack, SuspensionGate
from fsm_rollout.trace import NULL_TRACER, Tracer, get_tracer
from fsm_rollout.types import GeneratedTurn, RenderedPrompt, TokenIds

T = TypeVar("T")

_ENCODERS: dict[int, ObservationEncoder] = {}


def observation_encoder_for(tokenizer: Any) -> ObservationEncoder:
    """The process-wide observation encoder of a tokenizer (its dummy prefixes are cached there)."""
    encoder = _ENCODERS.get(id(tokenizer))
    if encoder is None or encoder.tokenizer is not tokenizer:
        encoder = ObservationEncoder(tokenizer)
        _ENCODERS[id(tokenizer)] = encoder
    return encoder


def default_sample_id(sample: Sample) -> str:
    """How a rollout names its sample unless told otherwise: the sample's index, else a random id."""
    return str(sample.index) if sample.index is not None else uuid.uuid4().hex[:12]


def default_request_prefix(sample: Sample) -> str:
    """The prefix of a rollout's generate request ids unless told otherwise: the session id, else a random one."""
    return sample.session_id or f"fsm-{uuid.uuid4().hex}"


class _AbortRequested(Exception):
    """Internal: the caller asked for an abort while the driver was waiting on the engine."""


class _EnvTimedOut(Exception):
    """Internal: one environment call ran past ``env_step_timeout_s``."""

    def __init__(self, what: str, limit_s: float) -> None:
        super().__init__(f"{what} ran past {limit_s} s")
        self.what = what
        self.limit_s = limit_s


def check_startable(sample: Sample) -> None:
    """A rollout starts only from a pending sample without response data (the seed's preconditions), or from a
    sample handed back suspended (``metadata["resume_state"]``), which resumes."""
    if isinstance(sample.metadata, dict) and RESUME_STATE_KEY in sample.metadata:
        return
    if sample.status != Status.PENDING:
        raise SampleStateError(
            f"sample {sample.index!r}: a rollout requires a pending sample, got status {Status(sample.status).value!r}"
        )
    if sample.metadata is not None and not isinstance(sample.metadata, dict):
        raise SampleStateError(
            f"sample {sample.index!r}: metadata must be a dict or None, got {type(sample.metadata).__name__}"
        )
    if sample.response or sample.response_length or sample.loss_mask or sample.rollout_log_probs:
        raise SampleStateError(
            f"sample {sample.index!r}: the rollout does not accept pre-existing response state (response, "
            "response_length, loss_mask or rollout_log_probs is set)"
        )


class Rollout:
    """Drives one sample through the lifecycle against one engine client.

    Create it, then ``await rollout.run()``; the sample is mutated in place and returned. ``await
    rollout.abort(reason)`` (from another task) ends it ``aborted`` with that reason: the request in flight is
    cancelled and named to the server's abort endpoint, and no further request is sent. Errors end it ``failed``
    (data so far kept, environment closed once) and are then raised to the caller of :meth:`run`.

    The rollout knows nothing of recording or replay: those plug in as the client's transport, the environment
    factory and ``hooks`` (:mod:`fsm_rollout.recording`, :mod:`fsm_rollout.replay`).

    ``suspender`` is the gate a weight update closes (:mod:`fsm_rollout.suspension`): the rollout then suspends
    when it is generating or next about to (the request in flight aborted, its tokens kept as the partial turn) and
    continues the same turn when the gate opens. A sample handed back suspended (``metadata["resume_state"]``)
    resumes where it stopped.
    """

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
    ) -> None:
        check_startable(sample)
        if config.record and (hooks is None or not hooks.records_io):
            raise ConfigError(
                "config.record is set but this rollout is not recorded: build it with RolloutRunner or "
                "fsm_rollout.recording.recorded_rollout, which wire the recorder in"
            )
        self.sample = sample
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.processor = processor
        self.inference_params = build_inference_sampling_params(sampling_params)
        config.check_sampling(self.inference_params)
        self.encoder = encoder or observation_encoder_for(tokenizer)
        self.tracer = tracer if tracer is not None else get_tracer(config.trace) if config.trace else NULL_TRACER
        self._env_factory = env_factory
        self._env_args = env_args if env_args is not None else config
        self._hooks = hooks
        self._wants_events = hooks is not None and hooks.wants_events

        sample.metadata = dict(sample.metadata or {})
        # A template that is not prefix-stable fails here, naming it, rather than at the first observation.
        self.encoder.probe(tools=sample.metadata.get("tools"), template_kwargs=config.apply_chat_template_kwargs)
        self.headers: dict[str, str] | None = None
        if config.router_policy == "consistent_hash":
            sample.session_id = sample.session_id or str(uuid.uuid4())
            self.headers = {"x-session-id": sample.session_id}
        self.sample_id = sample_id if sample_id is not None else default_sample_id(sample)
        """How traces, tapes and errors name this sample."""
        self.request_prefix = request_prefix if request_prefix is not None else default_request_prefix(sample)
        """Generate request ids are ``<request_prefix>-turn<N>``."""
        self.rollout_uid = uuid.uuid4().hex[:16]
        """Unique to this rollout (a sample index may repeat across a trainer's steps): traces and tapes carry it."""

        self.state: str = lifecycle.INITIAL
        self.reason: str | None = None
        self.error: BaseException | None = None
        self.turn_index = 0
        self.prompt_length: int | None = None
        self.budget: int | None = None
        self.env: Any = None
        self.rendered: RenderedPrompt | None = None
        self.image_hashes: tuple[str, ...] = ()
        self.turn: GeneratedTurn | None = None
        self.turn_text = ""
        self.eos_due = False
        self.env_done = False
        self.observation: Any = None
        self.observation_messages: list[dict[str, Any]] = []
        self.observation_tokens: TokenIds = []
        self.response_token_ids: TokenIds = []

        self._env_closed = False
        self._abort_reason: str | None = None
        self._failed_trigger: str | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._cancelled_request_id: str | None = None
        self._entered_at = time.perf_counter()
        self._running = False
        self._done = asyncio.Event()
        self._pacer: LoopPacer | None = None
        self._start_waiter: asyncio.Future[None] | None = None

        self._gate = suspender
        self._gate_waiter: asyncio.Future[None] | None = None
        self._next_trigger: str | None = None
        self.partial_parts: list[GeneratedTurn] = []
        """The answers of the turn in progress that a suspension cut off (their tokens are the partial turn)."""
        self.turn_spans: list[Span] = []
        """The weight-version spans of the turn just generated, over its own tokens."""
        self.suspensions = 0
        """How often this rollout was suspended."""
        self.turn_requests = 0
        """Generate requests sent for the turn in progress (more than one after a suspension)."""
        self.suspended_since: float | None = None
        self.suspend_reason: str | None = None
        self.env_snapshot: dict[str, Any] | None = None
        """A restored environment's snapshot, applied when the environment is rebuilt in another process."""
        self.status_before_hand_back: Status | None = None
        self._stop_trigger: str | None = None
        """``env_timeout`` or ``rollout_timeout`` once a limit ran out (the abort machinery then ends the rollout)."""
        self._time_left = config.rollout_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._clock_started: float | None = None
        self._closing: Any = None
        self._start_epoch = 0
        self._suspend_cut_request = False
        resume_state = sample.metadata.get(RESUME_STATE_KEY)
        if resume_state is not None:
            restore_resume_state(self, resume_state)  # raises before changing the sample when it cannot resume
            del sample.metadata[RESUME_STATE_KEY]

    # ------------------------------------------------------------------ derived context

    @property
    def remaining_budget(self) -> int | None:
        """Response-side tokens still allowed, or None when unbounded."""
        if self.budget is None:
            return None
        return self.budget - self.sample.response_length

    @property
    def terminal(self) -> bool:
        """Whether the rollout has ended."""
        return self.state in lifecycle.TERMINAL

    # ------------------------------------------------------------------ guards (pure)

    def budget_exhausted(self) -> bool:
        """No response budget is left before the first turn (nothing may be generated)."""
        remaining = self.remaining_budget
        return remaining is not None and remaining <= 0

    def server_aborted(self) -> bool:
        """The engine ended the turn with ``abort``/``cancelled``."""
        return self.turn is not None and self.turn.finish == "abort"

    def stop_eos_due(self) -> bool:
        """The turn stopped on a stop string and a masked EOS must follow it."""
        return self.eos_due

    def no_budget_for_stop_eos(self) -> bool:
        """A masked EOS is due but the turn used the last of the budget."""
        remaining = self.remaining_budget
        if not self.eos_due or remaining is None or self.turn is None:
            return False
        return remaining - len(self.turn.token_ids) <= 0

    def finished_by_length(self) -> bool:
        """The turn hit its token limit (the environment is then not stepped)."""
        return self.turn is not None and self.turn.finish == "length"

    def env_done_guard(self) -> bool:
        """The environment said the episode is done."""
        return self.env_done

    def turn_limit_reached(self) -> bool:
        """This was the last turn ``max_turns`` allows."""
        return self.turn_index + 1 >= self.config.max_turns

    def observation_exceeds_budget(self) -> bool:
        """The observation tokens would leave no budget for another turn."""
        remaining = self.remaining_budget
        return remaining is not None and len(self.observation_tokens) >= remaining

    # ------------------------------------------------------------------ actions

    def record_outcome(self, dest: str, reason: str | None) -> None:
        if reason is None:
            reason = "error" if dest == "failed" else (self._abort_reason or "cancelled")
        self.reason = reason
        self.sample.status = Status(dest)
        self.sample.metadata["rollout_reason"] = self.reason

    def start_response(self) -> None:
        assert self.rendered is not None
        sample = self.sample
        sample.tokens = list(self.rendered.token_ids)
        sample.loss_mask = []
        sample.rollout_log_probs = []
        sample.response_length = 0
        self.prompt_length = len(sample.tokens)
        self.budget = response_budget(
            self.inference_params["max_tokens"], self.config.rollout_max_context_len, self.prompt_length
        )
        if self._gate is not None:
            version = self._gate.weight_version
            if version is not None:
                sample.metadata["start_weight_version"] = version
            self._start_epoch = self._gate.weight_updates

    def append_turn(self) -> None:
        turn = self.turn
        assert turn is not None
        offset = self.sample.response_length
        self.sample.append_response_tokens(
            turn.token_ids,
            turn.logprobs,
            trainable=True,
            meta=turn.meta,
            expert_dims=self.config.expert_dims,
            track_spec_stats=self.config.track_speculative_stats,
        )
        self.response_token_ids.extend(turn.token_ids)
        if self.turn_spans:
            spans = self.sample.metadata.setdefault("weight_version_spans", [])
            joined = join_spans([(span["version"], span["start"], span["end"]) for span in spans[-1:]],
                                shift_spans(self.turn_spans, offset))
            spans[-1:] = [{"version": v, "start": start, "end": end} for v, start, end in joined]

    def append_stop_eos(self) -> None:
        assert self.encoder.eos_token_id is not None
        self.sample.append_response_tokens([self.encoder.eos_token_id], trainable=False)

    def note_stop_eos_truncation(self) -> None:
        self.sample.metadata["multiturn_truncation"] = {
            "reason": "insufficient_budget_for_stop_eos",
            "remaining_budget": self.remaining_budget,
        }

    def note_observation_truncation(self) -> None:
        self.sample.metadata["multiturn_truncation"] = {
            "reason": "insufficient_budget_for_next_turn",
            "observation_tokens": len(self.observation_tokens),
            "remaining_budget": self.remaining_budget,
        }

    def append_observation(self) -> None:
        sample = self.sample
        start = sample.response_length
        sample.append_response_tokens(self.observation_tokens, trainable=False)
        record_observation(sample.metadata, self.observation_messages, start=start, end=sample.response_length)

    def next_turn(self) -> None:
        self.turn_index += 1

    def note_abort(self) -> None:
        """Nothing to undo: an aborted turn's tokens were never appended."""
        self.partial_parts = []

    def note_timeout(self) -> None:
        """``metadata["rollout_timeout"]`` was written when the limit ran out; the partial turn is dropped."""
        self.partial_parts = []

    def hold_partial_turn(self) -> None:
        """The partial turn stays in :attr:`partial_parts` until the rollout resumes; the rollout's clock stops."""
        self._stop_clock()
        self.suspensions += 1
        self.suspended_since = time.perf_counter()
        self.suspend_reason = getattr(self._gate, "reason", None) or "weight_update"

    def finalize(self) -> None:
        features = self.rendered.generate_body.get("features") if self.rendered is not None else None
        train_inputs = decode_train_features(features, sample_id=self.sample_id)
        validate_image_tokens(
            self.sample.tokens,
            self.tokenizer,
            self.processor,
            train_inputs,
            placeholder_token=self.config.image_placeholder_token,
            merge_size=self.config.image_merge_size,
            prompt_length=self.prompt_length,
            sample_id=self.sample_id,
        )
        self.sample.multimodal_train_inputs = train_inputs
        self.sample.response = self._decode(self.response_token_ids)

    def salvage_response(self) -> None:
        """On failure keep what can be kept: the response text of the tokens generated so far."""
        try:
            self.sample.response = self._decode(self.response_token_ids)
        except Exception as error:  # the sample's tokens stay; only the text is missing
            self.sample.metadata["response_decode_error"] = f"{type(error).__name__}: {error}"

    def record_failure(self) -> None:
        error = self.error
        self.sample.metadata["rollout_error"] = {
            "type": type(error).__name__,
            "message": str(error),
            "state": self._failed_state,
            "trigger": self._failed_trigger,
        }

    def close_environment(self) -> None:
        if self.env is None or self._env_closed:
            return
        self._env_closed = True
        closing = self.env.close()
        if inspect.isawaitable(closing):  # an async close: the driver awaits it once the rollout has ended
            self._closing = closing

    def close_environment_after_error(self) -> None:
        if self.env is None or self._env_closed:
            return
        self._env_closed = True
        close = getattr(self.env, "close", None)
        if not callable(close):
            return
        try:
            closing = close()
        except BaseException as close_error:
            self.sample.metadata["env_close_error"] = f"{type(close_error).__name__}: {close_error}"
            if self.error is not None and self.error is not close_error:
                self.error.__cause__ = close_error
            return
        if inspect.isawaitable(closing):
            self._closing = closing

    # ------------------------------------------------------------------ activities

    async def open_environment(self) -> None:
        factory = self._env_factory or load_env_factory(self.config.env_path or DEFAULT_ENV_MODULE)
        env = await self._env_call("build_env", factory, sample=self.sample, args=self._env_args)
        self.env = env
        check_environment(env)
        await self._env_call("env.reset", env.reset)

    async def _env_call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One environment call as the config says: inline or in the worker pool, awaited when it is async, bounded
        by ``env_step_timeout_s``, and cut off by an abort, a suspension's gate or a timeout like a request."""
        limit = self.config.env_step_timeout_s
        if self.config.env_executor == "thread" and not inspect.iscoroutinefunction(method):
            future = env_thread_pool(self.config.env_max_workers).submit(method, *args, **kwargs)
            result = await self._await_env(asyncio.wrap_future(future), what, limit, future)
            if inspect.isawaitable(result):  # a synchronous method that handed back an awaitable
                result = await self._await_env(result, what, limit, None)
            return result
        started = time.perf_counter()
        result = method(*args, **kwargs)
        if inspect.isawaitable(result):
            return await self._await_env(result, what, limit, None)
        if limit is not None and time.perf_counter() - started > limit:  # an inline call cannot be cut short
            raise _EnvTimedOut(what, limit)
        return result

    async def _await_env(self, awaitable: Any, what: str, limit: float | None, thread: Any) -> Any:
        if self._abort_reason is not None:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise _AbortRequested
        task = asyncio.ensure_future(awaitable)
        self._inflight = task
        try:
            try:
                result = await (task if limit is None else asyncio.wait_for(task, limit))
                # Many environment calls end together (a batch's steps, a pool's threads): each rollout's work after
                # its call waits its turn in the loop, as after an engine answer.
                await self._paced()
                return result
            except TimeoutError:
                if thread is not None:  # a thread cannot be stopped: wait for it, then discard its result
                    await _thread_done(thread)
                if self._abort_reason is not None:
                    raise _AbortRequested from None
                raise _EnvTimedOut(what, limit or 0.0) from None
            except asyncio.CancelledError:
                if thread is not None:
                    await _thread_done(thread)
                current = asyncio.current_task()
                if (current is not None and current.cancelling()) or self._abort_reason is None:
                    raise
                raise _AbortRequested from None
        finally:
            self._inflight = None

    async def request_render(self) -> None:
        sample = self.sample
        render = prepare_render_messages(
            build_initial_messages(sample.prompt, (sample.multimodal_inputs or {}).get("images")),
            sample_id=self.sample_id,
        )
        self.image_hashes = render.image_hashes
        payload: dict[str, Any] = {"model": self.config.model, "messages": render.messages}
        tools = sample.metadata.get("tools")
        if tools is not None:
            payload["tools"] = tools
        if self.config.apply_chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(self.config.apply_chat_template_kwargs)
        rendered = await self._engine(self.client.render(payload, headers=self.headers), None)
        if sample.tokens and sample.tokens != rendered.token_ids:
            raise RenderError(
                f"sample {self.sample_id}: Initial render token_ids differ from sample.tokens "
                f"(render gave {len(rendered.token_ids)} ids, the sample holds {len(sample.tokens)})"
            )
        self.rendered = rendered

    async def request_turn(self) -> None:
        assert self.rendered is not None
        gate = self._gate
        if gate is not None and gate.should_suspend(self):  # before anything is sent
            self._next_trigger = "suspend"
            self._suspend_cut_request = False
            return
        remaining = self.remaining_budget
        held = sum(len(part.token_ids) for part in self.partial_parts)
        if remaining is not None and held >= remaining:  # the partial turn used the whole budget
            self._take_turn([*self.partial_parts[:-1], _length_finished(self.partial_parts[-1])], remaining)
            return
        params = dict(self.inference_params)
        if remaining is not None:
            params["max_tokens"] = remaining - held
        else:
            # Unbounded: an explicit null means "up to the context limit" on every vLLM version, where an omitted
            # key meant the SamplingParams default of 16 on older ones.
            params["max_tokens"] = None
        token_ids = self.sample.tokens
        if held:
            token_ids = token_ids + [token for part in self.partial_parts for token in part.token_ids]
            if isinstance(params.get("min_tokens"), int):
                params["min_tokens"] = max(0, params["min_tokens"] - held)
        request_id = f"{self.request_prefix}-turn{self.turn_index}"
        if self.turn_requests:
            request_id += f"-part{self.turn_requests}"
        self.turn_requests += 1
        body = {
            **self.rendered.generate_body,
            "token_ids": token_ids,
            "sampling_params": params,
            "request_id": request_id,
        }
        call = self.client.generate(body, request_id=request_id, headers=self.headers)
        if gate is None:
            answer = await self._engine(call, request_id)
        else:
            gate.request_started(self, self.client, request_id)
            try:
                answer = await self._engine(call, request_id)
            finally:
                gate.request_ended(self, request_id)
        spans = answer.meta.weight_version_spans
        first = spans[0][0] if spans else answer.meta.weight_version
        if first is not None:
            if gate is not None:
                gate.saw_version(answer.meta.weight_version or first)
            if "start_weight_version" not in self.sample.metadata:
                # the version current at the start, when the gate knew it by now; else the first token's
                known = gate.version_at(self._start_epoch) if gate is not None else None
                self.sample.metadata["start_weight_version"] = known if known is not None else first
        if gate is not None and answer.finish == "abort" and gate.suspended_request(self, request_id):
            if answer.token_ids:
                self.partial_parts.append(answer)
            self._next_trigger = "suspend"
            self._suspend_cut_request = True
            return
        self._take_turn([*self.partial_parts, answer], remaining)

    def _take_turn(self, parts: list[GeneratedTurn], remaining: int | None) -> None:
        """The turn is complete (or the server aborted it): merge its answers, check it and find its stop."""
        fallback = self._gate.weight_version if self._gate is not None else None
        answer = parts[-1]
        if len(parts) > 1 and answer.finish != "abort":
            turn, spans = merge_turns(parts, request_id=answer.request_id, fallback_version=fallback,
                                      cut_at_stop=self._stop_string_end)
        else:
            turn = answer
            spans = answer_spans(answer, fallback) if answer.finish != "abort" else []
        self.partial_parts = []
        self.turn_requests = 0
        self.eos_due = False
        self.turn_text = ""
        self.turn_spans = spans
        if turn.finish != "abort":
            self._validate_turn(turn, remaining)
            self.turn_text = self._decode(turn.token_ids) if turn.token_ids else ""
            self.eos_due = self.config.append_eos_token_after_stop_str_in_multi_turn and stop_string_eos_due(
                self.turn_text,
                turn.token_ids,
                finish=turn.finish,
                stop=self.inference_params.get("stop"),
                eos_token_id=self.encoder.eos_token_id,
            )
        self.turn = turn

    def _stop_string_end(self, token_ids: TokenIds) -> int | None:
        """The length of the shortest prefix of ``token_ids`` whose text holds a stop string (None: none does).

        As vLLM, a stop string only counts once it ends past the text of the first ``min_tokens`` tokens.
        """
        stop = self.inference_params.get("stop")
        stops = [stop] if isinstance(stop, str) else [item for item in stop or () if isinstance(item, str) and item]
        if not stops or not token_ids:
            return None
        min_tokens = self.inference_params.get("min_tokens")
        floor = len(self._decode(token_ids[:min_tokens])) if isinstance(min_tokens, int) and min_tokens > 0 else 0

        def holds_stop(length: int) -> bool:
            text = self._decode(token_ids[:length])
            return any(text.find(item, max(0, floor + 1 - len(item))) != -1 for item in stops)

        if not holds_stop(len(token_ids)):
            return None
        low, high = 1, len(token_ids)  # holding a stop string only grows with the prefix: binary search
        while low < high:
            middle = (low + high) // 2
            if holds_stop(middle):
                high = middle
            else:
                low = middle + 1
        return low

    def _validate_turn(self, turn: GeneratedTurn, remaining: int | None) -> None:
        if remaining is not None and len(turn.token_ids) > remaining:
            raise BudgetExceededError(
                "vLLM generated more tokens than requested: "
                f"generated_tokens={len(turn.token_ids)}, remaining_budget={remaining}"
            )
        if not self.config.use_rollout_routing_replay:
            return
        routed = turn.meta.routed_experts
        if routed is None:
            raise RoutingReplayError("vLLM routing replay response is missing choices[0].routed_experts")
        dims = self.config.expert_dims
        assert dims is not None
        expected = (len(self.sample.tokens) + len(turn.token_ids) - 1) * dims[0] * dims[1]
        if int(routed.size) != expected:
            raise RoutingReplayError(
                "vLLM routed experts shape does not match the generated sequence: "
                f"actual_size={routed.size}, expected_size={expected}"
            )

    async def await_resume(self) -> None:
        gate = self._gate
        if gate is not None:
            await self._engine(gate.wait_resumed(self), None)
        self._start_clock()
        if self.env is None:  # restored from a resume state in another process: rebuild the environment
            await self._restore_environment()

    async def _restore_environment(self) -> None:
        factory = self._env_factory or load_env_factory(self.config.env_path or DEFAULT_ENV_MODULE)
        env = await self._env_call("build_env", factory, sample=self.sample, args=self._env_args)
        self.env = env
        check_environment(env)
        restore = getattr(env, "restore", None)
        if not callable(restore):
            raise ResumeError(
                f"sample {self.sample_id}: resuming in another process needs an environment with restore(state); "
                f"{type(env).__name__} has none (resume the sample in the process that suspended it, or implement "
                "snapshot() -> dict and restore(state))"
            )
        await self._env_call("env.restore", restore, self.env_snapshot)

    async def step_environment(self) -> None:
        result = await self._env_call("env.step", self.env.step, self.turn_text)
        self.observation, self.env_done, info = unpack_step_info(result)
        if isinstance(info, Mapping) and "reward" in info:
            self.sample.reward = info["reward"]

    async def encode_observation(self) -> None:
        formatted = await self._env_call("env.format_observation", self.env.format_observation, self.observation)
        self.observation_messages = validate_observation(formatted)
        tokens = self.sample.tokens
        self.observation_tokens = self.encoder.encode(
            self.observation_messages,
            ends_with_eos=bool(tokens) and tokens[-1] == self.encoder.eos_token_id,
            tools=self.sample.metadata.get("tools"),
            template_kwargs=self.config.apply_chat_template_kwargs,
        )

    # ------------------------------------------------------------------ driver

    def _decode(self, token_ids: TokenIds) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text

    async def _engine(self, call: Awaitable[T], request_id: str | None) -> T:
        """Await an engine call so that :meth:`abort` can cancel it; note which request was cut off."""
        if self._abort_reason is not None:  # never send a request once an abort was asked for
            if asyncio.iscoroutine(call):
                call.close()
            raise _AbortRequested
        task: asyncio.Future[T] = asyncio.ensure_future(call)
        self._inflight = task
        try:
            try:
                result = await task
            except asyncio.CancelledError:
                self._cancelled_request_id = request_id
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
                if self._abort_reason is None:
                    raise
                raise _AbortRequested from None
            # The answer is in; wait for this loop iteration's share of CPU work. The request still counts as in
            # flight, so an abort asked for meanwhile is one "just after its answer" (and replays as such).
            await self._paced()
        finally:
            self._inflight = None
        if self._abort_reason is not None:
            raise _AbortRequested
        return result

    def _fire(self, trigger: str) -> None:
        src = self.state
        _MACHINE.events[trigger].trigger(self, self)
        now = time.perf_counter()
        if self.config.check_invariants and self.prompt_length is not None:
            self.sample.check_invariants(self.prompt_length)
        dwell_ms = (now - self._entered_at) * 1000.0
        fields = self._event_fields(trigger, src, dwell_ms) if self.tracer.enabled or self._wants_events else None
        if fields is not None and self.tracer.enabled:
            self.tracer.emit(dict(fields) if self._wants_events else fields)  # the sink adds to the dict it is given
        if self._hooks is not None:
            self._hooks.transition(self, trigger, src, dwell_ms, fields)
        self._entered_at = now

    def _event_fields(self, trigger: str, src: str, dwell_ms: float) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "trigger": trigger,
            "src": src,
            "dst": self.state,
            "turn": self.turn_index,
            "response_length": self.sample.response_length,
            "remaining_budget": self.remaining_budget,
            "dwell_ms": round(dwell_ms, 3),
        }
        if self.state in lifecycle.TERMINAL:
            fields["reason"] = self.reason
        if trigger == "render":
            fields["prompt_tokens"] = self.prompt_length
            fields["image_hashes"] = list(self.image_hashes)
        elif trigger == "step" and self.turn is not None:
            fields["generated_tokens"] = len(self.turn.token_ids)
            fields["finish"] = self.turn.finish
            fields["eos_inserted"] = self.state == "stepping" and self.eos_due
        elif trigger == "generate" and src == "observing":
            fields["observation_tokens"] = len(self.observation_tokens)
        elif trigger == "suspend":
            fields["suspend_reason"] = self.suspend_reason
            fields["cut_request"] = self._suspend_cut_request
            fields["partial_tokens"] = sum(len(part.token_ids) for part in self.partial_parts)
        elif trigger == "resume":
            fields["partial_tokens"] = sum(len(part.token_ids) for part in self.partial_parts)
            if self.suspended_since is not None:
                fields["suspended_ms"] = round((time.perf_counter() - self.suspended_since) * 1000.0, 3)
            version = self._gate.weight_version if self._gate is not None else None
            if version is not None:
                fields["weight_version"] = version
        elif trigger == "fail":
            fields["failed_trigger"] = self._failed_trigger
            fields["error_type"] = type(self.error).__name__
            fields["error"] = str(self.error)[:500]
        return fields

    def _fail(self, error: BaseException, trigger: str | None) -> None:
        self.error = error
        self._failed_state = self.state
        self._failed_trigger = trigger
        self._fire("fail")

    async def _send_abort_notice(self) -> None:
        request_id, self._cancelled_request_id = self._cancelled_request_id, None
        if request_id is None:
            return
        try:
            await asyncio.wait_for(
                self.client.abort([request_id], headers=self.headers), self.config.abort_notice_timeout_s
            )
        except (Exception, asyncio.CancelledError) as error:  # the rollout is ending either way
            self.sample.metadata["abort_notice_error"] = f"{type(error).__name__}: {error}"

    async def _paced(self) -> None:
        """Wait for this loop iteration's share of CPU work, when pacing is on (:mod:`fsm_rollout.pacing`)."""
        if self._pacer is not None:
            waiter = self._pacer.admit()
            if waiter is not None:
                await waiter

    async def _run_activity(self) -> None:
        for name in lifecycle.STATE_BY_NAME[self.state].activity:
            result = _ACTIVITIES[name](self)
            if result is not None:
                await result

    async def _drive(self) -> None:
        cancelled_by_caller = False
        try:
            while self.state not in lifecycle.TERMINAL:
                trigger = self._stopping_trigger() or lifecycle.STATE_BY_NAME[self.state].trigger
                assert trigger is not None
                try:
                    if trigger not in _STOPPING_TRIGGERS:
                        await self._run_activity()
                        stopping = self._stopping_trigger()
                        if stopping is not None:  # asked for during the activity: abort (or a timeout) wins
                            trigger = stopping
                        elif self._next_trigger is not None:
                            trigger = self._next_trigger
                    self._next_trigger = None
                    if self.config.reward_fn is not None and self._ends_scored(trigger):
                        await self._score()
                    self._fire(trigger)
                except HandBack:
                    self._hand_back()
                    break
                except _AbortRequested:
                    await self._send_abort_notice()
                except _EnvTimedOut as timeout:
                    self._time_out("env_timeout", timeout.what, timeout.limit_s)
                except asyncio.CancelledError:
                    cancelled_by_caller = True
                    if self._abort_reason is None:
                        self._abort_reason = "cancelled"
                    await self._send_abort_notice()
                except Exception as error:
                    self._fail(error, trigger)
                    raise
        finally:
            if self.state not in lifecycle.TERMINAL and RESUME_STATE_KEY not in self.sample.metadata:
                # cancelled again while ending: end it synchronously
                self._abort_reason = self._abort_reason or "cancelled"
                try:
                    self._fire("abort")
                except Exception as error:
                    self._fail(error, "abort")
        if cancelled_by_caller:
            raise asyncio.CancelledError

    def _stopping_trigger(self) -> str | None:
        if self._abort_reason is None:
            return None
        return self._stop_trigger or "abort"

    def _ends_scored(self, trigger: str) -> bool:
        """Whether ``trigger`` now takes an edge into ``completed`` or ``truncated`` (guards are pure: evaluating
        them ahead of the machine changes nothing)."""
        for edge in _EDGES.get((self.state, trigger), ()):
            if edge.guard is None or _GUARDS[edge.guard](self):
                return edge.dest in ("completed", "truncated")
        return False

    async def _score(self) -> None:
        """``reward_fn`` sets the sample's reward on its way into a scored terminal state; an error fails it."""
        assert self.config.reward_fn is not None
        reward = self.config.reward_fn(self.sample)
        if inspect.isawaitable(reward):
            reward = await reward
        self.sample.reward = reward

    def _time_out(self, trigger: str, what: str, limit_s: float) -> None:
        """A limit ran out: end the rollout ``truncated`` through the abort machinery (the request in flight, if
        any, is cancelled and named to the server)."""
        if self.terminal or self._abort_reason is not None:
            return
        self.sample.metadata["rollout_timeout"] = {"what": what, "limit_s": limit_s, "state": self.state}
        self._stop_trigger = trigger
        self._abort_reason = trigger
        if self._inflight is not None:
            self._inflight.cancel()

    def _start_clock(self) -> None:
        limit = self.config.rollout_timeout_s
        if self._time_left is None or limit is None or self._deadline is not None:
            return
        self._clock_started = time.perf_counter()
        self._deadline = asyncio.get_running_loop().call_later(
            max(self._time_left, 0.0), self._time_out, "rollout_timeout", "rollout", limit
        )

    def _stop_clock(self) -> None:
        if self._deadline is None:
            return
        self._deadline.cancel()
        self._deadline = None
        if self._time_left is not None and self._clock_started is not None:
            self._time_left -= time.perf_counter() - self._clock_started

    def _hand_back(self) -> None:
        """Return the suspended rollout to its caller: status ``aborted`` with the suspension's reason, its data
        so far, and ``metadata["resume_state"]`` to resume it from."""
        sample = self.sample
        self.status_before_hand_back = Status(sample.status)
        state = capture_resume_state(self)
        sample.status = Status.ABORTED
        sample.metadata["rollout_reason"] = self.suspend_reason or "weight_update"
        sample.metadata[RESUME_STATE_KEY] = state
        self.salvage_response()

    async def run(self) -> Sample:
        """Run the rollout to a terminal state and return the sample (mutated in place).

        Raises the error that ended the rollout ``failed`` (after the sample reached ``failed``), and re-raises
        ``asyncio.CancelledError`` when the calling task was cancelled (after the sample reached ``aborted`` with
        reason ``cancelled``).
        """
        if self._running or self._start_waiter is not None:
            raise RolloutError(f"sample {self.sample_id}: the rollout is already running")
        if self.terminal:
            return self.sample
        if self.config.loop_slice_ms is not None:
            self._pacer = pacer_for(asyncio.get_running_loop(), self.config.loop_slice_ms)
            # Starting waits its turn like every other piece of work. A rollout waiting here has not started:
            # an abort ends it at once (nothing built, nothing sent), as before any start.
            waiter = self._pacer.admit()
            if waiter is not None:
                self._start_waiter = waiter
                try:
                    await waiter
                except asyncio.CancelledError:
                    self.request_abort("cancelled")
                    raise
                finally:
                    self._start_waiter = None
            if self.terminal:
                return self.sample
        gate = self._gate
        if gate is not None and self.state == lifecycle.INITIAL and gate.should_suspend(self):
            # Not started yet: wait for the weight update to end. An abort ends it at once, as before any start.
            waiter = self._gate_waiter = asyncio.ensure_future(gate.wait_to_start(self))
            try:
                await waiter
            except asyncio.CancelledError:
                if not self.terminal:
                    self.request_abort("cancelled")
                    raise
            finally:
                self._gate_waiter = None
            if self.terminal:
                return self.sample
        self._running = True
        self._done.clear()
        context = bind_contextvars(sample_id=self.sample_id, session_id=self.sample.session_id,
                                   rollout_uid=self.rollout_uid)
        tuning_gc = self.config.tune_gc
        if tuning_gc:
            gc_policy.rollout_started()
        try:
            if self.state != "suspended":  # a resumed rollout's clock starts when it resumes
                self._start_clock()
            await self._drive()
        finally:
            self._stop_clock()
            closing, self._closing = self._closing, None
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
        if self.terminal or self._abort_reason is not None:
            return
        if self._hooks is not None:
            self._hooks.abort_requested(self, reason, running=self._running, in_flight=self._inflight is not None)
        self._abort_reason = reason
        if self._inflight is not None:
            self._inflight.cancel()
        elif not self._running:
            context = bind_contextvars(sample_id=self.sample_id, session_id=self.sample.session_id,
                                       rollout_uid=self.rollout_uid)
            try:
                self._fire("abort")
            except Exception as error:
                self._fail(error, "abort")
            finally:
                reset_contextvars(**context)
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


async def _thread_done(future: Any) -> None:
    """Wait for a worker-pool call to finish, whatever it returns or raises."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def settle(_: Any) -> None:
        loop.call_soon_threadsafe(finish)

    future.add_done_callback(settle)
    await asyncio.shield(done)


_STOPPING_TRIGGERS = frozenset({"abort", "env_timeout", "rollout_timeout"})
_EDGES: dict[tuple[str, str], list[lifecycle.Edge]] = {}
for _edge in lifecycle.TRANSITIONS:
    _EDGES.setdefault((_edge.source, _edge.trigger), []).append(_edge)


def _length_finished(part: GeneratedTurn) -> GeneratedTurn:
    """The last answer of a partial turn that used the whole budget, as the ``length`` finish it amounts to."""
    return GeneratedTurn(request_id=part.request_id, finish="length", token_ids=part.token_ids,
                         logprobs=part.logprobs, meta=part.meta)


_GUARDS: dict[str, Callable[[Rollout], bool]] = {
    "budget_exhausted": Rollout.budget_exhausted,
    "server_aborted": Rollout.server_aborted,
    "stop_eos_due": Rollout.stop_eos_due,
    "no_budget_for_stop_eos": Rollout.no_budget_for_stop_eos,
    "finished_by_length": Rollout.finished_by_length,
    "env_done": Rollout.env_done_guard,
    "turn_limit_reached": Rollout.turn_limit_reached,
    "observation_exceeds_budget": Rollout.observation_exceeds_budget,
}
_ACTIONS: dict[str, Callable[..., None]] = {
    name: getattr(Rollout, name)
    for name in (
        "record_outcome",
        "start_response",
        "append_turn",
        "append_stop_eos",
        "note_stop_eos_truncation",
        "note_observation_truncation",
        "append_observation",
        "next_turn",
        "note_abort",
        "note_timeout",
        "hold_partial_turn",
        "finalize",
        "salvage_response",
        "record_failure",
        "close_environment",
        "close_environment_after_error",
    )
}
_ACTIVITIES: dict[str, Callable[[Rollout], Awaitable[None] | None]] = {
    name: getattr(Rollout, name) for name in lifecycle.activity_names()
}
_MACHINE = lifecycle.build_machine(_GUARDS, _ACTIONS)
