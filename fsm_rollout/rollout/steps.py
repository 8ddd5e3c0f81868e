"""The guards and actions the lifecycle table names, as plain functions of a :class:`RolloutContext`.

Guards are pure predicates; actions change the sample and the context. Neither sends anything or awaits: the I/O
is in :mod:`fsm_rollout.rollout.activities`. Each is testable with a context built by hand, without a client.
The fork edge's guard and actions come from :mod:`fsm_rollout.rollout.history`. The machine is built here from
the table and these functions (:data:`MACHINE`; the driver looks it up at each
transition, so a test may swap it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from fsm_rollout.config import response_budget
from fsm_rollout.envs.step import EndReason
from fsm_rollout.machine import lifecycle
from fsm_rollout.multimodal import decode_train_features, validate_image_tokens
from fsm_rollout.rollout.context import RolloutContext
from fsm_rollout.rollout.history import fork_exceeds_budget, fork_history, fork_reason, note_fork_truncation
from fsm_rollout.rollout.observation_images import with_observation_features
from fsm_rollout.sample import Status
from fsm_rollout.sample.branches import share_outcome
from fsm_rollout.tokens.chat import record_observation
from fsm_rollout.weights.partial_turn import join_spans, route_spans, shift_spans
from fsm_rollout.weights.resume_state import RESUME_STATE_KEY

# ---------------------------------------------------------------------------------------------------------- guards


def budget_exhausted(ctx: RolloutContext) -> bool:
    """No response budget is left before the first turn (nothing may be generated)."""
    remaining = ctx.remaining_budget
    return remaining is not None and remaining <= 0


def server_aborted(ctx: RolloutContext) -> bool:
    """The engine ended the turn with ``abort``/``cancelled``."""
    return ctx.turn is not None and ctx.turn.finish == "abort"


def stop_eos_due(ctx: RolloutContext) -> bool:
    """The turn stopped on a stop string and a masked EOS must follow it."""
    return ctx.eos_due


def no_budget_for_stop_eos(ctx: RolloutContext) -> bool:
    """A masked EOS is due but the turn used the last of the budget."""
    remaining = ctx.remaining_budget
    if not ctx.eos_due or remaining is None or ctx.turn is None:
        return False
    return remaining - len(ctx.turn.token_ids) <= 0


def finished_by_length(ctx: RolloutContext) -> bool:
    """The turn hit the rollout's token limit (the environment is then not stepped). A turn cut by a per-call
    limit the environment asked for (``call_max_tokens``, a gateway agent's ``max_tokens``) is an ordinary turn."""
    if ctx.turn is None or ctx.turn.finish != "length":
        return False
    return ctx.call_max_tokens is None or len(ctx.turn.token_ids) < ctx.call_max_tokens


def session_closed(ctx: RolloutContext) -> bool:
    """The agent closed its gateway session (the step's ``end``)."""
    return ctx.step is not None and ctx.step.end is EndReason.SESSION_CLOSED


def agent_idle(ctx: RolloutContext) -> bool:
    """The agent was idle past its gateway session's limit (the step's ``end``)."""
    return ctx.step is not None and ctx.step.end is EndReason.AGENT_TIMEOUT


def env_truncated(ctx: RolloutContext) -> bool:
    """The environment ended the episode by cutting it short (a step ``done`` and ``truncated``)."""
    return ctx.step is not None and ctx.step.done and ctx.step.truncated


def env_done(ctx: RolloutContext) -> bool:
    """The environment said the episode is done."""
    return ctx.step is not None and ctx.step.done


def turn_limit_reached(ctx: RolloutContext) -> bool:
    """This was the last turn ``max_turns`` allows."""
    return ctx.turn_index + 1 >= ctx.deps.config.max_turns


def suspension_due(ctx: RolloutContext) -> bool:
    """The generate activity met a closed weight-update gate (before sending, or its request was cut)."""
    return ctx.suspend_due


def hand_back_due(ctx: RolloutContext) -> bool:
    """The resume activity was told the caller takes the suspended sample back."""
    return ctx.hand_back_due


def history_rewritten(ctx: RolloutContext) -> bool:
    """The observation's re-render does not extend the tokens so far (fork / per_turn, or a gateway agent's
    rewrite): the sequence so far closes and the re-render opens the next one."""
    return ctx.fork_prompt is not None


def compacted(ctx: RolloutContext) -> bool:
    """The fork is a gateway agent's compaction (its call replaced earlier turns by a summary): the fork's reason
    is ``compacted``."""
    return ctx.fork_prompt is not None and fork_reason(ctx) == "compacted"


def oversampled(ctx: RolloutContext) -> bool:
    """The abort is a runner's over-sampling ending a surplus group (reason
    :data:`~fsm_rollout.machine.lifecycle.OVERSAMPLED`)."""
    return ctx.stop_reason == lifecycle.OVERSAMPLED


def agent_disconnected(ctx: RolloutContext) -> bool:
    """The abort is a gateway agent's disconnect (reason :data:`~fsm_rollout.machine.lifecycle.AGENT_DISCONNECTED`):
    the cut turn's tokens generated so far are kept."""
    return ctx.stop_reason == lifecycle.AGENT_DISCONNECTED


def observation_exceeds_budget(ctx: RolloutContext) -> bool:
    """The observation tokens would leave no budget for another turn."""
    remaining = ctx.remaining_budget
    return remaining is not None and len(ctx.observation_tokens) >= remaining


# --------------------------------------------------------------------------------------------------------- actions


def record_outcome(ctx: RolloutContext, dest: str, reason: str | None) -> None:
    if reason is None:
        reason = "error" if dest == "failed" else (ctx.stop_reason or "cancelled")
    ctx.reason = reason
    ctx.sample.status = Status(dest)
    ctx.sample.metadata["rollout_reason"] = reason
    share_outcome(ctx.sample)


def start_response(ctx: RolloutContext) -> None:
    assert ctx.rendered is not None
    sample = ctx.sample
    sample.tokens = list(ctx.rendered.token_ids)
    sample.loss_mask = []
    sample.rollout_log_probs = []
    sample.response_length = 0
    ctx.prompt_length = len(sample.tokens)
    ctx.budget = response_budget(
        ctx.deps.params["max_tokens"], ctx.deps.config.rollout_max_context_len, ctx.prompt_length
    )
    gate = ctx.deps.gate  # without a gate: no version, no updates
    version = gate.weight_version
    if version is not None:
        sample.metadata["start_weight_version"] = version
    ctx.start_epoch = gate.weight_updates


def append_turn(ctx: RolloutContext) -> None:
    turn = ctx.turn
    assert turn is not None
    config = ctx.deps.config
    offset = ctx.sample.response_length
    routes = route_spans(turn, len(ctx.sample.tokens), ctx.deps.gate.weight_version)
    ctx.sample.append_response_tokens(
        turn.token_ids,
        turn.logprobs,
        trainable=True,
        meta=turn.meta,
        expert_dims=config.expert_dims,
        track_spec_stats=config.track_speculative_stats,
    )
    ctx.response_token_ids.extend(turn.token_ids)
    next_call = ctx.step.next_call if ctx.step is not None else None
    if next_call is not None and next_call.sampling.get("structured_outputs") is not None and turn.token_ids:
        # sampled under a grammar's mask (logprobs are the masked distribution's): a trainer must know which
        constrained = ctx.sample.metadata.setdefault("constrained_spans", [])
        constrained.append({"start": offset, "end": offset + len(turn.token_ids)})
    if routes and ctx.sample.rollout_routed_experts is not None:  # the rows the sample now holds, by request
        ctx.sample.metadata["routed_expert_spans"] = [
            {"request_id": request_id, "weight_version": version, "start": start, "end": end}
            for request_id, version, start, end in routes
        ]
    if ctx.turn_spans:
        spans = ctx.sample.metadata.setdefault("weight_version_spans", [])
        joined = join_spans(
            [(span["version"], span["start"], span["end"]) for span in spans[-1:]], shift_spans(ctx.turn_spans, offset)
        )
        spans[-1:] = [{"version": v, "start": start, "end": end} for v, start, end in joined]


def append_stop_eos(ctx: RolloutContext) -> None:
    eos = ctx.deps.encoder.eos_token_id
    assert eos is not None
    ctx.sample.append_response_tokens([eos], trainable=False)


def note_stop_eos_truncation(ctx: RolloutContext) -> None:
    ctx.sample.metadata["multiturn_truncation"] = {
        "reason": "insufficient_budget_for_stop_eos",
        "remaining_budget": ctx.remaining_budget,
    }


def note_observation_truncation(ctx: RolloutContext) -> None:
    ctx.sample.metadata["multiturn_truncation"] = {
        "reason": "insufficient_budget_for_next_turn",
        "observation_tokens": len(ctx.observation_tokens),
        "remaining_budget": ctx.remaining_budget,
    }


def append_observation(ctx: RolloutContext) -> None:
    sample = ctx.sample
    start = sample.response_length
    sample.append_response_tokens(ctx.observation_tokens, trainable=False)
    record_observation(sample.metadata, ctx.observation_messages, start=start, end=sample.response_length)
    ctx.observation_messages = []  # consumed: the sample's metadata holds them now
    if ctx.observation_features is not None:  # its images join the features every later request carries
        ctx.rendered = with_observation_features(ctx.rendered, ctx.observation_features)
        ctx.observation_features = None


def next_turn(ctx: RolloutContext) -> None:
    ctx.turn_index += 1


def note_abort(ctx: RolloutContext) -> None:
    """Nothing to undo: an aborted turn's tokens were never appended; the partial turn is dropped."""
    ctx.partial_turn = []


def keep_streamed_turn(ctx: RolloutContext) -> None:
    """The agent went away mid-turn: the tokens the policy sampled for it so far (a suspension's partial turn, then
    what the request in flight streamed before its abort) are appended as generated (loss mask 1, their logprobs),
    and noted in ``metadata["disconnected_turn"]``. The turn is not stepped: the environment never sees it."""
    token_ids = [token for part in ctx.partial_turn for token in part.token_ids]
    logprobs = [value for part in ctx.partial_turn for value in part.logprobs]
    streamed_ids, streamed_logprobs = ctx.streamed
    if len(streamed_logprobs) == len(streamed_ids):  # a stream without logprobs cannot be trained on: left out
        token_ids += streamed_ids
        logprobs += streamed_logprobs
    ctx.streamed = ([], [])
    remaining = ctx.remaining_budget
    if remaining is not None:  # never over the budget (a suspension's parts were within it already)
        token_ids, logprobs = token_ids[: max(remaining, 0)], logprobs[: max(remaining, 0)]
    start = ctx.sample.response_length
    if token_ids:
        ctx.sample.append_response_tokens(token_ids, logprobs, trainable=True)
        ctx.response_token_ids.extend(token_ids)
        version = ctx.deps.gate.weight_version
        if version is not None and "weight_version_spans" in ctx.sample.metadata:
            spans = ctx.sample.metadata["weight_version_spans"]
            joined = join_spans(
                [(span["version"], span["start"], span["end"]) for span in spans[-1:]],
                [(version, start, start + len(token_ids))],
            )
            spans[-1:] = [{"version": v, "start": s, "end": e} for v, s, e in joined]
    ctx.sample.metadata["disconnected_turn"] = {"start": start, "end": start + len(token_ids), "turn": ctx.turn_index}


def note_timeout(ctx: RolloutContext) -> None:
    """``metadata["rollout_timeout"]`` was written when the limit ran out; the partial turn is dropped."""
    ctx.partial_turn = []


def hold_partial_turn(ctx: RolloutContext) -> None:
    """The partial turn stays in ``partial_turn`` until the rollout resumes (the driver stops its clock)."""
    ctx.suspend_due = False
    ctx.suspensions += 1
    ctx.suspend_reason = ctx.deps.gate.reason


def hand_back(ctx: RolloutContext) -> None:
    """The suspended sample goes back to its caller: the context, with the environment's snapshot, becomes its
    ``metadata["resume_state"]`` (the arrival in ``aborted`` then closes the environment)."""
    ctx.hand_back_due = False
    ctx.status_before_hand_back = Status(ctx.sample.status).value
    env = ctx.env
    if env is not None:  # else it was never rebuilt since a resume: the snapshot it came with still holds
        take_snapshot = getattr(env, "snapshot", None)
        ctx.env_snapshot = ctx.env_snapshot_error = None
        if callable(take_snapshot):
            try:
                ctx.env_snapshot = take_snapshot()
            except Exception as error:  # the resume needs it: say why it cannot happen
                ctx.env_snapshot_error = f"{type(error).__name__}: {error}"
        else:
            ctx.env_snapshot_error = f"{type(env).__name__} has no snapshot()"
    ctx.sample.metadata[RESUME_STATE_KEY] = ctx.to_json()


def finalize(ctx: RolloutContext) -> None:
    deps = ctx.deps
    features = ctx.rendered.generate_body.get("features") if ctx.rendered is not None else None
    train_inputs = decode_train_features(features, sample_id=ctx.sample_id)
    validate_image_tokens(
        ctx.sample.tokens,
        deps.tokenizer,
        deps.processor,
        train_inputs,
        placeholder_token=deps.config.image_placeholder_token,
        merge_size=deps.config.image_merge_size,
        prompt_length=ctx.prompt_length,
        sample_id=ctx.sample_id,
    )
    ctx.sample.multimodal_train_inputs = train_inputs
    ctx.sample.response = deps.decode(ctx.response_token_ids[ctx.branch_start :])


def salvage_response(ctx: RolloutContext) -> None:
    """On failure keep what can be kept: the response text of the tokens generated so far (none before the
    response started: the sample's own is left as it was)."""
    if ctx.prompt_length is None:
        return
    try:
        ctx.sample.response = ctx.deps.decode(ctx.response_token_ids[ctx.branch_start :])
    except Exception as error:  # the sample's tokens stay; only the text is missing
        ctx.sample.metadata["response_decode_error"] = f"{type(error).__name__}: {error}"


def record_failure(ctx: RolloutContext) -> None:
    error = ctx.error
    ctx.sample.metadata["rollout_error"] = {
        "type": type(error).__name__,
        "message": str(error),
        "state": ctx.failed_state,
        "trigger": ctx.failed_trigger,
    }


def close_environment(ctx: RolloutContext) -> None:
    if ctx.env is None or ctx.env_closed:
        return
    ctx.env_closed = True
    closing = ctx.env.close()
    if inspect.isawaitable(closing):  # an async close: the driver awaits it once the rollout has ended
        ctx.closing = closing


def close_environment_after_error(ctx: RolloutContext) -> None:
    if ctx.env is None or ctx.env_closed:
        return
    ctx.env_closed = True
    close = getattr(ctx.env, "close", None)
    if not callable(close):
        return
    try:
        closing = close()
    except BaseException as close_error:
        ctx.sample.metadata["env_close_error"] = f"{type(close_error).__name__}: {close_error}"
        if ctx.error is not None and ctx.error is not close_error:
            ctx.error.__cause__ = close_error
        return
    if inspect.isawaitable(closing):
        ctx.closing = closing


# The fork edge's guard and actions are the history policies' (fsm_rollout.rollout.history), named here with the rest.
_FORK_STEPS = (fork_exceeds_budget, fork_history, note_fork_truncation)

GUARDS: dict[str, Callable[[RolloutContext], bool]] = {
    name: globals()[name] for name in sorted(lifecycle.guard_names())
}
ACTIONS: dict[str, Callable[..., None]] = {
    name: globals()[name] for name in sorted(lifecycle.action_names() | {"record_outcome"})
}
MACHINE = lifecycle.build_machine(GUARDS, ACTIONS)


def state_trigger(ctx: RolloutContext) -> str:
    """The trigger the state fires once its activity is done: the first of its outcomes whose guard holds, else its
    own (the table's :attr:`~fsm_rollout.machine.lifecycle.StateSpec.outcomes`)."""
    spec = lifecycle.STATE_BY_NAME[ctx.state]
    for guard, trigger in spec.outcomes:
        if GUARDS[guard](ctx):
            return trigger
    assert spec.trigger is not None
    return spec.trigger


__all__ = ["ACTIONS", "GUARDS", "MACHINE", "state_trigger", *GUARDS, *ACTIONS]
