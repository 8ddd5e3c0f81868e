"""One gateway session: an agent's conversation, run as a rollout whose environment is the agent.

The first chat call's messages (and tools) are the prompt of a rollout. When the model has answered, the rollout
steps its environment, :class:`SessionEnvironment`, whose ``step(text)`` hands the answer to the waiting HTTP
call and waits for the agent's next call; that call's new messages are the observation, encoded like any other
(boundary tokens, mask 0), and the next generate request continues the same token sequence. Nothing the model
generated is ever re-tokenized: the answer is read from the sample's own tokens, and later calls are only checked
against it by meaning (:mod:`fsm_rollout.gateway.conversation`).

How a session's training sequence ends is an edge of the lifecycle table, chosen by what the environment's step
returns (:mod:`fsm_rollout.rollout.agent_end`): the agent closed the session (``completed``, ``session_closed``),
went idle past the limit (``truncated``, ``agent_timeout``), or rewrote the history (``completed``,
``history_rewritten``): then the session goes on in a new training sequence whose prompt is the engine's render
of the new conversation, so each generated token is trained in exactly one sequence and no sequence holds a token
the model did not see. ``close`` returns the sequences, oldest first.

The agent's per-call sampling settings reach that call's generate request in the observation (the first call's in
the sample's metadata, :mod:`fsm_rollout.rollout.agent_end`), so a tape holds them and a replay sends them; its
``max_tokens`` bounds the turn without ending the sequence.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsm_rollout.gateway.conversation import compare_history
from fsm_rollout.gateway.openai_wire import ChatCall, GatewayError, TurnAnswer, render_message
from fsm_rollout.rollout.agent_end import AGENT_CALL_KEY, CLOSED, HISTORY_REWRITTEN, IDLE, agent_call, agent_end
from fsm_rollout.sample import Sample
from fsm_rollout.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.runner import RolloutRunner

__all__ = ["GatewaySession", "SessionEnvironment"]

DISCONNECTED = "agent_disconnected"
"""The abort reason of a sequence whose agent went away while its call was being answered."""


class SessionEnvironment:
    """The environment a session's rollout steps: the agent on the other side of the HTTP calls."""

    def __init__(self, session: GatewaySession) -> None:
        self._session = session

    def reset(self) -> None:
        return None

    async def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        return await self._session.hand_over(response_text)

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = list(observation[AGENT_CALL_KEY]["messages"])
        return messages

    def close(self) -> None:
        return None


class GatewaySession:
    """One agent session (see the module docstring). ``session_id`` and ``base_url`` are what the agent is given;
    :meth:`close` ends it and returns its training sequences."""

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
        on_closed: Callable[[GatewaySession], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.base_url = base_url
        self.index = index
        self.metadata = dict(metadata or {})
        self.label = label
        self.idle_timeout_s = idle_timeout_s
        self.reward: Any = None
        self.calls = 0
        self.call_sampling: dict[str, Any] = {}
        self._runner = runner
        self._on_closed = on_closed
        self._closed = False
        self._closed_samples: list[Sample] | None = None
        self._busy = False
        self._sequences: list[Sample] = []
        self._sample: Sample | None = None
        self._rollout: Rollout | None = None
        self._task: asyncio.Future[Sample] | None = None
        self._held: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._answer: asyncio.Future[TurnAnswer] | None = None
        self._agent: asyncio.Future[tuple[str, Any]] | None = None
        self._last_answer: TurnAnswer | None = None
        self._mark = 0

    # ------------------------------------------------------------------ what the agent's calls do

    @property
    def closed(self) -> bool:
        return self._closed

    async def chat(self, call: ChatCall) -> TurnAnswer:
        """Answer one chat call (409 when another is in flight or the session has ended)."""
        if self._closed:
            raise GatewayError(409, "the session is closed", code="session_closed")
        if self._busy:
            raise GatewayError(409, "another call of this session is in flight", code="concurrent_call")
        self._busy = True
        try:
            self.calls += 1
            if self._sample is None:
                self._start_sequence(call)
            else:
                kind, found = self._continue(call)
                if isinstance(found, TurnAnswer):
                    return found
                if kind == "rewritten":
                    await self._fork(call, found)
            answer = await self._wait_for_answer()
            self._held.append(answer.message())
            self._last_answer = answer
            return answer
        finally:
            self._busy = False

    def _continue(self, call: ChatCall) -> tuple[str, Any]:
        """Hand a later call to the waiting rollout. Returns ``("retry", answer)`` for a retry of the previous call
        (answered again, nothing generated), ``("extends", None)`` once the new messages are handed over, or
        ``("rewritten", detail)``."""
        found = compare_history(
            self._held, self._tools, call.messages, call.tools, last_answered=self._last_answer is not None
        )
        if found.kind == "retry":
            return "retry", self._last_answer
        waiting = self._agent
        if waiting is None or waiting.done():
            reason = self._sample.metadata.get("rollout_reason") if self._sample is not None else None
            raise GatewayError(
                409, f"the session's rollout has ended ({reason or 'not waiting'})", code="session_ended"
            )
        if found.kind == "rewritten":
            return "rewritten", found.detail
        if not found.new:
            raise GatewayError(
                400, "the call adds no message after the assistant's last answer", code="no_new_messages"
            )
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._held.extend(found.new)
        waiting.set_result(("messages", [render_message(message) for message in found.new]))
        return "extends", None

    async def _fork(self, call: ChatCall, detail: str) -> None:
        """The agent rewrote the history: the current sequence ends where the model last answered (its rollout takes
        the ``history_rewritten`` edge), and a new one starts whose prompt is the new conversation."""
        waiting = self._agent
        assert waiting is not None and self._task is not None and self._sample is not None
        self._sample.metadata["history_rewritten"] = detail
        waiting.set_result(("rewritten", detail))
        await asyncio.shield(self._task)
        self._sequences.append(self._sample)
        self._start_sequence(call)

    def _start_sequence(self, call: ChatCall) -> None:
        branch = len(self._sequences)
        metadata: dict[str, Any] = {
            "gateway_session": dict(self.metadata),
            "branch": branch,
            AGENT_CALL_KEY: {"sampling": dict(call.sampling)},
        }
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
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        self._agent = None
        self._mark = 0
        self._sample = sample
        # the runner's own rollout path (metrics, tape, trace, weight-update gate) with the rollout object kept,
        # so an agent that goes away can abort it with a reason of its own
        rollout = self._runner._rollout(sample, sample_id=f"{self.index}.{branch}")
        self._rollout = rollout
        task = asyncio.ensure_future(self._runner._drive(rollout))
        task.add_done_callback(self._sequence_ended)
        self._task = task

    async def _wait_for_answer(self) -> TurnAnswer:
        answer = self._answer
        assert answer is not None
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            # the agent went away mid-call: the engine request is aborted; what was generated before stays
            if self._rollout is not None and not self._rollout.terminal:
                self._rollout.request_abort(DISCONNECTED)
            raise

    # ------------------------------------------------------------------ what the rollout's environment does

    async def hand_over(self, text: str) -> tuple[Any, bool, dict[str, Any]]:
        """``step(text)``: answer the waiting call, then wait for the agent's next call, close or silence."""
        answer = self._read_answer()
        loop = asyncio.get_running_loop()
        self._agent = waiting = loop.create_future()
        pending, self._answer = self._answer, None
        if pending is not None and not pending.done():
            pending.set_result(answer)
        try:
            kind, payload = await asyncio.wait_for(waiting, self.idle_timeout_s)
        except TimeoutError:
            return agent_end(IDLE), True, {}
        if kind == "messages":
            return agent_call(payload, self.call_sampling), False, {}
        if kind == "rewritten":
            return agent_end(HISTORY_REWRITTEN), True, {}
        info = {} if payload is None else {"reward": payload}
        return agent_end(CLOSED), True, info

    def _turn_positions(self) -> tuple[list[int], int]:
        """The positions of the tokens generated since the last answer, and where the request's prompt ended."""
        sample = self._sample
        assert sample is not None
        mask = sample.loss_mask or []
        offset = len(sample.tokens) - len(mask)
        start = max(self._mark, offset)
        positions = [i for i in range(start, len(sample.tokens)) if mask[i - offset] == 1]
        return positions, (positions[0] if positions else len(sample.tokens))

    def _read_answer(self, *, finish: str | None = None) -> TurnAnswer:
        sample = self._sample
        assert sample is not None
        positions, prompt_tokens = self._turn_positions()
        self._mark = len(sample.tokens)
        offset = len(sample.tokens) - len(sample.loss_mask or [])
        token_ids = [sample.tokens[i] for i in positions]
        logprobs = [float((sample.rollout_log_probs or [])[i - offset]) for i in positions]
        ends = self._end_token_ids()
        text_ids = list(token_ids)
        while text_ids and text_ids[-1] in ends:
            text_ids.pop()
        text = self._runner.tokenizer.decode(text_ids, skip_special_tokens=False) if text_ids else ""
        parsed = parse_tool_calls(text)
        content = text
        for call in reversed(parsed.calls):
            content = content[: call.start] + content[call.end :]
        content = content.strip()
        calls = [
            {"id": f"call_{secrets.token_hex(12)}", "name": call.name, "arguments": dict(call.arguments)}
            for call in parsed.calls
        ]
        if finish is None:
            limit = self.call_sampling.get("max_tokens")
            if limit is not None and len(token_ids) >= limit and len(text_ids) == len(token_ids):
                finish = "length"
            else:
                finish = "tool_calls" if calls else "stop"
        spans = sample.metadata.get("weight_version_spans") or []
        return TurnAnswer(
            content=content if content or not calls else None,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(token_ids),
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            weight_version=spans[-1]["version"] if spans else None,
        )

    def _end_token_ids(self) -> set[int]:
        tokenizer = self._runner.tokenizer
        ends = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
        ends.update(self._runner.sampling_params.get("stop_token_ids") or ())
        return {token for token in ends if isinstance(token, int)}

    def _sequence_ended(self, task: asyncio.Future[Sample]) -> None:
        """A sequence's rollout ended: a call still waiting gets the turn it cut short, or the reason."""
        pending, self._answer = self._answer, None
        if self._agent is not None and not self._agent.done():
            self._agent.cancel()
        if pending is None or pending.done():
            return
        sample = self._sample
        positions, _ = self._turn_positions()
        if sample is not None and positions and sample.status.value == "truncated":
            pending.set_result(self._read_answer(finish="length"))
            return
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

    # ------------------------------------------------------------------ the fork, reward, close, status

    def set_reward(self, reward: Any) -> None:
        if self._closed:
            raise GatewayError(409, "the session is closed", code="session_closed")
        self.reward = reward

    async def close(self, reward: Any = None) -> list[Sample]:
        """End the session: its training sequences, oldest first (the last ends ``completed``, ``session_closed``,
        unless it ended otherwise before). ``reward`` (else the one set before) is every sequence's reward."""
        if self._closed_samples is not None:
            return self._closed_samples
        if self._busy:
            raise GatewayError(409, "a call of this session is in flight; close it after the answer", code="busy")
        self._closed = True
        if reward is None:
            reward = self.reward
        waiting = self._agent
        if waiting is not None and not waiting.done():
            waiting.set_result(("close", reward))
        if self._task is not None:
            await asyncio.shield(self._task)
        samples = [*self._sequences, *([self._sample] if self._sample is not None else [])]
        for sample in samples:
            if reward is not None:
                sample.reward = reward
        self._closed_samples = samples
        if self._on_closed is not None:
            self._on_closed(self)
        return samples

    async def abort(self, reason: str) -> None:
        """End the session's rollout ``aborted`` with ``reason`` (the gateway shutting down)."""
        self._closed = True
        if self._rollout is not None and not self._rollout.terminal:
            await self._rollout.abort(reason)

    def status(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers: the machine's state, turns and status."""
        sample = self._sample
        rollout = self._rollout
        return {
            "session_id": self.session_id,
            "closed": self._closed,
            "calls": self.calls,
            "sequences": len(self._sequences) + (sample is not None),
            "state": rollout.state if rollout is not None else "waiting_for_first_call",
            "turns": (rollout.turn_index + (rollout.state not in ("pending", "rendered", "generating")))
            if rollout is not None
            else 0,
            "status": sample.status.value if sample is not None else "pending",
            "reason": sample.metadata.get("rollout_reason") if sample is not None else None,
            "reward": self.reward,
            "metadata": self.metadata,
            "label": self.label,
        }
