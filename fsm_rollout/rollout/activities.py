"""The rollout's I/O: the activities the lifecycle's states name (render, generate, step, encode, wait to resume).

Each activity reads and writes the :class:`~fsm_rollout.rollout.context.RolloutContext` and awaits through the
rollout's one :class:`~fsm_rollout.rollout.cancel.CancelScope`. An activity reports its outcome in the context (the
gate closed: ``suspend_due``; handed back: ``hand_back_due``; a re-render that does not extend the tokens:
``fork_prompt``) and the table's guards on the state's outcomes decide which trigger follows. Engine requests go through
the client, environment calls through :meth:`Activities.env_call` (inline or in the worker pool, bounded by
``env_step_timeout_s``), and the weight-update gate is met in :meth:`Activities.request_turn` only
(:mod:`fsm_rollout.rollout.gating`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

from fsm_rollout.config import DEFAULT_ENV_MODULE
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.envs.protocol import EnvFactory, check_environment, env_thread_pool, load_env_factory
from fsm_rollout.envs.step import StepResult, Turn, accepts_turn, as_step_result
from fsm_rollout.errors import BudgetExceededError, RenderError, ResumeError, RoutingReplayError
from fsm_rollout.machine import lifecycle
from fsm_rollout.multimodal import (
    build_initial_messages,
    fill_null_items,
    observation_image_count,
    prepare_render_messages,
)
from fsm_rollout.rollout.cancel import CancelScope, TimedOut
from fsm_rollout.rollout.context import RolloutContext
from fsm_rollout.rollout.history import keeps_history, reconcile, rewrite_history
from fsm_rollout.rollout.observation_images import (
    encode_image_observation,
    filling_render,
    hashed_messages,
    render_ready_observation,
)
from fsm_rollout.rollout.stops import stop_string_end
from fsm_rollout.tokens.chat import stop_string_eos_due, validate_observation
from fsm_rollout.tokens.tool_calls import parse_tool_calls
from fsm_rollout.types import GeneratedTurn, RenderedPrompt, TokenIds
from fsm_rollout.weights.partial_turn import answer_spans, merge_turns
from fsm_rollout.weights.suspension import HandBack


class Activities:
    """The I/O of one rollout: its client, environment factory and cancel scope, over its context."""

    def __init__(
        self,
        ctx: RolloutContext,
        *,
        client: VLLMClient,
        headers: dict[str, str] | None,
        scope: CancelScope,
        env_factory: EnvFactory | None,
        env_args: Any,
        start_clock: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.start_clock = start_clock
        self.client = client
        self.headers = headers
        self.scope = scope
        self.env_factory = env_factory
        self.env_args = env_args

    # ------------------------------------------------------------------ environment

    async def env_call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One environment call as the config says: inline or in the worker pool, awaited when it is async, bounded
        by ``env_step_timeout_s``, and cut off by a stop like a request."""
        config = self.ctx.deps.config
        limit = config.env_step_timeout_s
        scope = self.scope
        if config.env_executor == "thread" and not inspect.iscoroutinefunction(method):
            future = env_thread_pool(config.env_max_workers).submit(method, *args, **kwargs)
            result = await scope.run(
                asyncio.wrap_future(future), limit=limit, what=what, thread=future, discard_late=False
            )
            if inspect.isawaitable(result):  # a synchronous method that handed back an awaitable
                result = await scope.run(result, limit=limit, what=what, discard_late=False)
            return result
        started = time.perf_counter()
        result = method(*args, **kwargs)
        if inspect.isawaitable(result):
            return await scope.run(result, limit=limit, what=what, discard_late=False)
        if limit is not None and time.perf_counter() - started > limit:  # an inline call cannot be cut short
            raise TimedOut(what, limit)
        return result

    async def _build_env(self) -> Any:
        ctx = self.ctx
        factory = self.env_factory or load_env_factory(ctx.deps.config.env_path or DEFAULT_ENV_MODULE)
        env = await self.env_call("build_env", factory, sample=ctx.sample, args=self.env_args)
        ctx.env = env
        check_environment(env)
        return env

    async def open_environment(self) -> None:
        env = await self._build_env()
        reset = await self.env_call("env.reset", env.reset)
        if isinstance(reset, StepResult):  # an environment driven from outside: its first call's settings
            self.ctx.step = reset

    async def _restore_environment(self) -> None:
        env = await self._build_env()
        restore = getattr(env, "restore", None)
        if not callable(restore):
            raise ResumeError(
                f"sample {self.ctx.sample_id}: resuming a handed-back sample needs an environment with "
                f"restore(state); {type(env).__name__} has none (implement snapshot() -> dict and restore(state))"
            )
        await self.env_call("env.restore", restore, self.ctx.env_snapshot)

    async def step_environment(self) -> None:
        ctx = self.ctx
        given = ctx.last_turn if accepts_turn(ctx.env) and ctx.last_turn is not None else ctx.turn_text
        step = ctx.step = as_step_result(await self.env_call("env.step", ctx.env.step, given))
        if step.reward is not None:
            ctx.sample.reward = step.reward

    async def encode_observation(self) -> None:
        ctx = self.ctx
        step = ctx.step
        assert step is not None
        formatted = await self.env_call("env.format_observation", ctx.env.format_observation, step.observation)
        ctx.observation_messages = validate_observation(formatted)
        ctx.observation_features, ctx.observation_image_hashes = None, ()
        ctx.fork_prompt = None  # set by a re-render that does not extend the tokens so far (the fork's outcome)
        rewrite = step.next_call.rewrite if step.next_call is not None else None
        if rewrite is not None:  # a gateway agent rewrote the history: render it as sent, fork unless it extends
            await rewrite_history(ctx, self._render, rewrite)
            return
        if keeps_history(ctx.deps.config):  # fork / per_turn: the engine's re-render decides (one render request)
            formatted_messages = ctx.observation_messages
            images = observation_image_count(formatted_messages)
            if images:  # the conversation re-rendered from now on holds the images themselves
                ctx.observation_messages = render_ready_observation(ctx, formatted_messages)
            await reconcile(ctx, filling_render(ctx, self._render))
            if images:  # the sample's records keep the images' hashes (the pixels are in its features)
                ctx.observation_messages = hashed_messages(formatted_messages, ctx.observation_image_hashes)
            return
        if observation_image_count(ctx.observation_messages):  # the engine renders it: one request
            await encode_image_observation(ctx, ctx.observation_messages, self._render)
            return
        tokens = ctx.sample.tokens
        encoder = ctx.deps.encoder
        ctx.observation_tokens = encoder.encode(
            ctx.observation_messages,
            ends_with_eos=bool(tokens) and tokens[-1] == encoder.eos_token_id,
            tools=ctx.sample.metadata.get("tools"),
            template_kwargs=ctx.deps.config.apply_chat_template_kwargs,
        )

    # ------------------------------------------------------------------ engine

    async def request_render(self) -> None:
        ctx = self.ctx
        sample = ctx.sample
        config = ctx.deps.config
        render = prepare_render_messages(
            build_initial_messages(sample.prompt, (sample.multimodal_inputs or {}).get("images")),
            sample_id=ctx.sample_id,
        )
        ctx.image_hashes = render.image_hashes
        payload: dict[str, Any] = {"model": config.model, "messages": render.messages}
        tools = sample.metadata.get("tools")
        if tools is not None:
            payload["tools"] = tools
        if config.apply_chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(config.apply_chat_template_kwargs)
        rendered = await self._render(payload)
        if keeps_history(config):
            ctx.history = [dict(message) for message in render.messages]
        if sample.tokens and sample.tokens != rendered.token_ids:
            raise RenderError(
                f"sample {ctx.sample_id}: Initial render token_ids differ from sample.tokens "
                f"(render gave {len(rendered.token_ids)} ids, the sample holds {len(sample.tokens)})"
            )
        features = rendered.generate_body.get("features")
        filled = fill_null_items(features, sample_id=ctx.sample_id)  # a null item must never reach generate
        if filled is not features:
            rendered = RenderedPrompt(
                token_ids=rendered.token_ids, generate_body={**rendered.generate_body, "features": filled}
            )
        ctx.rendered = rendered

    async def _render(self, payload: dict[str, Any]) -> RenderedPrompt:
        rendered: RenderedPrompt = await self.scope.run(self.client.render(payload, headers=self.headers))
        return rendered

    async def admit_request(self) -> None:
        """On the way into ``generating``: wait for the engine's admission of the request (adaptive admission;
        else nothing). A stop meanwhile cuts the wait off, and the rollout leaves from where it was."""
        admission = self.ctx.deps.admission
        if admission is not None and not admission.held:
            await self.scope.run(admission.acquire())

    async def request_turn(self) -> None:
        """Send the turn's generate request (or its continuation after a suspension); the one place the
        weight-update gate is met while running. The admission slot is given back once the answer is in."""
        try:
            await self._request_turn()
        finally:
            if self.ctx.deps.admission is not None:
                self.ctx.deps.admission.release()

    async def _request_turn(self) -> None:
        ctx = self.ctx
        assert ctx.rendered is not None
        point = ctx.deps.gate
        if point.closed():  # before anything is sent
            self._suspend(cut_request=False)
            return
        remaining = ctx.remaining_budget
        held = sum(len(part.token_ids) for part in ctx.partial_turn)
        if remaining is not None and held >= remaining:  # the partial turn used the whole budget
            self._take_turn([*ctx.partial_turn[:-1], _length_finished(ctx.partial_turn[-1])], remaining)
            return
        params = dict(ctx.deps.params)
        next_call = ctx.step.next_call if ctx.step is not None else None
        call = _call_params(dict(next_call.sampling) if next_call is not None else {})
        ctx.call_max_tokens = call.pop("max_tokens", None)
        top = call.pop("top_logprobs", 0)
        if top:  # the agent asked for top candidates: vLLM lists the sampled token first, so its logprob is kept
            params["logprobs"] = top
        params.update(call)
        # Unbounded: an explicit null means "up to the context limit" on every vLLM version, where an omitted key
        # meant the SamplingParams default of 16 on older ones.
        params["max_tokens"] = None if remaining is None else remaining - held
        if ctx.call_max_tokens is not None:
            allowed = ctx.call_max_tokens - held
            params["max_tokens"] = allowed if remaining is None else min(allowed, remaining - held)
        token_ids = ctx.sample.tokens
        if held:
            token_ids = token_ids + [token for part in ctx.partial_turn for token in part.token_ids]
            if isinstance(params.get("min_tokens"), int):
                params["min_tokens"] = max(0, params["min_tokens"] - held)
        request_id = f"{ctx.request_prefix}-turn{ctx.turn_index}"
        if ctx.turn_requests:
            request_id += f"-part{ctx.turn_requests}"
        ctx.turn_requests += 1
        body = {
            **ctx.rendered.generate_body,
            "token_ids": token_ids,
            "sampling_params": params,
            "request_id": request_id,
        }

        # an agent's call that streams its answer: the engine's tokens go to it as they come (the turn is the same)
        sink = next_call.token_sink if next_call is not None and not deps_replays_routes(ctx) else None
        streamed_ids, streamed_logprobs = ctx.streamed = ([], [])

        def seen(token_ids: list[int], logprobs: list[float]) -> None:
            # what the agent has seen of the turn: kept if it goes away before the turn ends (agent_disconnected)
            streamed_ids.extend(token_ids)
            streamed_logprobs.extend(logprobs)
            assert sink is not None
            sink(token_ids, logprobs)

        def send(request_id: str) -> Any:
            options: dict[str, Any] = {"top_logprobs": True} if top else {}
            if sink is not None:
                options["sink"] = seen
            return self.client.generate(body, request_id=request_id, headers=self.headers, **options)

        answer = await point.generate(self.scope, send, request_id, self.client)
        ctx.streamed = ([], [])  # the answer holds them now (the turn, or a suspension's partial turn)
        spans = answer.meta.weight_version_spans
        first = spans[0][0] if spans else answer.meta.weight_version
        if first is not None and "start_weight_version" not in ctx.sample.metadata:
            # the version current at the start, when the gate knew it by now; else the first token's
            known = point.version_at(ctx.start_epoch)
            ctx.sample.metadata["start_weight_version"] = known if known is not None else first
        if point.cut(answer, request_id):
            if answer.token_ids:
                ctx.partial_turn.append(answer)
            self._suspend(cut_request=True)
            return
        self._take_turn([*ctx.partial_turn, answer], remaining)

    def _suspend(self, *, cut_request: bool) -> None:
        self.ctx.suspend_due = True
        self.ctx.suspend_cut_request = cut_request

    def _take_turn(self, parts: list[GeneratedTurn], remaining: int | None) -> None:
        """The turn is complete (or the server aborted it): merge its answers, check it and find its stop."""
        ctx = self.ctx
        deps = ctx.deps
        fallback = deps.gate.weight_version
        answer = parts[-1]
        if len(parts) > 1 and answer.finish != "abort":
            turn, spans = merge_turns(
                parts,
                request_id=answer.request_id,
                fallback_version=fallback,
                cut_at_stop=self.stop_string_end,
                prompt_length=len(ctx.sample.tokens),
            )
        else:
            turn = answer
            spans = answer_spans(answer, fallback) if answer.finish != "abort" else []
        ctx.partial_turn = []
        ctx.turn_requests = 0
        ctx.eos_due = False
        ctx.turn_text = ""
        ctx.turn_spans = spans
        if turn.finish != "abort":
            self._validate_turn(turn, remaining)
            ctx.turn_text = deps.decode(turn.token_ids) if turn.token_ids else ""
            ctx.eos_due = deps.config.append_eos_token_after_stop_str_in_multi_turn and stop_string_eos_due(
                ctx.turn_text,
                turn.token_ids,
                finish=turn.finish,
                stop=deps.params.get("stop"),
                eos_token_id=deps.encoder.eos_token_id,
            )
        ctx.turn = turn
        ctx.last_turn = Turn(
            text=ctx.turn_text,
            token_ids=turn.token_ids,
            logprobs=turn.logprobs,
            top_logprobs=turn.top_logprobs,
            finish_reason=turn.finish,
            tool_calls=parse_tool_calls(ctx.turn_text).calls if "<tool_call>" in ctx.turn_text else (),
            prompt_tokens=len(ctx.sample.tokens),
        )

    def stop_string_end(self, token_ids: TokenIds) -> int | None:
        """Where a continued turn ends: :func:`fsm_rollout.rollout.stops.stop_string_end` with this rollout's
        parameters."""
        return stop_string_end(token_ids, self.ctx.deps.params, self.ctx.deps.decode)

    def _validate_turn(self, turn: GeneratedTurn, remaining: int | None) -> None:
        if remaining is not None and len(turn.token_ids) > remaining:
            raise BudgetExceededError(
                "vLLM generated more tokens than requested: "
                f"generated_tokens={len(turn.token_ids)}, remaining_budget={remaining}"
            )
        config = self.ctx.deps.config
        if not config.use_rollout_routing_replay:
            return
        routed = turn.meta.routed_experts
        if routed is None:
            raise RoutingReplayError("vLLM routing replay response is missing choices[0].routed_experts")
        dims = config.expert_dims
        assert dims is not None
        expected = (len(self.ctx.sample.tokens) + len(turn.token_ids) - 1) * dims[0] * dims[1]
        if int(routed.size) != expected:
            raise RoutingReplayError(
                "vLLM routed experts shape does not match the generated sequence: "
                f"actual_size={routed.size}, expected_size={expected}"
            )

    # ------------------------------------------------------------------ scoring

    async def score(self) -> None:
        """On the way into ``completed`` or ``truncated``: ``reward_fn`` (sync or async) sets the sample's reward
        (without one, nothing)."""
        reward_fn = self.ctx.deps.config.reward_fn
        if reward_fn is None:
            return
        reward = reward_fn(self.ctx.sample)
        if inspect.isawaitable(reward):
            reward = await reward
        self.ctx.sample.reward = reward

    # ------------------------------------------------------------------ the gate

    async def await_resume(self) -> None:
        """Wait for the weight update to end, or go back to the caller (``hand_back``)."""
        try:
            await self.scope.run(self.ctx.deps.gate.wait_resumed())
        except HandBack:
            self.ctx.hand_back_due = True
            return
        self.start_clock()
        if self.ctx.env is None:  # resumed from a handed-back sample: rebuild the environment from its snapshot
            await self._restore_environment()


_CALL_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "max_tokens",
        "top_logprobs",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "structured_outputs",
    }
)


def _call_params(asked: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters an agent's call asked for its turn (the step's ``next_call``), checked."""
    unknown = sorted(set(asked) - _CALL_PARAMS)
    if unknown:
        raise ValueError(f"an agent call asks for sampling parameters {unknown}; allowed: {sorted(_CALL_PARAMS)}")
    return {key: value for key, value in asked.items() if value is not None}


def deps_replays_routes(ctx: RolloutContext) -> bool:
    """Routing replay needs each answer's routed experts whole: such a rollout's requests are never streamed."""
    return bool(ctx.deps.config.use_rollout_routing_replay)


def _length_finished(part: GeneratedTurn) -> GeneratedTurn:
    """The last answer of a partial turn that used the whole budget, as the ``length`` finish it amounts to."""
    return GeneratedTurn(
        request_id=part.request_id,
        finish="length",
        token_ids=part.token_ids,
        logprobs=part.logprobs,
        meta=part.meta,
        top_logprobs=part.top_logprobs,
    )


ACTIVITIES: dict[str, Callable[[Activities], Any]] = {
    name: getattr(Activities, name) for name in lifecycle.activity_names()
}
"""The activities the table names, by name."""


__all__ = ["ACTIVITIES", "Activities"]
