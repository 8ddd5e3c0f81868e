"""One gateway session: an agent's calls, run as rollouts whose environment is the agent, one per lineage.

The first chat call's messages (and tools) are the prompt of a rollout. When the model has answered, the rollout
steps its environment, :class:`SessionEnvironment`, which accepts turns: its ``step(turn)`` hands the
:class:`~fsm_rollout.envs.step.Turn` to the waiting HTTP call and waits for the agent's next call; that call's new
messages are the observation, encoded like any other (boundary tokens, mask 0), and the next generate request
continues the same token sequence. Nothing the model generated is ever re-tokenized: the answer is read from the
turn's own tokens, and later calls are only checked against it by meaning (:mod:`fsm_rollout.gateway.conversation`).

A session may hold several chains of calls, **lineages** (a subagent, a title or summary side request, a second
agent: a call that continues no chain and whose system prompt or tools differ from every chain's, or that its
harness names so): each runs as its own rollout (:mod:`fsm_rollout.gateway.lineage`), calls to different lineages may
be in flight at once, and calls of one lineage are answered one at a time. Which lineage a call belongs to, and
whether a rewrite is a compaction, is :mod:`fsm_rollout.gateway.lineages`'s choice.

How a lineage's rollout ends is an edge of the lifecycle table, chosen by the step's typed ``end``
(:class:`~fsm_rollout.envs.step.EndReason`): the agent closed the session (``completed``, ``session_closed``) or
went idle past the limit (``truncated``, ``agent_timeout``). An agent that rewrote a lineage's history (edited,
dropped or compacted messages, changed tools) sends the whole conversation as the observation, and the rollout takes
the ``fork`` edge (reason ``history_rewritten``, or ``compacted`` when a summary replaced earlier turns): the sequence
so far closes into ``sample.branches`` and the engine's render of the conversation as sent is the next sequence's
prompt, so each generated token is trained in exactly one sequence and no sequence holds a token the model did not
see.

``close`` returns the session's training sequences: the main lineage's (``l0``) last sequence is the session's
sample and comes last; every other sequence (the main lineage's earlier ones, then each other lineage's, oldest
first) is one of its ``branches`` (:func:`fsm_rollout.sample.branches.training_sequences`), so every lineage shares
the session's rollout id, reward and group. Each sequence's ``metadata["lineage"]`` and ``["parent_lineage"]`` say
which chain it is; ``metadata["compaction_summary"]`` (with ``["compaction_summary_spans"]``) marks a sequence
holding a compaction's summary call.

The agent's per-call sampling settings reach that call's generate request as the step's ``next_call`` (the first
call's as the environment's ``reset`` result), so a tape holds them and a replay sends them; its ``max_tokens``
bounds the turn without ending the sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_rollout.envs.step import EndReason, StepResult, Turn
from fsm_rollout.gateway import session_table
from fsm_rollout.gateway.answers import TokenText
from fsm_rollout.gateway.lineage import DISCONNECTED, Lineage, LineageSettings
from fsm_rollout.gateway.lineages import hint, is_compaction, is_summary_request, route
from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer
from fsm_rollout.gateway.request_fields import capped_sampling
from fsm_rollout.gateway.stream_text import Listener
from fsm_rollout.sample import Sample
from fsm_rollout.sample.branches import training_sequences

if TYPE_CHECKING:
    from fsm_rollout.rollout.handle import RolloutHandle
    from fsm_rollout.runtime.runner import RolloutRunner

__all__ = ["DISCONNECTED", "GatewaySession", "SessionEnvironment", "TokenText"]


class SessionEnvironment:
    """The environment a lineage's rollout steps: the agent on the other side of the HTTP calls."""

    accepts_turn = True

    def __init__(self, session: GatewaySession, lineage: Lineage | None = None) -> None:
        self._lineage = lineage if lineage is not None else session.main

    def reset(self) -> StepResult:
        """The first call's sampling settings, for the first generate request (no call has come since)."""
        return StepResult(None, next_call=self._lineage.next_call())

    async def step(self, turn: Turn) -> StepResult:
        return await self._lineage.hand_over(turn)

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = list(observation)
        return messages

    def close(self) -> None:
        return None


class GatewaySession:
    """One agent session (see the module docstring). ``session_id`` and ``base_url`` are what the agent is given;
    :meth:`close` ends it and returns its training sequences. Each lineage's lifecycle is the table in
    :mod:`fsm_rollout.gateway.session_table`; the session's own state is its main lineage's."""

    def __init__(
        self,
        runner: RolloutRunner,
        session_id: str,
        base_url: str,
        *,
        index: int,
        metadata: Mapping[str, Any] | None = None,
        label: Any = None,
        idle_timeout_s: float | None = None,
        disconnect_grace_s: float = 30.0,
        on_closed: Callable[[GatewaySession], None] | None = None,
        token_text: TokenText | None = None,
        max_call_tokens: int | None = None,
    ) -> None:
        self.session_id = session_id
        self.base_url = base_url
        self.index = index
        self.metadata = dict(metadata or {})
        self.label = label
        self.idle_timeout_s = idle_timeout_s
        self.disconnect_grace_s = disconnect_grace_s
        self.max_call_tokens = max_call_tokens
        self.reward: Any = None
        self.calls = 0
        self._runner = runner
        self._text = token_text or TokenText(runner.tokenizer, runner.sampling_params)
        self._settings = LineageSettings(session_id, index, label, self.metadata, idle_timeout_s, disconnect_grace_s)
        self._on_closed = on_closed
        self._ended = asyncio.Event()
        self._closed_samples: list[Sample] | None = None
        self._shut = False  # closed or shut down: calls are refused
        self._lineages: list[Lineage] = [self._new_lineage(0, None, None)]
        self._reaper: asyncio.TimerHandle | None = None
        if idle_timeout_s is not None:  # a session never called has no rollout to time it out: a timer does
            self._reaper = asyncio.get_running_loop().call_later(idle_timeout_s, self._expire_if_never_called)

    def _new_lineage(self, number: int, key: str | None, parent: str | None) -> Lineage:
        return Lineage(
            self._runner, self._settings, number, text=self._text, on_forget=self._forget, key=key, parent=parent
        )

    @property
    def main(self) -> Lineage:
        """The session's first lineage (``l0``): the session's own state, rollout and sample are its."""
        return self._lineages[0]

    @property
    def lineages(self) -> tuple[Lineage, ...]:
        return tuple(self._lineages)

    @property
    def state(self) -> str:
        """The main lineage's state in :mod:`fsm_rollout.gateway.session_table`."""
        return self.main.state

    @property
    def call_sampling(self) -> dict[str, Any]:
        return self.main.call_sampling

    @property
    def waiting_calls(self) -> int:
        """HTTP calls waiting for an answer in flight now (calls and their clients' retries attached to them)."""
        return sum(lineage.waiting_calls for lineage in self._lineages)

    @property
    def rollout(self) -> RolloutHandle | None:
        """The handle of the main lineage's rollout (None before the first call)."""
        return self.main.rollout

    @property
    def closed(self) -> bool:
        """Closed, or expired before any call (an agent idle after calls leaves the session to be closed)."""
        return self._shut or (self.main.state == "expired" and not self.main.started)

    def environment(self, sample: Sample) -> SessionEnvironment:
        """The environment of the rollout of ``sample`` (one of the session's lineages')."""
        lineage = next((each for each in self._lineages if each.sample is sample), self.main)
        return SessionEnvironment(self, lineage)

    # ------------------------------------------------------------------ what the agent's calls do

    async def chat(
        self, call: ChatCall, *, idempotency_key: str | None = None, listener: Listener | None = None
    ) -> TurnAnswer:
        """Answer one chat call on the lineage it belongs to (:mod:`fsm_rollout.gateway.lineages`). A retry of the
        call in flight (or of the last one answered) is that call: it gets the same answer, nothing is generated
        twice. 409 when another call of the same lineage is in flight or the session has ended."""
        if self.closed:
            why = "expired before its first call (agent_timeout)" if self.main.state == "expired" else "closed"
            raise GatewayError(409, f"the session is {why}", code="session_closed")
        if self.max_call_tokens is not None:  # every dialect's call: its max tokens are resolved by now
            call = dataclasses.replace(call, sampling=capped_sampling(call.sampling, self.max_call_tokens))
        where = route(call, self._lineages)
        lineage = where.lineage
        if lineage is None:
            parent_key = hint(call, "parent_lineage_key") or hint(call, "parent_lineage")
            parent_key = None if parent_key is None else str(parent_key)
            parent = next(
                (each.id for each in self._lineages if parent_key is not None and each.key == parent_key), None
            )
            lineage = self._new_lineage(len(self._lineages), where.key, parent)
            self._lineages.append(lineage)
        self.calls += 1
        lineage.last_called = self.calls
        compacted = False
        found = where.found
        if found is not None and found.kind == "rewritten" and lineage.state == "waiting_for_agent":
            compacted, summary = is_compaction(call, lineage, self._lineages)
            if compacted and summary is not None:
                summary[1].summary = True
        window = hint(call, "window")
        if window is not None:
            lineage.window = window
        return await lineage.chat(
            call,
            found,
            idempotency_key=idempotency_key,
            compacted=compacted,
            summary_call=is_summary_request(call),
            listener=listener,
        )

    # ------------------------------------------------------------------ reward, expiry, close, abort, status

    def set_reward(self, reward: Any) -> None:
        if self.closed:
            raise GatewayError(409, "the session is closed", code="session_closed")
        self.reward = reward

    def _expire_if_never_called(self) -> None:
        """The idle limit passed and the agent never called: ``idle`` (the session expires with no training
        sequence, and the gateway forgets it)."""
        self._reaper = None
        if self.main.state == session_table.INITIAL:
            self.main.fire("idle")

    def _forget(self) -> None:
        self._closed_samples = []
        self._ended.set()
        if self._on_closed is not None:
            self._on_closed(self)

    async def wait_ended(self) -> None:
        """Wait until the session is closed, or ended by the idle limit without a call."""
        await self._ended.wait()

    async def close(self, reward: Any = None) -> list[Sample]:
        """End the session: its training sequences (see the module docstring; the last ends ``completed``,
        ``session_closed``, unless it ended otherwise before). ``reward`` (else the one set before) is every
        sequence's reward."""
        if self._closed_samples is not None:
            return self._closed_samples
        if any(lineage.state == "answering" for lineage in self._lineages):
            raise GatewayError(409, "a call of this session is in flight; close it after the answer", code="busy")
        self._cancel_reaper()
        self._shut = True
        reward = reward if reward is not None else self.reward
        await asyncio.gather(*(lineage.close(reward) for lineage in self._lineages))
        sample = self._session_sample()
        if sample is not None and reward is not None:
            sample.reward = reward
        samples = training_sequences([sample]) if sample is not None else []
        self._closed_samples = samples
        self._ended.set()
        if self._on_closed is not None:
            self._on_closed(self)
        return samples

    def _session_sample(self) -> Sample | None:
        """The main lineage's last sequence, holding every other sequence of the session as its ``branches`` (the
        main lineage's earlier ones, then each other lineage's), each summary call's sequence marked."""
        main = self.main.sample
        if main is None:
            return None
        by_lineage: list[list[Sample]] = []
        for lineage in self._lineages:
            sample = lineage.sample
            if sample is None:
                continue
            # another lineage's last sequence joins the session's branches as a sequence of its own
            last = sample if lineage is self.main else dataclasses.replace(sample, branches=[])
            sequences = [*lineage.earlier_sequences, last]
            for answered in lineage.answered_calls:
                if answered.summary and answered.sequence < len(sequences):
                    held = sequences[answered.sequence]
                    held.metadata["compaction_summary"] = True
                    spans = held.metadata.setdefault("compaction_summary_spans", [])
                    span = {"start": answered.start, "end": answered.end}
                    if span not in spans:
                        spans.append(span)
            by_lineage.append(sequences)
        main_sequences, others = by_lineage[0], by_lineage[1:]
        main.branches = [*main_sequences[:-1], *(each for sequences in others for each in sequences)]
        return main

    async def abort(self, reason: str = "shutdown") -> None:
        """The gateway stops: each lineage's table takes its ``shutdown`` edge; its rollout ends ``aborted`` with
        ``reason``."""
        self._cancel_reaper()
        self._shut = True
        for lineage in self._lineages:
            await lineage.abort(reason)

    def _cancel_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    def status(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers: the main lineage's states, turns and status, the session's calls and
        sequences, and each lineage's own (``lineages``)."""
        main = self.main
        lineages = [lineage.status() for lineage in self._lineages if lineage.started or lineage is main]
        sample = main.sample
        never_called = main.state == "expired" and sample is None
        shown = lineages[0]
        return {
            "session_id": self.session_id,
            "closed": self.closed,
            "calls": self.calls,
            "sequences": sum(each["sequences"] for each in lineages),
            "session_state": main.state,
            "state": shown["state"],
            "turns": shown["turns"],
            "status": "truncated" if never_called else shown["status"],
            "reason": shown["reason"]
            if sample is not None
            else (EndReason.AGENT_TIMEOUT.value if never_called else None),
            "reward": self.reward,
            "metadata": self.metadata,
            "label": self.label,
            "lineages": lineages,
        }
