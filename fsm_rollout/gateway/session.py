"""One gateway session: an agent's conversation, run as a rollout whose environment is the agent.

The first chat call's messages (and tools) are the prompt of a rollout. When the model has answered, the rollout
steps its environment, :class:`SessionEnvironment`, whose ``step(text)`` hands the answer to the waiting HTTP
call and waits for the agent's next call; that call's new messages are the observation, encoded like any other
(boundary tokens, mask 0), and the next generate request continues the same token sequence. Nothing the model
generated is ever re-tokenized: the answer is read from the sample's own tokens, and later calls are only checked
against it by meaning (:mod:`fsm_rollout.gateway.conversation`).

How a session ends is an edge of the lifecycle table, chosen by what the environment's step returns
(:mod:`fsm_rollout.rollout.agent_end`): the agent closed the session (``completed``, ``session_closed``) or went
idle past the limit (``truncated``, ``agent_timeout``). An agent that rewrote the history (edited, dropped or
compacted messages, changed tools) sends the whole conversation as the observation, and the rollout takes the
history policies' ``fork`` edge (reason ``history_rewritten``, :func:`fsm_rollout.rollout.history.rewrite_history`):
the sequence so far closes into ``sample.branches`` and the engine's render of the conversation as sent is the
next sequence's prompt, so each generated token is trained in exactly one sequence and no sequence holds a token
the model did not see. ``close`` returns the session's training sequences, oldest first
(:func:`fsm_rollout.sample.branches.training_sequences`).

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
from fsm_rollout.rollout.agent_end import AGENT_CALL_KEY, CLOSED, IDLE, agent_call, agent_end, agent_rewrite
from fsm_rollout.sample import Sample
from fsm_rollout.sample.branches import training_sequences
from fsm_rollout.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.runner import RolloutRunner

__all__ = ["GatewaySession", "SessionEnvironment", "TokenText"]

DISCONNECTED = "agent_disconnected"
"""The abort reason of a sequence whose agent went away while its call was being answered."""


class TokenText:
    """Reads an answer's text from its tokens: the tokenizer's end tokens and a decode, found once per gateway.

    A fast tokenizer without clean-up decodes through its backend directly, which is what its ``decode`` returns
    without the per-call wrapper work."""

    def __init__(self, tokenizer: Any, sampling_params: Mapping[str, Any]) -> None:
        ends = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
        ends.update(sampling_params.get("stop_token_ids") or ())
        self.end_token_ids: frozenset[int] = frozenset(token for token in ends if isinstance(token, int))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._decode: Callable[..., str] = backend.decode
        else:
            self._decode = tokenizer.decode

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids, skip_special_tokens=False) if token_ids else ""


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
        token_text: TokenText | None = None,
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
        self._tool_choice = "auto"
        self._runner = runner
        self._text = token_text or TokenText(runner.tokenizer, runner.sampling_params)
        self._on_closed = on_closed
        self._ended = asyncio.Event()
        self._expired = False
        self._reaper: asyncio.TimerHandle | None = None
        if idle_timeout_s is not None:  # a session never called has no rollout to time it out: a timer does
            self._reaper = asyncio.get_running_loop().call_later(idle_timeout_s, self._expire_if_never_called)
        self._closed = False
        self._closed_samples: list[Sample] | None = None
        self._busy = False
        self._sample: Sample | None = None
        self._rollout: Rollout | None = None
        self._task: asyncio.Future[Sample] | None = None
        self._held: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._answer: asyncio.Future[TurnAnswer] | None = None
        self._agent: asyncio.Future[tuple[str, Any]] | None = None
        self._last_answer: TurnAnswer | None = None
        self._mark = 0
        self._mark_branch = 0

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
            self._tool_choice = call.tool_choice
            if self._sample is None:
                self._start_sequence(call)
            else:
                kind, found = self._continue(call)
                if isinstance(found, TurnAnswer):
                    return found
                if kind == "rewritten":
                    self._fork(call, found)
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

    def _fork(self, call: ChatCall, detail: str) -> None:
        """The agent rewrote the history: the whole conversation as sent is the observation, and the rollout forks
        (the sequence so far closes into ``sample.branches``; the engine's render of the call is the next prompt)."""
        waiting = self._agent
        assert waiting is not None
        self._held = [dict(message) for message in call.messages]
        self._tools = [dict(tool) for tool in call.tools] if call.tools else None
        self._last_answer = None
        self.call_sampling = dict(call.sampling)
        self._answer = asyncio.get_running_loop().create_future()
        messages = [render_message(message) for message in call.messages]
        waiting.set_result(("rewritten", agent_rewrite(messages, self._tools, call.sampling, detail)))

    def _start_sequence(self, call: ChatCall) -> None:
        metadata: dict[str, Any] = {
            "gateway_session": dict(self.metadata),
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
        self._mark_branch = 0
        self._sample = sample
        # the runner's own rollout path (metrics, tape, trace, weight-update gate) with the rollout object kept,
        # so an agent that goes away can abort it with a reason of its own
        rollout = self._runner._rollout(sample, sample_id=f"{self.index}.0")
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
            return payload, False, {}
        info = {} if payload is None else {"reward": payload}
        return agent_end(CLOSED), True, info

    def _turn_positions(self) -> tuple[list[int], int]:
        """The positions of the tokens generated since the last answer, and where the request's prompt ended."""
        sample = self._sample
        assert sample is not None
        mask = sample.loss_mask or []
        offset = len(sample.tokens) - len(mask)
        # after a fork the sequence is new: its turn starts after its prompt
        start = max(self._mark, offset) if len(sample.branches) == self._mark_branch else offset
        positions = [i for i in range(start, len(sample.tokens)) if mask[i - offset] == 1]
        return positions, (positions[0] if positions else len(sample.tokens))

    def _read_answer(self, *, finish: str | None = None) -> TurnAnswer:
        sample = self._sample
        assert sample is not None
        positions, prompt_tokens = self._turn_positions()
        self._mark = len(sample.tokens)
        self._mark_branch = len(sample.branches)
        offset = len(sample.tokens) - len(sample.loss_mask or [])
        token_ids = [sample.tokens[i] for i in positions]
        logprobs = [float((sample.rollout_log_probs or [])[i - offset]) for i in positions]
        ends = self._text.end_token_ids
        cut = len(token_ids)
        while cut and token_ids[cut - 1] in ends:
            cut -= 1
        text_ids = token_ids[:cut]
        text = self._text.decode(text_ids)
        # tool_choice "none": no call is parsed, the markup stays content (the tokens are the model's either way)
        found = parse_tool_calls(text).calls if self._tool_choice != "none" else []
        content = text
        for call in reversed(found):
            content = content[: call.start] + content[call.end :]
        content = content.strip()
        calls = [
            {"id": f"call_{secrets.token_hex(12)}", "name": call.name, "arguments": dict(call.arguments)}
            for call in found
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
            top_logprobs=self._turn_top_logprobs(token_ids),
        )

    def _turn_top_logprobs(self, token_ids: list[int]) -> list[list[tuple[int, float]]] | None:
        """The top candidates of the answer's tokens, from the rollout's last turn (they are not kept on the
        sample): None when the call asked for none, or when that turn is not these tokens."""
        if self._rollout is None or not self.call_sampling.get("top_logprobs"):
            return None
        turn = self._rollout.ctx.turn
        if turn is None or turn.top_logprobs is None or list(turn.token_ids) != token_ids:
            return None
        return turn.top_logprobs

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

    def _expire_if_never_called(self) -> None:
        """The idle limit passed and the agent never called: the session ends ``truncated`` (``agent_timeout``)
        with no training sequence, and the gateway forgets it."""
        self._reaper = None
        if self.calls or self._closed:
            return
        self._expired = True
        self._closed = True
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
        if self._busy:
            raise GatewayError(409, "a call of this session is in flight; close it after the answer", code="busy")
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if reward is None:
            reward = self.reward
        waiting = self._agent
        if waiting is not None and not waiting.done():
            waiting.set_result(("close", reward))
        if self._task is not None:
            await asyncio.shield(self._task)
        sample = self._sample
        if sample is not None and reward is not None:
            sample.reward = reward
        samples = training_sequences([sample]) if sample is not None else []
        self._closed_samples = samples
        self._ended.set()
        if self._on_closed is not None:
            self._on_closed(self)
        return samples

    async def abort(self, reason: str) -> None:
        """End the session's rollout ``aborted`` with ``reason`` (the gateway shutting down)."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
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
            "sequences": len(sample.branches) + 1 if sample is not None else 0,
            "state": rollout.state if rollout is not None else "waiting_for_first_call",
            "turns": (rollout.turn_index + (rollout.state not in ("pending", "rendered", "generating")))
            if rollout is not None
            else 0,
            "status": sample.status.value if sample is not None else ("truncated" if self._expired else "pending"),
            "reason": sample.metadata.get("rollout_reason")
            if sample is not None
            else (IDLE if self._expired else None),
            "reward": self.reward,
            "metadata": self.metadata,
            "label": self.label,
        }
