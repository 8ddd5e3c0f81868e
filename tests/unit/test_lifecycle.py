"""The transition table as a graph: reachable, always able to end, and unambiguous."""

from __future__ import annotations

from collections import defaultdict

import pytest

from fsm_rollout.machine import lifecycle
from fsm_rollout.rollout.steps import MACHINE


def successors() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in lifecycle.TRANSITIONS:
        graph[edge.source].add(edge.dest)
    return graph


def reachable_from(start: str) -> set[str]:
    graph, seen, todo = successors(), {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_pending() -> None:
    assert reachable_from(lifecycle.INITIAL) == {state.name for state in lifecycle.STATES}


@pytest.mark.parametrize("state", lifecycle.NON_TERMINAL)
def test_every_non_terminal_state_can_reach_every_terminal_state(state: str) -> None:
    assert reachable_from(state) >= lifecycle.TERMINAL


def test_terminal_states_have_no_outgoing_edges() -> None:
    assert not {edge.source for edge in lifecycle.TRANSITIONS} & lifecycle.TERMINAL


def test_the_seed_outcomes_are_all_reachable_in_the_normal_flow() -> None:
    reasons = {edge.reason for edge in lifecycle.TRANSITIONS if edge.reason and edge.dest in lifecycle.TERMINAL}
    assert reasons == {
        "budget_exhausted",
        "insufficient_budget_for_next_turn",
        "server_abort",
        "insufficient_budget_for_stop_eos",
        "length",
        "env_done",
        "env_truncated",  # the environment cut the episode short (a Gymnasium/GEM time limit)
        "max_turns",
        "env_timeout",  # the library's limits (not the seed's): an environment call, a rollout's wall time
        "rollout_timeout",
        "handed_back",  # a suspended sample going back to its caller (partial_rollout)
        # an agent gateway session: the agent closed it or went idle
        "session_closed",
        "agent_timeout",
        "oversampled",  # a surplus group of an over-sampled batch, ended once the target was reached
        "agent_disconnected",  # a gateway agent gone mid-call past the disconnect grace: the cut turn is kept
    }
    # a rewritten history (a fork policy's re-render, or a gateway agent's call) closes a sequence, not the rollout
    rewritten = [edge for edge in lifecycle.TRANSITIONS if edge.reason == "history_rewritten"]
    assert [(edge.trigger, edge.source, edge.dest) for edge in rewritten] == [("fork", "observing", "rendered")]


@pytest.mark.parametrize("state", lifecycle.NON_TERMINAL)
def test_each_phase_trigger_ends_with_an_unguarded_default(state: str) -> None:
    trigger = lifecycle.STATE_BY_NAME[state].trigger
    edges = [edge for edge in lifecycle.TRANSITIONS if edge.source == state and edge.trigger == trigger]
    assert edges, f"{state} has no edge for its trigger {trigger}"
    assert edges[-1].guard is None
    assert all(edge.guard is not None for edge in edges[:-1])


@pytest.mark.parametrize("state", lifecycle.NON_TERMINAL)
def test_abort_and_fail_are_accepted_from_every_non_terminal_state(state: str) -> None:
    triggers = {(edge.trigger, edge.dest) for edge in lifecycle.TRANSITIONS if edge.source == state}
    assert ("abort", "aborted") in triggers
    assert ("fail", "failed") in triggers


def test_every_terminal_edge_carries_a_reason_except_abort_and_fail() -> None:
    for edge in lifecycle.TRANSITIONS:
        if edge.dest in lifecycle.TERMINAL and edge.trigger not in ("abort", "fail"):
            assert edge.reason, edge


def test_built_machine_mirrors_the_table() -> None:
    """An edge into a state that awaits activities (scoring, admission) is its trigger without a state change,
    then the machine's own ENTER along the same edge; every other edge is itself."""
    built = {
        (source, name, transition.dest)
        for name, event in MACHINE.events.items()
        for source, transitions in event.transitions.items()
        for transition in transitions
    }
    awaited = {edge for edge in lifecycle.TRANSITIONS if lifecycle.STATE_BY_NAME[edge.dest].awaits}
    assert {edge.dest for edge in awaited} == {"completed", "truncated", "generating"}
    assert built == {
        *((edge.source, edge.trigger, edge.dest) for edge in lifecycle.TRANSITIONS if edge not in awaited),
        *((edge.source, edge.trigger, None) for edge in awaited),
        *((edge.source, lifecycle.ENTER, edge.dest) for edge in awaited),
    }


def test_building_with_a_missing_implementation_names_it() -> None:
    with pytest.raises(ValueError, match="env_done"):
        lifecycle.build_machine({}, {})


def test_the_fork_edges_are_the_only_non_terminal_edges_with_a_reason() -> None:
    """A rewritten history is a named edge of the table: observing --fork--> rendered, reason history_rewritten, or
    compacted when a gateway agent's summary replaced earlier turns; a re-render too long for another turn ends the
    rollout instead, before either fork."""
    named = [edge for edge in lifecycle.TRANSITIONS if edge.reason and edge.dest not in lifecycle.TERMINAL]
    assert [(edge.source, edge.trigger, edge.dest, edge.reason) for edge in named] == [
        ("observing", "fork", "rendered", "compacted"),
        ("observing", "fork", "rendered", "history_rewritten"),
    ]
    forks = [edge for edge in lifecycle.TRANSITIONS if edge.trigger == "fork"]
    assert [(edge.dest, edge.guard) for edge in forks] == [
        ("truncated", "fork_exceeds_budget"),
        ("rendered", "compacted"),
        ("rendered", None),
    ]
    assert len({edge.actions for edge in forks[1:]}) == 1  # both close the sequence alike; only the reason differs


def test_only_a_turn_in_progress_has_a_disconnect_edge_and_it_comes_before_the_other_aborts() -> None:
    for state in lifecycle.NON_TERMINAL:
        aborts = [edge for edge in lifecycle.TRANSITIONS if edge.trigger == "abort" and edge.source == state]
        guards = [edge.guard for edge in aborts]
        if state in ("generating", "suspended"):
            assert guards == ["agent_disconnected", "oversampled", None]
            assert aborts[0].actions[0] == "keep_streamed_turn" and aborts[0].reason == lifecycle.AGENT_DISCONNECTED
        else:  # no turn in progress: nothing to keep, the caller's edge records the reason
            assert guards == ["oversampled", None]
