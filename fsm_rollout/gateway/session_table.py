"""A gateway session's lifecycle as data: its states, triggers, guards and actions by name, and the machine.

Read it like the rollout's table (:mod:`fsm_rollout.machine.lifecycle`): each trigger's edges from a state are tried in
order, the first whose guard holds is taken, and its actions run as part of the transition. Each lineage of a session
(:class:`~fsm_rollout.gateway.lineage.Lineage`) runs one machine of this table, the main lineage's being the session's
own; it fires ``call`` for each chat call of the agent on that lineage,
``answered`` when the rollout hands a turn to its environment, ``idle`` when the agent stays silent past the
session's limit, ``agent_gone`` when a call's client went away and no retry came within the disconnect grace,
``rollout_end`` when the session's rollout ended on its own, ``close`` when the session is closed
(by the agent or trainer) and ``shutdown`` when the gateway stops with the session open. A trigger with no edge is
refused: the caller answers the agent with the error that says why. Every transition is traced (event
``session_transition``) in the runner's trace, beside the rollout's own.

``fsm-rollout diagram`` draws this table as ``diagrams/gateway_session.mmd`` and ``.dot``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsm_rollout.machine.lifecycle import Edge, StateSpec

__all__ = [
    "INITIAL",
    "SESSION_EVENT",
    "STATES",
    "TERMINAL",
    "TRANSITIONS",
    "SessionMachine",
    "diagram_files",
    "dot",
    "mermaid",
]

SESSION_EVENT = "session_transition"
"""The trace event of a session's transition (a rollout's is ``transition``)."""

INITIAL = "waiting_for_first_call"

STATES: tuple[StateSpec, ...] = (
    StateSpec("waiting_for_first_call", doc="opened; no call yet (the idle limit runs)"),
    StateSpec("answering", doc="a call in flight: the rollout generates its answer"),
    StateSpec("waiting_for_agent", doc="answered; the rollout's step waits for the agent's next call"),
    StateSpec(
        "rollout_ended",
        doc="the rollout ended on its own (budget, abort, error); calls are refused, but after a context overflow a "
        "trimmed call starts a new sequence",
    ),
    StateSpec("closed", terminal=True, doc="closed by the agent or the trainer, or the gateway shut down"),
    StateSpec("expired", terminal=True, doc="the agent was silent past the idle limit"),
)

TERMINAL: frozenset[str] = frozenset(state.name for state in STATES if state.terminal)
_LIVE: tuple[str, ...] = tuple(state.name for state in STATES if not state.terminal)

TRANSITIONS: tuple[Edge, ...] = (
    Edge("call", "waiting_for_first_call", "answering", actions=("start_sequence",), work="the rollout starts"),
    Edge(
        "call",
        "answering",
        "answering",
        guard="is_retry",
        actions=("attach",),
        work="a retry of the call in flight attaches to it: both get its answer, nothing generated twice",
    ),
    Edge(
        "call",
        "waiting_for_agent",
        "waiting_for_agent",
        guard="is_retry",
        actions=("answer_again",),
        work="a retry of the last call: the same answer, nothing generated",
    ),
    Edge(
        "call",
        "waiting_for_agent",
        "answering",
        guard="history_rewritten",
        actions=("hand_rewrite",),
        work="the whole conversation is the observation; the rollout forks",
    ),
    Edge("call", "waiting_for_agent", "answering", actions=("hand_messages",), work="the new messages are observed"),
    Edge(
        "call",
        "rollout_ended",
        "rollout_ended",
        guard="is_retry",
        actions=("answer_again",),
        work="a retry of the last call is still answered",
    ),
    Edge(
        "call",
        "rollout_ended",
        "answering",
        guard="over_context",
        actions=("restart_sequence",),
        work="the sequence ended over the context: the agent's trimmed call starts a new one (the old one is kept)",
    ),
    Edge("answered", "answering", "waiting_for_agent", actions=("deliver_answer",), work="the call gets the turn"),
    Edge(
        "idle",
        "waiting_for_first_call",
        "expired",
        reason="agent_timeout",
        actions=("forget",),
        work="no training sequence; the gateway forgets the session",
    ),
    Edge("idle", "waiting_for_agent", "expired", reason="agent_timeout", work="the rollout ends truncated, data kept"),
    *(
        Edge(
            "agent_gone",
            state,
            "rollout_ended",
            reason="agent_disconnected",
            actions=("abort_disconnected",),
            work="the disconnected call's retry did not come within the grace: the rollout is aborted",
        )
        for state in ("answering", "waiting_for_agent")
    ),
    Edge(
        "rollout_end", "answering", "rollout_ended", actions=("settle_call",), work="the call gets the cut turn or why"
    ),
    Edge("rollout_end", "waiting_for_agent", "rollout_ended", actions=("settle_call",)),
    Edge("close", "waiting_for_first_call", "closed", work="no training sequence"),
    Edge("close", "waiting_for_agent", "closed", actions=("hand_close",), work="the rollout ends completed"),
    Edge("close", "rollout_ended", "closed"),
    *(
        Edge(
            "shutdown",
            state,
            "closed",
            reason="shutdown",
            actions=("abort_rollout",),
            work="the gateway stops: the rollout ends aborted (shutdown)",
        )
        for state in _LIVE
    ),
)


_GUARDS = frozenset(edge.guard for edge in TRANSITIONS if edge.guard is not None)
_ACTIONS = frozenset(action for edge in TRANSITIONS for action in edge.actions)


def guard_names() -> frozenset[str]:
    return _GUARDS


def action_names() -> frozenset[str]:
    return _ACTIONS


_EDGES: dict[tuple[str, str], list[Edge]] = {}
for _edge in TRANSITIONS:
    _EDGES.setdefault((_edge.source, _edge.trigger), []).append(_edge)


class SessionMachine:
    """Runs :data:`TRANSITIONS` for one session: ``guards`` and ``actions`` are its callables by name (checked
    against the table), ``emit`` gets each transition's trace fields (None: not traced)."""

    def __init__(
        self,
        guards: Mapping[str, Callable[[], bool]],
        actions: Mapping[str, Callable[[], None]],
        *,
        fields: Mapping[str, Any],
        emit: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        # the table is checked once per session: a missing callable fails the first call, not a later one
        missing = sorted((_GUARDS - guards.keys()) | (_ACTIONS - actions.keys()))
        if missing:
            raise ValueError(f"the session table references unknown guards/actions: {missing}")
        self.state = INITIAL
        self._guards = guards
        self._actions = actions
        self._fields = dict(fields)
        self._emit = emit

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def can(self, trigger: str) -> bool:
        """Whether ``trigger`` has an edge from the current state (its guards are not evaluated)."""
        return (self.state, trigger) in _EDGES

    def fire(self, trigger: str) -> bool:
        """Take the first edge of ``trigger`` from the current state whose guard holds; False when none does."""
        for edge in _EDGES.get((self.state, trigger), ()):
            if edge.guard is None or self._guards[edge.guard]():
                src = self.state
                for action in edge.actions:
                    self._actions[action]()
                self.state = edge.dest
                if self._emit is not None:
                    event = {**self._fields, "trigger": trigger, "src": src, "dst": edge.dest}
                    if edge.reason is not None:
                        event["reason"] = edge.reason
                    self._emit(event)
                return True
        return False


# ---------------------------------------------------------------------------------------------------- diagrams

_HEADER = "Generated by `fsm-rollout diagram` from the table in fsm_rollout/gateway/session_table.py. Do not edit."


def _label(edge: Edge) -> str:
    label = edge.trigger
    if edge.guard is not None:
        label += f" [{edge.guard}]"
    if edge.actions:
        label += " / " + ", ".join(edge.actions)
    return label


def mermaid() -> str:
    """The Mermaid ``stateDiagram-v2`` text of the session table."""
    lines = [f"%% {_HEADER}", "stateDiagram-v2", f"    [*] --> {INITIAL}"]
    lines.extend(f"    {state.name} : {state.doc.replace(';', ',')}" for state in STATES)
    lines.extend(f"    {edge.source} --> {edge.dest} : {_label(edge)}" for edge in TRANSITIONS)
    lines.extend(f"    {state.name} --> [*]" for state in STATES if state.terminal)
    return "\n".join(lines) + "\n"


def dot() -> str:
    """The Graphviz DOT text of the session table."""
    lines = [f"// {_HEADER}", "digraph gateway_session {", "    rankdir=LR;", '    node [shape=box, style="rounded"];']
    lines.append('    __start__ [shape=point, label=""];')
    for state in STATES:
        shape = ", peripheries=2" if state.terminal else ""
        lines.append(f'    {state.name} [label="{state.name}\\n{state.doc}"{shape}];')
    lines.append(f"    __start__ -> {INITIAL};")
    lines.extend(f'    {edge.source} -> {edge.dest} [label="{_label(edge)}"];' for edge in TRANSITIONS)
    lines.append("}")
    return "\n".join(lines) + "\n"


def diagram_files() -> dict[str, str]:
    """The files ``fsm-rollout diagram`` writes for this table, by name in ``diagrams/``."""
    return {"gateway_session.mmd": mermaid(), "gateway_session.dot": dot()}
