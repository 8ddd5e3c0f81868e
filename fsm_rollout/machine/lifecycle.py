"""The rollout lifecycle as data: states, triggers, guards and actions by name, and the machine built from it.

Read this module like an XState machine config. Each non-terminal state names the work the driver does while the
sample sits in it (``activity``; the I/O happens there) and the one trigger it fires when that work is done. Each
trigger's edges are listed in order: the first edge whose guard holds is taken, and the last one has no guard.
Guards are pure predicates over the rollout's context; actions change the sample. Their implementations live in
:mod:`fsm_rollout.rollout.steps`, which hands them to :func:`build_machine` by name.

A state's activity reports what happened in the context, and the state's ``outcomes`` (guard, trigger pairs) decide
on it which trigger follows: ``generating`` fires ``suspend`` when ``suspension_due``, ``suspended`` fires
``hand_back`` when ``hand_back_due``, ``observing`` fires ``fork`` when ``history_rewritten``; else the state's own.

``fork`` is the ``observing`` state's other exit, taken under the ``fork`` and ``per_turn`` history
policies (:mod:`fsm_rollout.rollout.history`): the engine's re-render of the conversation does not extend the
tokens so far (``per_turn``: always), so the sequence so far closes into ``sample.branches`` and the re-render is
the prompt of the next one; from ``rendered`` the ``generate`` edges apply as after the first render. A gateway
agent that rewrote the history takes it too, under any policy (:func:`fsm_rollout.rollout.history.rewrite_history`),
with the reason ``compacted`` instead when its call replaced earlier turns by a summary (guard ``compacted``).

``suspend`` is an outcome of ``generating``: a weight update closed the rollout's gate while it was generating, or
as it was about to. ``env_timeout`` and ``rollout_timeout`` (a limit of the config ran out), ``abort`` and ``fail``
are the driver's, and interrupt the state's own trigger. ``hand_back`` (an outcome of ``suspended``) is the gate's
choice: a suspended sample goes back to its caller (slime/vime's ``partial_rollout``) instead of waiting for the
resume; it ends ``aborted`` with the reason ``handed_back``, its resume state in ``metadata["resume_state"]`` and
its environment closed (a resume rebuilds it from its snapshot). An abort by a runner's over-sampling
(``target_groups``/``oversample``) takes ``abort``'s guarded edge, with the typed reason ``oversampled``; so does a
gateway agent's disconnect (reason ``agent_disconnected``), whose edge keeps the cut turn's tokens generated so far.

A state may name activities awaited on the way in (``awaits``): ``completed`` and ``truncated`` are scored
(``score``: ``RolloutConfig.reward_fn``, sync or async, sets ``sample.reward``), and every edge into
``generating`` waits for the engine's admission of its request (``admit_request``: under ``admission="adaptive"``,
:mod:`fsm_rollout.runtime.admission`; at once otherwise). On every edge into such a state the
machine tries the guards once, runs the edge's actions and notes the edge (``entering``) without leaving the source;
the driver awaits the activities, then fires :data:`ENTER`, which completes that same edge. An error in them fails
the rollout from the source state, its data so far kept; a stop while awaiting them leaves from the source state.

Every edge into a terminal state runs the edge's actions, then records the outcome (the state as the sample's
status, and the edge's ``reason``; ``abort`` takes the caller's reason, ``fail`` the reason ``error``), then the
terminal state's arrival actions (finalize the sample, close the environment), all as part of the transition:
if one of them raises, the transition is not taken and the rollout fails instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from transitions import Machine

from fsm_rollout.machine import lean_machine
from fsm_rollout.machine.lean_machine import LeanCondition, LeanEvent, LeanState, LeanTransition, LifecycleMachine

__all__ = [  # the lean classes are re-exported: they used to live here
    "AGENT_DISCONNECTED",
    "ENTER",
    "INITIAL",
    "NON_TERMINAL",
    "OVERSAMPLED",
    "STATES",
    "STATE_BY_NAME",
    "TERMINAL",
    "TRANSITIONS",
    "TRIGGERS",
    "Edge",
    "LeanCondition",
    "LeanEvent",
    "LeanState",
    "LeanTransition",
    "LifecycleMachine",
    "StateSpec",
    "action_names",
    "activity_names",
    "build_machine",
    "guard_names",
]


@dataclass(frozen=True)
class StateSpec:
    """A lifecycle state: the driver's activity in it and the trigger fired after, or its arrival actions.

    ``doc`` says in a few words what the state means or, for a state with an activity, what that activity does
    (the README's lifecycle table shows it on the edges into the state).
    """

    name: str
    activity: tuple[str, ...] = ()
    trigger: str | None = None
    terminal: bool = False
    on_arrival: tuple[str, ...] = ()
    doc: str = ""
    outcomes: tuple[tuple[str, str], ...] = ()
    """``(guard, trigger)`` pairs tried in order once the activity is done: the first whose guard holds (on what the
    activity reported) names the trigger fired instead of ``trigger``."""
    awaits: tuple[str, ...] = ()
    """Activities awaited on every edge into the state, after the edge's actions, before the outcome is recorded."""


@dataclass(frozen=True)
class Edge:
    """One guarded transition: ``trigger`` moves ``source`` to ``dest`` when ``guard`` holds (None: always).

    ``work`` says in a few words what taking the edge does to the sample (its actions, or what it skips), for the
    README's lifecycle table.
    """

    trigger: str
    source: str
    dest: str
    guard: str | None = None
    actions: tuple[str, ...] = ()
    reason: str | None = None
    work: str = ""


INITIAL = "pending"

OVERSAMPLED = "oversampled"
"""The typed reason of a surplus group's samples, ended once a runner's over-sampled batch has its target of
groups (``run_batch(..., target_groups=N, oversample=M)``): an abort with this reason takes its own edge."""

AGENT_DISCONNECTED = "agent_disconnected"
"""The typed reason of a gateway sequence whose agent went away mid-call and did not retry within the disconnect
grace: an abort with this reason while generating (or suspended) takes its own edge, which keeps the tokens of the
cut turn that were already streamed to the agent (they were sampled by the policy and seen: loss mask 1)."""

ENTER = "enter"
"""The machine's own trigger that completes an edge whose destination awaits activities (not a trigger of the
table: the trace names the edge's trigger)."""

STATES: tuple[StateSpec, ...] = (
    StateSpec(
        "pending",
        activity=("open_environment", "request_render"),
        trigger="render",
        doc="build and reset the environment, render the prompt (one HTTP call)",
    ),
    StateSpec("rendered", trigger="generate", doc="prompt tokens and response budget known"),
    StateSpec(
        "generating",
        activity=("request_turn",),
        trigger="step",
        outcomes=(("suspension_due", "suspend"),),
        awaits=("admit_request",),
        doc="one generate request in flight, its answer parsed and validated",
    ),
    StateSpec(
        "suspended",
        activity=("await_resume",),
        trigger="resume",
        outcomes=(("hand_back_due", "hand_back"),),
        doc="waiting out a weight update; the partial turn is kept",
    ),
    StateSpec("stepping", activity=("step_environment",), trigger="observe", doc="`env.step(text)`"),
    StateSpec(
        "observing",
        activity=("encode_observation",),
        trigger="generate",
        outcomes=(("history_rewritten", "fork"),),
        doc="`format_observation`, text/image check, boundary tokens (images: one engine render; fork, per_turn: "
        "the engine's re-render, compared)",
    ),
    StateSpec("completed", terminal=True, awaits=("score",), on_arrival=("finalize", "close_environment")),
    StateSpec("truncated", terminal=True, awaits=("score",), on_arrival=("finalize", "close_environment")),
    StateSpec("aborted", terminal=True, on_arrival=("finalize", "close_environment")),
    StateSpec(
        "failed", terminal=True, on_arrival=("record_failure", "salvage_response", "close_environment_after_error")
    ),
)

NON_TERMINAL: tuple[str, ...] = tuple(state.name for state in STATES if not state.terminal)
TERMINAL: frozenset[str] = frozenset(state.name for state in STATES if state.terminal)

TRANSITIONS: tuple[Edge, ...] = (
    Edge(
        "render",
        "pending",
        "rendered",
        actions=("start_response",),
        work="the response is started, the budget computed",
    ),
    Edge(
        "generate", "rendered", "truncated", guard="budget_exhausted", reason="budget_exhausted", work="no request sent"
    ),
    Edge("generate", "rendered", "generating"),
    Edge(
        "generate",
        "observing",
        "truncated",
        guard="observation_exceeds_budget",
        reason="insufficient_budget_for_next_turn",
        actions=("note_observation_truncation",),
        work="nothing appended",
    ),
    Edge(
        "generate",
        "observing",
        "generating",
        actions=("append_observation", "next_turn"),
        work="observation appended (mask 0), next turn",
    ),
    Edge(
        "fork",
        "observing",
        "truncated",
        guard="fork_exceeds_budget",
        reason="insufficient_budget_for_next_turn",
        actions=("note_fork_truncation",),
        work="the re-render leaves no budget for another turn; nothing forked",
    ),
    Edge(
        "fork",
        "observing",
        "rendered",
        guard="compacted",
        reason="compacted",
        actions=("fork_history",),
        work="a gateway agent compacted its history (a summary replaced earlier turns): the sequence so far closes "
        "into `sample.branches`; the engine's render of the call is the new prompt",
    ),
    Edge(
        "fork",
        "observing",
        "rendered",
        reason="history_rewritten",
        actions=("fork_history",),
        work="the sequence so far closes into `sample.branches`; the engine's re-render is the new prompt",
    ),
    Edge(
        "suspend",
        "generating",
        "suspended",
        actions=("hold_partial_turn",),
        work="the request in flight is aborted at the engine; the tokens it produced are kept as the partial turn",
    ),
    Edge(
        "resume",
        "suspended",
        "generating",
        work="the same turn continues: its tokens so far are sent, `max_tokens` is what the budget has left",
    ),
    Edge(
        "hand_back",
        "suspended",
        "aborted",
        reason="handed_back",
        actions=("hand_back",),
        work="back to the caller (`partial_rollout`): the resume state is kept, the environment snapshotted and closed",
    ),
    Edge(
        "step",
        "generating",
        "aborted",
        guard="server_aborted",
        reason="server_abort",
        work="that turn's tokens are dropped",
    ),
    Edge(
        "step",
        "generating",
        "truncated",
        guard="no_budget_for_stop_eos",
        reason="insufficient_budget_for_stop_eos",
        actions=("append_turn", "note_stop_eos_truncation"),
        work="turn appended, no EOS",
    ),
    Edge(
        "step",
        "generating",
        "truncated",
        guard="finished_by_length",
        reason="length",
        actions=("append_turn",),
        work="turn appended; the environment is not stepped",
    ),
    Edge(
        "step",
        "generating",
        "stepping",
        guard="stop_eos_due",
        actions=("append_turn", "append_stop_eos"),
        work="turn appended, then the masked EOS",
    ),
    Edge("step", "generating", "stepping", actions=("append_turn",), work="turn appended"),
    Edge(
        "observe",
        "stepping",
        "completed",
        guard="session_closed",
        reason="session_closed",
        work="the agent closed its gateway session",
    ),
    Edge(
        "observe",
        "stepping",
        "truncated",
        guard="agent_idle",
        reason="agent_timeout",
        work="the agent was idle past the gateway session's limit; the data so far is kept",
    ),
    Edge(
        "observe",
        "stepping",
        "truncated",
        guard="env_truncated",
        reason="env_truncated",
        work="the environment cut the episode short (a step `truncated`: a Gymnasium/GEM time limit)",
    ),
    Edge("observe", "stepping", "completed", guard="env_done", reason="env_done"),
    Edge(
        "observe",
        "stepping",
        "truncated",
        guard="turn_limit_reached",
        reason="max_turns",
        work="no observation appended",
    ),
    Edge("observe", "stepping", "observing"),
    *(
        Edge(
            "env_timeout",
            state,
            "truncated",
            reason="env_timeout",
            actions=("note_timeout",),
            work="an environment call ran past `env_step_timeout_s`; the data so far is kept",
        )
        for state in ("pending", "stepping", "observing", "suspended")
    ),
    *(
        Edge(
            "rollout_timeout",
            state,
            "truncated",
            reason="rollout_timeout",
            actions=("note_timeout",),
            work="the rollout ran past `rollout_timeout_s` (time suspended excluded); the data so far is kept",
        )
        for state in NON_TERMINAL
    ),
    *(
        Edge(
            "abort",
            state,
            "aborted",
            guard="agent_disconnected",
            reason="agent_disconnected",
            actions=("keep_streamed_turn", "note_abort"),
            work="a gateway agent went away mid-call (no retry within the disconnect grace): the engine request is "
            "aborted; the turn's tokens generated so far (streamed, or held by a suspension) are kept, loss mask 1",
        )
        for state in ("generating", "suspended")
    ),
    *(
        Edge(
            "abort",
            state,
            "aborted",
            guard="oversampled",
            reason="oversampled",
            actions=("note_abort",),
            work="a surplus group of an over-sampled batch, ended once its target of groups was complete; the data so "
            "far is kept",
        )
        for state in NON_TERMINAL
    ),
    *(
        Edge(
            "abort",
            state,
            "aborted",
            actions=("note_abort",),
            work="the reason is the caller's (`cancelled`, `weight_update`, …)",
        )
        for state in NON_TERMINAL
    ),
    *(
        Edge("fail", state, "failed", work="reason `error`; the error is recorded, the sample's data so far is kept")
        for state in NON_TERMINAL
    ),
)
"""The transition table. ``abort`` takes the caller's reason (``cancelled``, ``weight_update``, ...)."""

STATE_BY_NAME: Mapping[str, StateSpec] = {state.name: state for state in STATES}
TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(edge.trigger for edge in TRANSITIONS))


def guard_names() -> frozenset[str]:
    """Every guard the table references (on edges, and on the states' outcomes)."""
    on_edges = {edge.guard for edge in TRANSITIONS if edge.guard is not None}
    return frozenset(on_edges | {guard for state in STATES for guard, _ in state.outcomes})


def action_names() -> frozenset[str]:
    """Every action the table references (edge actions, arrival actions and activities)."""
    names = {action for edge in TRANSITIONS for action in edge.actions}
    for state in STATES:
        names.update(state.on_arrival)
    return frozenset(names)


def activity_names() -> frozenset[str]:
    """Every activity the states reference (each state's own, and those awaited on the way into it)."""
    return frozenset(name for state in STATES for name in (*state.activity, *state.awaits))


def _note_entering(model: Any, *, index: int | None) -> None:
    model.entering = index


def _entering(model: Any, *, index: int) -> bool:
    return getattr(model, "entering", None) == index


def build_machine(
    guards: Mapping[str, Callable[[Any], bool]],
    actions: Mapping[str, Callable[..., None]],
    *,
    machine_class: type[Machine] | None = None,
) -> Machine:
    """Build the one shared ``transitions.Machine`` that runs every rollout of the process.

    ``machine_class`` defaults to :func:`fsm_rollout.machine.lean_machine.machine_class`: the lean
    :class:`~fsm_rollout.machine.lean_machine.LifecycleMachine` when the installed ``transitions`` is a verified
    version, else the plain ``transitions.Machine`` (with one warning per process).

    The machine holds no models: each rollout is passed to ``machine.events[trigger].trigger(rollout, rollout)``,
    keeps its own ``state`` attribute, and receives itself as the only argument of every guard and action. This
    costs O(1) per sample (``add_model`` is O(n) in the number of attached models) and nothing per transition
    beyond the synchronous machine.

    An edge into a state that awaits activities is two transitions of the machine: its trigger, guarded as in the
    table, runs the edge's actions and sets ``model.entering`` to the edge's index in :data:`TRANSITIONS` (the state
    stays); :data:`ENTER` then moves the model along that edge and clears ``entering``.

    ``actions["record_outcome"]`` is called with keywords ``dest`` and ``reason`` on every edge into a terminal
    state, after the edge's own actions and before the state's arrival actions.
    """
    missing = sorted((guard_names() - set(guards)) | ((action_names() | {"record_outcome"}) - set(actions)))
    if missing:
        raise ValueError(f"lifecycle table references unknown guards/actions: {missing}")
    named = sorted(name for name, func in (*guards.items(), *actions.items()) if not callable(func))
    if named:  # the lean machine calls them directly; it resolves no names
        raise TypeError(f"lifecycle guards/actions must be callables, not names: {named}")
    transitions: list[dict[str, Any]] = []
    for index, edge in enumerate(TRANSITIONS):
        arrive: list[Callable[..., None]] = []
        if edge.dest in TERMINAL:
            arrive.append(partial(actions["record_outcome"], dest=edge.dest, reason=edge.reason))
        arrive.extend(actions[name] for name in STATE_BY_NAME[edge.dest].on_arrival)
        spec: dict[str, Any] = {"trigger": edge.trigger, "source": edge.source, "dest": edge.dest}
        if edge.guard is not None:
            spec["conditions"] = [guards[edge.guard]]
        edge_actions = [actions[name] for name in edge.actions]
        if not STATE_BY_NAME[edge.dest].awaits:
            transitions.append({**spec, "before": [*edge_actions, *arrive]})
            continue
        # chosen by its guard, its actions run; the driver awaits the destination's activities, then ENTER ends it
        transitions.append({**spec, "dest": None, "before": [*edge_actions, partial(_note_entering, index=index)]})
        transitions.append(
            {
                "trigger": ENTER,
                "source": edge.source,
                "dest": edge.dest,
                "conditions": [partial(_entering, index=index)],
                "before": [partial(_note_entering, index=None), *arrive],
            }
        )
    if machine_class is None:
        machine_class = lean_machine.machine_class()
    return machine_class(
        model=None,
        states=[state.name for state in STATES],
        initial=INITIAL,
        transitions=transitions,
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,
    )
