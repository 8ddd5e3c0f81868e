"""Internal: one lineage of a gateway session, a chain of calls run as its own rollout.

A lineage holds the conversation its model has seen: its first call's messages (and tools) are the prompt of a
rollout; when the model has answered, the rollout steps its environment (the session's
:class:`~fsm_rollout.gateway.session.SessionEnvironment` for this lineage), whose ``step(turn)`` hands the turn to the
waiting HTTP call and waits for the lineage's next call. That call's new messages are the observation, encoded like any
other (boundary tokens, mask 0). Nothing the model generated is ever re-tokenized: the answer is read from the turn's
own tokens, and later calls are only checked against it by meaning (:mod:`fsm_rollout.gateway.conversation`).

A call that rewrote the lineage's history sends the whole conversation as the observation, and the rollout takes the
lifecycle's ``fork`` edge: reason ``compacted`` when the session found a compaction (a summary replaced earlier
turns), else ``history_rewritten``. The sequence so far closes into ``sample.branches`` and the engine's render of
the conversation as sent is the next sequence's prompt.

Its lifecycle is the table in :mod:`fsm_rollout.gateway.session_table`, one machine per lineage: the methods below
fire its triggers, and its actions are the ``_act_*`` methods, by name. Which lineage a call goes to, and whether a
rewrite is a compaction, is the session's choice (:mod:`fsm_rollout.gateway.lineages`). A sequence that ended over
the model's context leaves the chain usable (:mod:`fsm_rollout.gateway.context_overflow`).

Why this module is long: it is one class, a chain's machine with its guards and actions, which all share the chain's
state (its rollout, the held conversation, the call in flight and the last answer for retries).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult, Turn
from fsm_rollout.gateway import session_table
from fsm_rollout.gateway.answers import TokenText, read_answer
from fsm_rollout.gateway.context_overflow import ended_over_context, overflow_error
from fsm_rollout.gateway.conversation import Extension
from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer, render_message, without_stop_string
from fsm_rollout.gateway.stream_text import Listener, TokenFanout
from fsm_rollout.machine import lifecycle
from fsm_rollout.sample import Sample

if TYPE_CHECKING:
    from fsm_rollout.rollout.handle import RolloutHandle
    from fsm_rollout.runtime.runner import RolloutRunner

__all__ = ["DISCONNECTED", "AnsweredCall", "Lineage"]

DISCONNECTED = lifecycle.AGENT_DISCONNECTED
"""The abort reason of a sequence whose agent went away mid-call and did not retry within the disconnect grace."""

_CallIdentity = tuple[str | None, tuple[Any, ...]]
"""What makes two calls the same call: the ``Idempotency-Key`` (None when not sent) and the call's messages,
tools, sampling settings and tool choice."""


@dataclass
class AnsweredCall:
    """A call the lineage's model answered: in its lineage's sequence ``sequence`` (0: the first), response tokens
    ``start`` to ``end``; ``content`` is the answer's text (for finding it in a later prompt), ``order`` the
    session's call count when it was called (later calls are larger); ``summary`` marks a compaction's summary."""

    sequence: int
    start: int
    end: int
    content: str
    order: int
    summary: bool = False


@dataclass(frozen=True)
class LineageSettings:
    """What every lineage of a session shares: the session's identity, limits and sample fields."""

    session_id: str
    index: int
    label: Any
    metadata: Mapping[str, Any]
    idle_timeout_s: float | None
    disconnect_grace_s: float


class Lineage:
    """One chain of a session (see the module docstring): ``id`` (``"l0"``, ``"l1"``, …) is stable for the chain,
    ``key`` is the harness's own id for it (a hint), ``parent`` the id of the lineage that spawned it (when the
    harness says so)."""

    def __init__(
        self,
        runner: RolloutRunner,
        settings: LineageSettings,
        number: int,
        *,
        text: TokenText,
        on_forget: Callable[[], None],
        key: str | None = None,
        parent: str | None = None,
    ) -> None:
        self.number = number
        self.id = f"l{number}"
        self.key = key
        self.parent = parent
        self.window: Any = None
        self.calls = 0
        self.call_sampling: dict[str, Any] = {}
        self.answered_calls: list[AnsweredCall] = []
        self.last_called = 0  # the session's call count at this lineage's last call: the most recent chain wins ties
        self._settings = settings
        self._runner = runner
        self._text = text
        self._on_forget = on_forget
        self._tool_choice = "auto"
        self._summary_call = False
        self._sample: Sample | None = None
        self._ended: list[Sample] = []  # sequences of earlier rollouts of the chain (ended over the context)
        self._rollout: RolloutHandle | None = None
        self._held: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._answer: asyncio.Future[TurnAnswer] | None = None
        self._agent: asyncio.Future[tuple[str, Any]] | None = None
        self._last_answer: TurnAnswer | None = None
        self._handed: Turn | None = None
        # what the trigger being fired carries, for its guards and actions
        self._call: ChatCall | None = None
        self._found: Extension | None = None
        self._compacted = False
        self._identity: _CallIdentity | None = None
        # the call being answered and the last one answered, for a client's retry of either
        self._answering: _CallIdentity | None = None
        self._answered: _CallIdentity | None = None
        self._waiters = 0  # HTTP calls waiting for the answer in flight
        self._grace: asyncio.TimerHandle | None = None
        self._delivering: TurnAnswer | None = None
        self._close_reward: Any = None
        self._abort_reason = "cancelled"
        self._streams = False  # the call being answered asked for a stream: its turn's tokens go out as they come
        self.fanout = TokenFanout(self._prompt)
        tracer = runner.tracer
        self._machine = session_table.SessionMachine(
            {
                "is_retry": self._is_retry,
                "history_rewritten": lambda: self._found_kind("rewritten"),
                "over_context": lambda: ended_over_context(self._sample),
            },
            {name: getattr(self, f"_act_{name}") for name in session_table.action_names()},
            fields={"session_id": settings.session_id, "lineage": self.id},
            emit=(lambda fields: tracer.other_event(session_table.SESSION_EVENT, fields)) if tracer.enabled else None,
        )

    # ------------------------------------------------------------------ what the session reads

    @property
    def state(self) -> str:
        return self._machine.state

    @property
    def terminal(self) -> bool:
        return self._machine.terminal

    @property
    def started(self) -> bool:
        return self._sample is not None

    @property
    def sample(self) -> Sample | None:
        """The lineage's sample (its current sequence; earlier ones in ``branches``), None before its first call."""
        return self._sample

    @property
    def earlier_sequences(self) -> list[Sample]:
        """The chain's sequences before its current one, oldest first."""
        return [*self._ended, *(self._sample.branches if self._sample is not None else ())]

    @property
    def rollout(self) -> RolloutHandle | None:
        return self._rollout

    @property
    def held(self) -> list[dict[str, Any]]:
        """The conversation the lineage's model has seen (checked form)."""
        return self._held

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    @property
    def last_answered(self) -> bool:
        return self._last_answer is not None

    @property
    def waiting_calls(self) -> int:
        return self._waiters

    def fire(self, trigger: str) -> bool:
        return self._machine.fire(trigger)

    def _found_kind(self, kind: str) -> bool:
        return self._found is not None and self._found.kind == kind

    def _is_retry(self) -> bool:
        """The call repeats the one in flight (``answering``) or the last one answered: the same
        ``Idempotency-Key``, or the same messages, tools and sampling (after an answer: the held conversation
        without that answer, as :func:`~fsm_rollout.gateway.conversation.compare_history` says)."""
        this = self._identity
        other = self._answering if self._machine.state == "answering" else self._answered
        if this is None or other is None:
            return False
        if this[0] is not None and this[0] == other[0]:
            return True
        return this[1] == other[1] if self._machine.state == "answering" else self._found_kind("retry")

    # ------------------------------------------------------------------ what the agent's calls do

    async def chat(
        self,
        call: ChatCall,
        found: Extension | None,
        *,
        idempotency_key: str | None = None,
        compacted: bool = False,
        summary_call: bool = False,
        listener: Listener | None = None,
    ) -> TurnAnswer:
        """Answer one call routed to this lineage (``listener``, when given, gets its turn's tokens as the engine
        streams them); ``found`` is how it relates to the held conversation (None for
        the first call), ``compacted`` whether a rewrite is a compaction, ``summary_call`` whether the call asks for
        a compaction's summary (the harness says so). 409 when another call of the chain is in flight or the
        lineage's rollout has ended."""
        state = self._machine.state
        self._identity = (idempotency_key, (call.messages, call.tools, call.sampling, call.tool_choice))
        self._call, self._found, self._compacted = call, None, compacted
        if state == "answering":
            if not self._machine.fire("call"):
                raise GatewayError(409, "another call of this session is in flight", code="concurrent_call")
            self.calls += 1
            return await self._wait_for_answer(listener)
        self.calls += 1
        self._tool_choice = call.tool_choice
        if state != session_table.INITIAL:
            self._found = found
            if state == "waiting_for_agent" and found is not None and found.kind == "extends" and not found.new:
                raise GatewayError(
                    400, "the call adds no message after the assistant's last answer", code="no_new_messages"
                )
        if not self._machine.fire("call"):
            reason = self._sample.metadata.get("rollout_reason") if self._sample is not None else None
            raise GatewayError(
                409, f"the session's rollout has ended ({reason or 'not waiting'})", code="session_ended"
            )
        self._cancel_grace()
        if self._machine.state != "answering":  # answer_again
            assert self._last_answer is not None
            return self._last_answer
        self._answering = self._identity
        self._summary_call = summary_call
        return await self._wait_for_answer(listener)

    def _act_answer_again(self) -> None:
        """A retry of the previous call: answered again (by :meth:`chat`), nothing generated."""

    def _act_attach(self) -> None:
        """A retry of the call in flight: it waits for the same answer (by :meth:`chat`)."""
        self._cancel_grace()

    def _act_hand_messages(self) -> None:
        """Hand the call's new messages to the waiting rollout (its observation)."""
        call, found, waiting = self._call, self._found, self._agent
        assert call is not None and found is not None and waiting is not None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._begin_call(call)
        self._held.extend(found.new)
        waiting.set_result(("messages", [render_message(message) for message in found.new]))

    def _act_hand_rewrite(self) -> None:
        """The agent rewrote the history: the whole conversation as sent is the observation, and the rollout forks
        (reason ``compacted`` or ``history_rewritten``; the engine's render of the call is the next prompt)."""
        call, found, waiting = self._call, self._found, self._agent
        assert call is not None and found is not None and waiting is not None
        self._held = [dict(message) for message in call.messages]
        self._tools = [dict(tool) for tool in call.tools] if call.tools else None
        self._last_answer = None
        self._answered = None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._begin_call(call)
        messages = [render_message(message) for message in call.messages]
        tools = None if self._tools is None else tuple(self._tools)
        rewrite = Rewrite(tuple(messages), tools, found.detail or "", compacted=self._compacted)
        waiting.set_result(("rewritten", (messages, rewrite)))

    def _begin_call(self, call: ChatCall) -> None:
        """A call starts being answered: its turn's tokens stream to it when it asked for a stream."""
        self._streams = call.stream
        self.fanout.reset()

    def next_call(self) -> NextCall:
        """What the next generate request carries: the call's sampling, and the token sink of a streamed call."""
        return NextCall(sampling=dict(self.call_sampling), token_sink=self.fanout.push if self._streams else None)

    def _prompt(self) -> tuple[str, int]:
        """The end of the prompt the turn continues (whether it opened a thinking block), and its length."""
        sample = self._sample
        if sample is None or not sample.tokens:
            return "", 0
        return self._text.decode(list(sample.tokens[-4:])), len(sample.tokens)

    def _act_start_sequence(self) -> None:
        call = self._call
        assert call is not None
        settings = self._settings
        metadata: dict[str, Any] = {
            "gateway_session": dict(settings.metadata),
            "lineage": self.id,
            "parent_lineage": self.parent,
        }
        if self.key is not None:
            metadata["lineage_key"] = self.key
        if call.tools:
            metadata["tools"] = [dict(tool) for tool in call.tools]
        sample = Sample(
            prompt=[render_message(message) for message in call.messages],
            index=settings.index,
            label=settings.label,
            session_id=settings.session_id,
            metadata=metadata,
        )
        self._held = [dict(message) for message in call.messages]
        self._tools = [dict(tool) for tool in call.tools] if call.tools else None
        self._last_answer = None
        self._answered = None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._begin_call(call)
        self._agent = None
        self._handed = None
        self._sample = sample
        # the runner's own rollout path (metrics, tape, trace, weight-update gate) with the handle kept, so an agent
        # that goes away can abort it with a reason of its own; the main lineage keeps the id a session always had
        sample_id = f"{settings.index}.0" if self.number == 0 else f"{settings.index}.0.{self.id}"
        self._rollout = self._runner.start(sample, sample_id=sample_id)
        self._rollout.add_done_callback(self._sequence_ended)

    def _act_restart_sequence(self) -> None:
        """After a context overflow, the agent's trimmed call starts a new rollout of the chain; the ended sequence
        is kept when it holds tokens (one whose first call was over the context holds none)."""
        ended = self._sample
        assert ended is not None
        self._ended += [*ended.branches, *([dataclasses.replace(ended, branches=[])] if ended.tokens else [])]
        self._act_start_sequence()

    async def _wait_for_answer(self, listener: Listener | None = None) -> TurnAnswer:
        answer = self._answer
        assert answer is not None
        self._waiters += 1
        stop_listening = self.fanout.subscribe(listener) if listener is not None else None
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            # the agent went away mid-call: its client retries a timed-out call, so the answer goes on and waits
            # for the retry, for the grace; none came: the rollout is aborted (``agent_gone``)
            if self._waiters == 1 and self._grace is None:
                grace = self._settings.disconnect_grace_s
                self._grace = asyncio.get_running_loop().call_later(grace, self._agent_gone)
            raise
        finally:
            self._waiters -= 1
            if stop_listening is not None:
                stop_listening()

    def _agent_gone(self) -> None:
        self._grace = None
        self._machine.fire("agent_gone")

    def _act_abort_disconnected(self) -> None:
        """The disconnected call's retry did not come: the rollout ends ``aborted`` (``agent_disconnected``); what
        was generated before stays."""
        if self._rollout is not None and not self._rollout.terminal:
            self._rollout.abort(DISCONNECTED)

    def _cancel_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    # ------------------------------------------------------------------ what the rollout's environment does

    async def hand_over(self, turn: Turn) -> StepResult:
        """``step(turn)``: answer the waiting call, then wait for the agent's next call, close or silence."""
        self._delivering = self._read_answer(turn)
        self._note_answered(turn, self._delivering)
        self._handed = turn
        self._agent = waiting = asyncio.get_running_loop().create_future()
        self._machine.fire("answered")
        try:
            kind, payload = await asyncio.wait_for(waiting, self._settings.idle_timeout_s)
        except TimeoutError:
            self._machine.fire("idle")
            return StepResult(None, done=True, end=EndReason.AGENT_TIMEOUT)
        if kind == "messages":
            return StepResult(payload, next_call=self.next_call())
        if kind == "rewritten":
            messages, rewrite = payload
            return StepResult(messages, next_call=dataclasses.replace(self.next_call(), rewrite=rewrite))
        return StepResult(None, done=True, reward=payload, end=EndReason.SESSION_CLOSED)

    def _note_answered(self, turn: Turn, answer: TurnAnswer) -> None:
        """Where the answered turn lies in the current sequence's response tokens (the turn was appended, then
        perhaps a masked EOS), for a compaction's summary mark."""
        sample = self._sample
        if sample is None:
            return
        ids = list(turn.token_ids)
        tokens, count = sample.tokens, len(ids)
        end = sample.response_length
        if count and tokens[-count - 1 : -1] == ids and tokens[-count:] != ids:
            end -= 1
        self.answered_calls.append(
            AnsweredCall(
                len(self._ended) + len(sample.branches),
                end - count,
                end,
                (answer.content or "").strip(),
                self.last_called,
                self._summary_call,
            )
        )
        self._summary_call = False

    def _act_deliver_answer(self) -> None:
        answer, self._delivering = self._delivering, None
        assert answer is not None
        self._settle(answer)

    def _settle(self, answer: TurnAnswer) -> None:
        """The waiting call gets ``answer``; the conversation held for the next call's comparison holds it."""
        pending, self._answer = self._answer, None
        self._held.append(answer.message())
        self._last_answer = answer
        self._answered, self._answering = self._answering, None
        if pending is not None and not pending.done():
            pending.set_result(answer)

    def _read_answer(self, turn: Turn, *, finish: str | None = None) -> TurnAnswer:
        """The answer to the waiting call: the turn's own tokens, its text without the end tokens, its tool calls;
        its content as the agent gets it, without the stop string (the agent sends it back so; the tokens keep it)."""
        spans = (self._sample.metadata.get("weight_version_spans") if self._sample is not None else None) or []
        stop = self._runner.sampling_params.get("stop") or ()
        stops = [*(self.call_sampling.get("stop") or ()), *([stop] if isinstance(stop, str) else stop)]
        answer = read_answer(
            turn,
            self._text,
            parse_calls=self._tool_choice != "none",
            max_tokens=self.call_sampling.get("max_tokens"),
            with_top_logprobs=bool(self.call_sampling.get("top_logprobs")),
            weight_version=spans[-1]["version"] if spans else None,
            finish=finish,
        )
        return without_stop_string(answer, stops)

    def _sequence_ended(self, handle: RolloutHandle) -> None:
        """A sequence's rollout ended (``rollout_end``; after a close, abort or expiry the call is settled all the
        same)."""
        if not self._machine.fire("rollout_end"):
            self._act_settle_call()

    def _act_settle_call(self) -> None:
        """A call still waiting gets the turn the rollout's end cut short, or the reason it ended."""
        if self._agent is not None and not self._agent.done():
            self._agent.cancel()
        pending = self._answer
        if pending is None or pending.done():
            self._answer = None
            return
        sample = self._sample
        turn = self._rollout.last_turn if self._rollout is not None else None
        unanswered = turn is not None and turn is not self._handed and bool(turn.token_ids)
        if sample is not None and turn is not None and unanswered and sample.status.value == "truncated":
            self._settle(self._read_answer(turn, finish="length"))  # appended, never stepped: the budget's cut
            return
        self._answer = None
        reason = sample.metadata.get("rollout_reason") if sample is not None else None
        error = sample.metadata.get("rollout_error") if sample is not None else None
        if sample is not None and ended_over_context(sample):  # the agent may trim and call again
            pending.set_exception(overflow_error(sample))
        elif error:
            message = f"the session's rollout failed: {error.get('type')}: {error.get('message')}"
            pending.set_exception(GatewayError(500, message, code="rollout_failed", type="server_error"))
        else:
            pending.set_exception(
                GatewayError(409, f"the session's rollout ended ({reason}) before answering", code="session_ended")
            )
        pending.exception()  # retrieved here too: the caller may have gone away

    # ------------------------------------------------------------------ expiry, close, abort

    def _act_forget(self) -> None:
        self._on_forget()

    async def close(self, reward: Any) -> None:
        """The table's ``close``: the rollout's waiting step gets it (and ``reward``); wait for the rollout's end."""
        self._cancel_grace()
        self._close_reward = reward
        if not self._machine.terminal:
            self._machine.fire("close")
        if self._rollout is not None:
            await asyncio.shield(self._ended_rollout(self._rollout))

    def _act_hand_close(self) -> None:
        """The rollout's waiting step gets the close (its reward, if any): the sample ends ``completed``."""
        if self._agent is not None and not self._agent.done():
            self._agent.set_result(("close", self._close_reward))

    async def abort(self, reason: str) -> None:
        """The gateway stops: the table's ``shutdown`` edge; the lineage's rollout ends ``aborted`` with ``reason``."""
        self._cancel_grace()
        self._abort_reason = reason
        if not self._machine.terminal:
            self._machine.fire("shutdown")
        if self._rollout is not None:
            if not self._rollout.terminal:  # expired: its rollout may still be ending
                self._rollout.abort(reason)
            await self._ended_rollout(self._rollout)

    def _act_abort_rollout(self) -> None:
        if self._rollout is not None and not self._rollout.terminal:
            self._rollout.abort(self._abort_reason)

    @staticmethod
    async def _ended_rollout(handle: RolloutHandle) -> None:
        """Wait for the rollout to end; its error, if any, is the sample's (``metadata["rollout_error"]``)."""
        with contextlib.suppress(Exception):
            await handle

    def status(self) -> dict[str, Any]:
        """The lineage's part of ``GET /sessions/{id}``."""
        sample, rollout = self._sample, self._rollout
        return {
            "lineage": self.id,
            "parent_lineage": self.parent,
            "lineage_key": self.key,
            "calls": self.calls,
            "sequences": len(self.earlier_sequences) + 1 if sample is not None else 0,
            "session_state": self._machine.state,
            "state": rollout.state if rollout is not None else "waiting_for_first_call",
            "turns": (rollout.turn_index + (rollout.state not in ("pending", "rendered", "generating")))
            if rollout is not None
            else 0,
            "status": sample.status.value
            if sample is not None and rollout is not None and rollout.terminal
            else self._machine.state,
            "reason": sample.metadata.get("rollout_reason") if sample is not None else None,
        }
