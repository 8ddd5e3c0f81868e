"""One gateway session: an agent's conversation, run as a rollout whose environment is the agent.

The first chat call's messages (and tools) are the prompt of a rollout. When the model has answered, the rollout
steps its environment, :class:`SessionEnvironment`, which accepts turns: its ``step(turn)`` hands the
:class:`~fsm_rollout.envs.step.Turn` to the waiting HTTP call and waits for the agent's next call; that call's new
messages are the observation, encoded like any other (boundary tokens, mask 0), and the next generate request
continues the same token sequence. Nothing the model generated is ever re-tokenized: the answer is read from the
turn's own tokens, and later calls are only checked against it by meaning (:mod:`fsm_rollout.gateway.conversation`).

How a session ends is an edge of the lifecycle table, chosen by the step's typed ``end``
(:class:`~fsm_rollout.envs.step.EndReason`): the agent closed the session (``completed``, ``session_closed``) or
went idle past the limit (``truncated``, ``agent_timeout``). An agent that rewrote the history (edited, dropped or
compacted messages, changed tools) sends the whole conversation as the observation, and the rollout takes the
history policies' ``fork`` edge (reason ``history_rewritten``, :func:`fsm_rollout.rollout.history.rewrite_history`):
the sequence so far closes into ``sample.branches`` and the engine's render of the conversation as sent is the
next sequence's prompt, so each generated token is trained in exactly one sequence and no sequence holds a token
the model did not see. ``close`` returns the session's training sequences, oldest first
(:func:`fsm_rollout.sample.branches.training_sequences`).

The agent's per-call sampling settings reach that call's generate request as the step's ``next_call`` (the first
call's as the environment's ``reset`` result), so a tape holds them and a replay sends them; its ``max_tokens``
bounds the turn without ending the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult, Turn
from fsm_rollout.gateway import session_table
from fsm_rollout.gateway.answers import TokenText, read_answer
from fsm_rollout.gateway.conversation import Extension, compare_history
from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer, render_message, without_stop_string
from fsm_rollout.sample import Sample
from fsm_rollout.sample.branches import training_sequences

if TYPE_CHECKING:
    from fsm_rollout.rollout.handle import RolloutHandle
    from fsm_rollout.runtime.runner import RolloutRunner

__all__ = ["GatewaySession", "SessionEnvironment", "TokenText"]

DISCONNECTED = "agent_disconnected"
"""The abort reason of a sequence whose agent went away mid-call and did not retry within the disconnect grace."""

_CallIdentity = tuple[str | None, tuple[Any, ...]]
"""What makes two calls the same call: the ``Idempotency-Key`` (None when not sent) and the call's messages,
tools, sampling settings and tool choice."""


class SessionEnvironment:
    """The environment a session's rollout steps: the agent on the other side of the HTTP calls."""

    accepts_turn = True

    def __init__(self, session: GatewaySession) -> None:
        self._session = session

    def reset(self) -> StepResult:
        """The first call's sampling settings, for the first generate request (no call has come since)."""
        return StepResult(None, next_call=NextCall(sampling=dict(self._session.call_sampling)))

    async def step(self, turn: Turn) -> StepResult:
        return await self._session.hand_over(turn)

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = list(observation)
        return messages

    def close(self) -> None:
        return None


class GatewaySession:
    """One agent session (see the module docstring). ``session_id`` and ``base_url`` are what the agent is given;
    :meth:`close` ends it and returns its training sequences. Its lifecycle is the table in
    :mod:`fsm_rollout.gateway.session_table`: the methods below fire its triggers, and its actions are the
    ``_act_*`` methods, by name."""

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
    ) -> None:
        self.session_id = session_id
        self.base_url = base_url
        self.index = index
        self.metadata = dict(metadata or {})
        self.label = label
        self.idle_timeout_s = idle_timeout_s
        self.disconnect_grace_s = disconnect_grace_s
        self.reward: Any = None
        self.calls = 0
        self.call_sampling: dict[str, Any] = {}
        self._tool_choice = "auto"
        self._runner = runner
        self._text = token_text or TokenText(runner.tokenizer, runner.sampling_params)
        self._on_closed = on_closed
        self._ended = asyncio.Event()
        self._closed_samples: list[Sample] | None = None
        self._sample: Sample | None = None
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
        self._identity: _CallIdentity | None = None
        # the call being answered and the last one answered, for a client's retry of either
        self._answering: _CallIdentity | None = None
        self._answered: _CallIdentity | None = None
        self._waiters = 0  # HTTP calls waiting for the answer in flight
        self._grace: asyncio.TimerHandle | None = None
        self._delivering: TurnAnswer | None = None
        self._close_reward: Any = None
        self._abort_reason = "cancelled"
        tracer = runner.tracer
        self._machine = session_table.SessionMachine(
            {"is_retry": self._is_retry, "history_rewritten": lambda: self._found_kind("rewritten")},
            {name: getattr(self, f"_act_{name}") for name in session_table.action_names()},
            fields={"session_id": session_id},
            emit=(lambda fields: tracer.other_event(session_table.SESSION_EVENT, fields)) if tracer.enabled else None,
        )
        self._reaper: asyncio.TimerHandle | None = None
        if idle_timeout_s is not None:  # a session never called has no rollout to time it out: a timer does
            self._reaper = asyncio.get_running_loop().call_later(idle_timeout_s, self._expire_if_never_called)

    @property
    def state(self) -> str:
        """The session's state in :mod:`fsm_rollout.gateway.session_table`."""
        return self._machine.state

    @property
    def waiting_calls(self) -> int:
        """HTTP calls waiting for the answer in flight now (a call and its clients' retries attached to it)."""
        return self._waiters

    @property
    def rollout(self) -> RolloutHandle | None:
        """The handle of the session's rollout (None before the first call)."""
        return self._rollout

    @property
    def closed(self) -> bool:
        """Closed, or expired before any call (an agent idle after calls leaves the session to be closed)."""
        return self._machine.state == "closed" or (self._machine.state == "expired" and self._sample is None)

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

    async def chat(self, call: ChatCall, *, idempotency_key: str | None = None) -> TurnAnswer:
        """Answer one chat call. A retry of the call in flight (or of the last one answered) is that call: it gets
        the same answer, nothing is generated twice. 409 when another call of the chain is in flight or the
        session has ended."""
        state = self._machine.state
        if self.closed:
            why = "expired before its first call (agent_timeout)" if state == "expired" else "closed"
            raise GatewayError(409, f"the session is {why}", code="session_closed")
        self._identity = (idempotency_key, (call.messages, call.tools, call.sampling, call.tool_choice))
        self._call, self._found = call, None
        if state == "answering":
            if not self._machine.fire("call"):
                raise GatewayError(409, "another call of this session is in flight", code="concurrent_call")
            self.calls += 1
            return await self._wait_for_answer()
        self.calls += 1
        self._tool_choice = call.tool_choice
        if state != session_table.INITIAL:
            self._found = compare_history(
                self._held, self._tools, call.messages, call.tools, last_answered=self._last_answer is not None
            )
            if state == "waiting_for_agent" and self._found.kind == "extends" and not self._found.new:
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
        return await self._wait_for_answer()

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
        self._held.extend(found.new)
        waiting.set_result(("messages", [render_message(message) for message in found.new]))

    def _act_hand_rewrite(self) -> None:
        """The agent rewrote the history: the whole conversation as sent is the observation, and the rollout forks
        (the sequence so far closes into ``sample.branches``; the engine's render of the call is the next prompt)."""
        call, found, waiting = self._call, self._found, self._agent
        assert call is not None and found is not None and waiting is not None
        self._held = [dict(message) for message in call.messages]
        self._tools = [dict(tool) for tool in call.tools] if call.tools else None
        self._last_answer = None
        self._answered = None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        messages = [render_message(message) for message in call.messages]
        rewrite = Rewrite(tuple(messages), None if self._tools is None else tuple(self._tools), found.detail or "")
        waiting.set_result(("rewritten", (messages, rewrite)))

    def _act_start_sequence(self) -> None:
        call = self._call
        assert call is not None
        metadata: dict[str, Any] = {"gateway_session": dict(self.metadata)}
        if call.tools:
            metadata["tools"] = [dict(tool) for tool in call.tools]
        sample = Sample(
            prompt=[render_message(message) for message in call.messages],
            index=self.index,
            label=self.label,
            session_id=self.session_id,
            metadata=metadata,
        )
        self._held = [dict(message) for message in call.messages]
        self._tools = [dict(tool) for tool in call.tools] if call.tools else None
        self._last_answer = None
        self._answered = None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._agent = None
        self._handed = None
        self._sample = sample
        if self._reaper is not None:  # from now on the rollout's step bounds the agent's silence
            self._reaper.cancel()
            self._reaper = None
        # the runner's own rollout path (metrics, tape, trace, weight-update gate) with the handle kept, so an agent
        # that goes away can abort it with a reason of its own
        self._rollout = self._runner.start(sample, sample_id=f"{self.index}.0")
        self._rollout.add_done_callback(self._sequence_ended)

    async def _wait_for_answer(self) -> TurnAnswer:
        answer = self._answer
        assert answer is not None
        self._waiters += 1
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            # the agent went away mid-call: its client retries a timed-out call, so the answer goes on and waits
            # for the retry, for the grace; none came: the rollout is aborted (``agent_gone``)
            if self._waiters == 1 and self._grace is None:
                self._grace = asyncio.get_running_loop().call_later(self.disconnect_grace_s, self._agent_gone)
            raise
        finally:
            self._waiters -= 1

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
        self._handed = turn
        self._agent = waiting = asyncio.get_running_loop().create_future()
        self._machine.fire("answered")
        try:
            kind, payload = await asyncio.wait_for(waiting, self.idle_timeout_s)
        except TimeoutError:
            self._machine.fire("idle")
            return StepResult(None, done=True, end=EndReason.AGENT_TIMEOUT)
        if kind == "messages":
            return StepResult(payload, next_call=NextCall(sampling=dict(self.call_sampling)))
        if kind == "rewritten":
            messages, rewrite = payload
            return StepResult(messages, next_call=NextCall(sampling=dict(self.call_sampling), rewrite=rewrite))
        return StepResult(None, done=True, reward=payload, end=EndReason.SESSION_CLOSED)

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
        if error:
            message = f"the session's rollout failed: {error.get('type')}: {error.get('message')}"
            pending.set_exception(GatewayError(500, message, code="rollout_failed", type="server_error"))
        else:
            pending.set_exception(
                GatewayError(409, f"the session's rollout ended ({reason}) before answering", code="session_ended")
            )
        pending.exception()  # retrieved here too: the caller may have gone away

    # ------------------------------------------------------------------ reward, expiry, close, abort, status

    def set_reward(self, reward: Any) -> None:
        if self.closed:
            raise GatewayError(409, "the session is closed", code="session_closed")
        self.reward = reward

    def _expire_if_never_called(self) -> None:
        """The idle limit passed and the agent never called: ``idle`` (the session expires with no training
        sequence, and the gateway forgets it)."""
        self._reaper = None
        if self._machine.state == session_table.INITIAL:
            self._machine.fire("idle")

    def _act_forget(self) -> None:
        self._closed_samples = []
        self._ended.set()
        if self._on_closed is not None:
            self._on_closed(self)

    async def wait_ended(self) -> None:
        """Wait until the session is closed, or ended by the idle limit without a call."""
        await self._ended.wait()

    async def close(self, reward: Any = None) -> list[Sample]:
        """End the session: its training sequences, oldest first (the last ends ``completed``, ``session_closed``,
        unless it ended otherwise before). ``reward`` (else the one set before) is every sequence's reward."""
        if self._closed_samples is not None:
            return self._closed_samples
        if self._machine.state == "answering":
            raise GatewayError(409, "a call of this session is in flight; close it after the answer", code="busy")
        self._cancel_reaper()
        self._cancel_grace()
        self._close_reward = reward = reward if reward is not None else self.reward
        if not self._machine.terminal:
            self._machine.fire("close")
        if self._rollout is not None:
            await asyncio.shield(self._ended_rollout(self._rollout))
        sample = self._sample
        if sample is not None and reward is not None:
            sample.reward = reward
        samples = training_sequences([sample]) if sample is not None else []
        self._closed_samples = samples
        self._ended.set()
        if self._on_closed is not None:
            self._on_closed(self)
        return samples

    def _act_hand_close(self) -> None:
        """The rollout's waiting step gets the close (its reward, if any): the sample ends ``completed``."""
        if self._agent is not None and not self._agent.done():
            self._agent.set_result(("close", self._close_reward))

    async def abort(self, reason: str = "shutdown") -> None:
        """The gateway stops: the table's ``shutdown`` edge; the session's rollout ends ``aborted`` with ``reason``."""
        self._cancel_reaper()
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

    def _cancel_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    @staticmethod
    async def _ended_rollout(handle: RolloutHandle) -> None:
        """Wait for the rollout to end; its error, if any, is the sample's (``metadata["rollout_error"]``)."""
        with contextlib.suppress(Exception):
            await handle

    def status(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers: the session's and the rollout's states, turns and status."""
        sample = self._sample
        rollout = self._rollout
        never_called = self._machine.state == "expired" and sample is None
        return {
            "session_id": self.session_id,
            "closed": self.closed,
            "calls": self.calls,
            "sequences": len(sample.branches) + 1 if sample is not None else 0,
            "session_state": self._machine.state,
            "state": rollout.state if rollout is not None else "waiting_for_first_call",
            "turns": (rollout.turn_index + (rollout.state not in ("pending", "rendered", "generating")))
            if rollout is not None
            else 0,
            # the sample's status once its rollout has ended; while it runs, the session's own state (a sample not
            # yet ended reads "truncated" or "completed", which an open session is not)
            "status": sample.status.value
            if sample is not None and rollout is not None and rollout.terminal
            else ("truncated" if never_called else self._machine.state),
            "reason": sample.metadata.get("rollout_reason")
            if sample is not None
            else (EndReason.AGENT_TIMEOUT.value if never_called else None),
            "reward": self.reward,
            "metadata": self.metadata,
            "label": self.label,
        }
