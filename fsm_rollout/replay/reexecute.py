"""Re-executing one recorded sample through today's rollout, answered from its tape record alone.

Today's :class:`~fsm_rollout.rollout.Rollout` runs with the record's sample, config and sampling parameters, and
every seam it has answered by the tape:

* the engine client's transport (:class:`_TapeTransport`): each request must be the next recorded one (compared
  with :func:`~fsm_rollout.replay.compare.compare_engine_request`), then gets the recorded answer, error or
  cancellation; today's :class:`~fsm_rollout.engine.client.VLLMClient` parses it;
* the environment (:class:`_TapeEnv`, named after the recorded class, with the environment protocol's ``reset``,
  ``step``, ``format_observation`` and ``close``): each call must be the next recorded one, ``step`` with the same
  text, and returns what the environment returned or raises what it raised;
* the hooks (:class:`_ComparingHooks`): each transition is compared with the recorded one as it fires.

Recorded caller aborts are re-issued where they landed: before the start, inside an environment call, during a
request (which is then cut off) or just after its answer. Recorded suspensions (weight updates) are re-issued by a
gate (:class:`_TapeGate`) that closes exactly where the recording's next transition is a ``suspend`` and never
waits: the aborted request's recorded answer carries the partial turn, and the continuation is the next recorded
request. When the rollout ends, its outcome is compared with the
recorded result. The first difference is kept; every later call raises :class:`ReplayDiverged` so that the
rollout ends at once. Nothing here touches process-wide state.

Why this module is long: the tape answers every seam of one rollout (transport, environment, gate, hooks) from one
shared cursor, and each seam must see what the others consumed in the same step; split across modules, that cursor
and its first-difference rule would be passed around instead of read in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.envs.step import StepResult
from fsm_rollout.errors import EnvironmentContractError
from fsm_rollout.hooks import RolloutHooks, RolloutView
from fsm_rollout.recording.format import ENGINE_OPS, jsonable
from fsm_rollout.recording.reader import TapeFile, TapeSample
from fsm_rollout.replay.compare import (
    Divergence,
    Outcome,
    TextContext,
    compare_engine_request,
    compare_env_call,
    compare_outcome,
    compare_transition,
    compare_transition_count,
    extra_transition,
    first_index,
    token_context,
)
from fsm_rollout.replay.legacy_steps import legacy_reset, legacy_step
from fsm_rollout.replay.tape import TapeCursor, describe_entry, rebuild_error, revive
from fsm_rollout.rollout import Rollout
from fsm_rollout.rollout.unbuilt import UnbuiltRollout
from fsm_rollout.sample import Sample
from fsm_rollout.tokens.chat import ObservationEncoder
from fsm_rollout.trace import NULL_TRACER
from fsm_rollout.weights.suspension import HandBack


class ReplayDiverged(Exception):
    """Today's rollout did something the recording did not; its replay stops (see :class:`Divergence`)."""


class _Replay:
    """What the seams of one re-executed sample share: the tape cursor, the rollout, the first divergence."""

    def __init__(self, record: TapeSample, tape: TapeFile, tokenizer: Any) -> None:
        self.cursor = TapeCursor(record, tape)
        self.tokenizer = tokenizer
        self.rollout: Rollout | None = None
        self.divergence: Divergence | None = None
        self.transitions: list[dict[str, Any]] = []
        """Today's transition events so far."""
        self.env_passthrough = False
        self.failed_first = False
        """Whether today's rollout had already failed with an error of its own when the first divergence came."""

    def stop(self, found: Divergence, *, here: bool = True) -> ReplayDiverged:
        """Keep ``found`` unless a divergence came first; ``here``: it happened at the rollout's turn and state."""
        if self.divergence is None:
            rollout = self.rollout
            if here and rollout is not None:
                found = dataclasses.replace(found, turn=rollout.turn_index, state=rollout.state)
            self.divergence = found
            # an error today's code raised (not this replay's stop) is why the calls after it differ
            self.failed_first = (
                rollout is not None and rollout.error is not None and not isinstance(rollout.error, ReplayDiverged)
            )
        return ReplayDiverged(found.message)

    def todays_error_first(self, rollout: Rollout | UnbuiltRollout) -> None:
        """Put the error today's rollout failed with before what it did next, when the recording did not fail so.

        A failing rollout closes its environment and ends: the calls and transitions that then differ from the
        recording only follow from the error, which is what the replay reports, with the difference it caused.
        """
        found = self.divergence
        today = jsonable(rollout.sample.metadata.get("rollout_error"))
        if found is None or not self.failed_first or not isinstance(today, dict):
            return
        recorded = self.cursor.record.result.get("error")
        if recorded == today:
            return
        where = f" in state {today.get('state')}" + (f" on {today['trigger']}" if today.get("trigger") else "")
        outcome = self.cursor.record.result
        if isinstance(recorded, dict):
            then = f"the recording failed with {recorded.get('type')}: {recorded.get('message')}"
        else:
            then = f"the recording did not fail: it ended {outcome.get('status')}/{outcome.get('reason')}"
        self.divergence = Divergence(
            "error",
            f"today's rollout failed{where}: {today.get('type')}: {today.get('message')} ({then}); after it, "
            f"{found.message}",
            turn=found.turn,
            state=found.state,
            line=found.line,
            expected=recorded,
            actual=today,
            context=found.context or self.token_context_now(),
        )

    def check_going(self) -> None:
        """Stop a rollout that goes on after a divergence."""
        if self.divergence is not None:
            raise ReplayDiverged(self.divergence.message)

    def take(self, op: str, call: str) -> dict[str, Any]:
        taken = self.cursor.take(op, call)
        if isinstance(taken, Divergence):
            raise self.stop(taken)
        return taken

    def value(self, entry: Mapping[str, Any], key: str) -> Any:
        value = self.cursor.value(entry, key)
        if isinstance(value, Divergence):
            raise self.stop(value)
        return value

    def differs(self, found: Divergence | None) -> None:
        """Stop on a request or environment call that differs from the recorded one (at the record's tape line)."""
        if found is not None:
            raise self.stop(dataclasses.replace(found, line=self.cursor.record.line))

    def abort_landing(self, *, in_flight: bool) -> str | None:
        rollout = self.rollout
        return None if rollout is None else self.cursor.abort_landing(rollout.state, in_flight=in_flight)

    def token_context_now(self) -> TextContext | None:
        """Where today's tokens so far part from the recording's final ones, if they do."""
        rollout = self.rollout
        recorded = self.cursor.recorded_tokens()
        if rollout is None or recorded is None:
            return None
        today = list(rollout.sample.tokens)
        index = first_index(recorded, today)
        if index >= min(len(recorded), len(today)):
            return None
        return token_context(self.tokenizer, recorded, today, index)

    def finish(self, rollout: Rollout | UnbuiltRollout) -> None:
        """Compare how the rollout ended with the recorded result, then that nothing recorded is left over."""
        if self.divergence is not None:
            return
        recorded = self.cursor.recorded_outcome()
        if isinstance(recorded, Divergence):
            self.stop(recorded)
            return
        sample = rollout.sample
        today = Outcome(
            tokens=list(sample.tokens),
            prompt_length=rollout.prompt_length or 0,
            loss_mask=sample.loss_mask,
            rollout_log_probs=sample.rollout_log_probs,
            status=str(getattr(sample.status, "value", sample.status)),
            reason=rollout.reason,
            error=jsonable(sample.metadata.get("rollout_error")),
            branches=tuple((list(branch.tokens), branch.loss_mask) for branch in sample.branches),
        )
        found = compare_outcome(
            recorded, today, tokenizer=self.tokenizer, transitions=self.cursor.transitions, turn=rollout.turn_index
        )
        if found is not None:
            self.stop(found, here=False)
            return
        found = compare_transition_count(self.cursor.transitions, len(self.transitions))
        if found is not None:
            self.stop(found)
            return
        leftover = self.cursor.peek()
        if leftover is not None:
            self.stop(
                Divergence(
                    "leftover",
                    f"today's rollout ended without the recording's next call: {describe_entry(leftover)}",
                    turn=rollout.turn_index,
                ),
                here=False,
            )


class _TapeTransport:
    """The engine, answered from the tape: a transport whose every POST gets the recorded outcome."""

    base_url = "http://replay.invalid"

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    async def close(self) -> None:
        """Nothing to release."""

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        replay = self._replay
        replay.check_going()
        op = ENGINE_OPS.get(path, "post")
        reason = replay.abort_landing(in_flight=True)
        if reason is not None:  # the recording's abort came before this request even started
            await self._cut_off(reason)
        entry = replay.take(op, f"POST {path}" if op == "post" else f"the {op} endpoint")
        recorded_tokens = replay.cursor.generate_tokens(entry)
        if isinstance(recorded_tokens, Divergence):
            raise replay.stop(recorded_tokens)
        replay.differs(
            compare_engine_request(
                f"the {op} request" if op != "post" else f"POST {entry.get('path')}",
                recorded_request=replay.value(entry, "request"),
                recorded_headers=entry.get("headers"),
                recorded_tokens=recorded_tokens,
                payload=payload,
                headers=headers,
                tokenizer=replay.tokenizer,
            )
        )
        if entry.get("cancelled"):
            if op == "abort":
                raise TimeoutError  # the abort notice ran out of time in the recording
            await self._cut_off(replay.abort_landing(in_flight=True) or "cancelled")
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        if "text" in entry:
            return replay.value(entry, "text")
        if "answer" not in entry:
            raise replay.stop(
                Divergence("tape", f"the recorded {op} call has no outcome (tape line {replay.cursor.record.line})")
            )
        answer = replay.value(entry, "answer")
        replay.cursor.answered(entry)
        late = replay.abort_landing(in_flight=True)
        if late is not None and replay.rollout is not None:  # arrived after the answer, before the rollout resumed
            asyncio.get_running_loop().call_soon(replay.rollout.request_abort, late)
        return answer

    async def _cut_off(self, reason: str) -> None:
        await _cut_off(self._replay, reason)


async def _cut_off(replay: _Replay, reason: str) -> None:
    """Re-issue the recording's abort while this request or environment step is pending: today's rollout must
    cancel it."""
    assert replay.rollout is not None
    replay.rollout.request_abort(reason)
    await asyncio.sleep(0)  # the rollout cancels this call: CancelledError lands here
    raise replay.stop(
        Divergence(
            "transition",
            f"the recording's abort ({reason}) cut this call off, but today's rollout did not cancel it",
        )
    )


class _TapeEnv:
    """The environment, answered from the tape (its class is renamed after the recorded one)."""

    def __init__(self, replay: _Replay, metadata: Any = None) -> None:
        self._replay = replay
        self._metadata = metadata

    def _call(self, op: str, *, text: str | None = None) -> dict[str, Any] | None:
        replay = self._replay
        if replay.divergence is not None:
            if op == "close":  # the rollout closes its environment on the way out: let it
                return None
            raise ReplayDiverged(replay.divergence.message)
        if replay.env_passthrough:
            return None
        entry = replay.take(op, f"env.{op}()")
        if op == "step":
            replay.differs(compare_env_call(op, replay.value(entry, "text"), text))
        reason = replay.abort_landing(in_flight=False)
        if reason is not None and replay.rollout is not None:  # the environment itself asked for the abort
            replay.rollout.request_abort(reason)
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        return entry

    def reset(self) -> StepResult | None:
        entry = self._call("reset")
        result = self._replay.value(entry, "result") if entry is not None and "result" in entry else None
        if isinstance(result, dict) and isinstance(result.get("step"), dict):
            return StepResult.from_json(result["step"], revive)
        return legacy_reset(self._metadata) if entry is not None else None

    def step(self, response_text: str) -> Any:
        entry = self._call("step", text=response_text)
        if entry is not None and "result" not in entry and "error" not in entry:
            reason = self._replay.abort_landing(in_flight=True)
            if reason is not None:  # the recording's abort cut this step off (a gateway stopped, say): again today
                return _cut_off(self._replay, reason)
        result = self._replay.value(entry, "result") if entry is not None else None
        if not isinstance(result, dict):
            return (None, False, {})
        if isinstance(result.get("step"), dict):
            return StepResult.from_json(result["step"], revive)
        if isinstance(result.get("tuple_len"), int):
            return tuple([None] * result["tuple_len"])
        if isinstance(result.get("type"), str):
            return revive({"$object": {"type": result["type"], "repr": ""}})
        if isinstance(result.get("contract_error"), str):
            raise EnvironmentContractError(result["contract_error"])
        truncated = {"truncated": revive(result["truncated"])} if "truncated" in result else {}
        return legacy_step(revive(result.get("observation")), bool(result.get("done")), truncated)

    def format_observation(self, observation: Any) -> Any:
        entry = self._call("format_observation")
        return None if entry is None else revive(self._replay.value(entry, "message"))

    def close(self) -> None:
        self._call("close")


_ENV_CLASSES: dict[str, type[_TapeEnv]] = {}


def _env_class(name: str) -> type[_TapeEnv]:
    cls = _ENV_CLASSES.get(name)
    if cls is None:
        cls = type(name, (_TapeEnv,), {})
        _ENV_CLASSES[name] = cls
    return cls


def _env_factory(replay: _Replay) -> Any:
    """A ``build_env`` that gives what the recorded one gave: an environment of its class, or its error."""

    def build_env(**kwargs: Any) -> Any:
        replay.check_going()
        entry = replay.take("env_build", "build_env()")
        error = entry.get("error")
        if isinstance(error, dict):
            raise rebuild_error(error)
        metadata = getattr(kwargs.get("sample"), "metadata", None)
        if "sample_tools" in entry and isinstance(metadata, dict):
            metadata["tools"] = revive(entry["sample_tools"])  # the recorded environment set them
        if "sample_prompt" in entry and kwargs.get("sample") is not None:
            kwargs["sample"].prompt = revive(entry["sample_prompt"])  # the recorded environment set it
        env = _env_class(str(entry.get("type") or "Environment"))(replay, metadata)
        missing = entry.get("missing")
        if isinstance(missing, list) and missing:  # the rollout rejects it, as it did the recorded one
            replay.env_passthrough = True
            for method in missing:
                setattr(env, str(method), None)
        return env

    return build_env


class _TapeGate:
    """The weight-update gate, answered from the recorded transitions: suspend where the recording suspended."""

    weight_version = None
    weight_updates = 0

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def _next_transition(self) -> Any:
        recorded = self._replay.cursor.transitions
        index = len(self._replay.transitions)
        return recorded[index] if index < len(recorded) else {}

    def _suspends_next(self, *, cut_request: bool) -> bool:
        """The recording's next transition is a suspension that cut a request off (or came before sending one)."""
        recorded = self._next_transition()
        return recorded.get("trigger") == "suspend" and bool(recorded.get("cut_request")) == cut_request

    def version_at(self, updates: int) -> str | None:
        return None

    def saw_version(self, version: str) -> None:
        """Nothing to learn."""

    def should_suspend(self) -> bool:
        return self._suspends_next(cut_request=False)

    def suspended_request(self, request_id: str) -> bool:
        return self._suspends_next(cut_request=True)

    def request_started(self, client: VLLMClient, request_id: str) -> None:
        """Nothing is in flight anywhere."""

    def request_ended(self, request_id: str) -> None:
        """Nothing is in flight anywhere."""

    async def wait_to_start(self) -> None:
        """Never waits."""

    async def wait_resumed(self) -> None:
        """Never waits: the recording resumed, or handed the sample back (then so does today's rollout)."""
        if self._next_transition().get("trigger") == "hand_back":
            raise HandBack


class _ComparingHooks(RolloutHooks):
    """Compares every transition of the re-executed rollout with the recorded one as it fires."""

    wants_events = True

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def transition(
        self, rollout: RolloutView, trigger: str, src: str, dwell_ms: float, fields: Mapping[str, Any] | None
    ) -> None:
        assert fields is not None
        replay = self._replay
        index = len(replay.transitions)
        replay.transitions.append(dict(fields))
        if replay.divergence is not None:
            return
        recorded = replay.cursor.transitions
        if index >= len(recorded):
            replay.stop(extra_transition(index, fields), here=False)
            return
        found = compare_transition(index, recorded[index], fields)
        if found is not None:
            replay.stop(dataclasses.replace(found, context=replay.token_context_now()), here=False)


def _unbuilt(record: TapeSample) -> bool:
    """Whether the recorded sample's rollout could not be built: its one transition is ``fail`` out of
    ``pending`` with no trigger under way (:class:`~fsm_rollout.rollout.unbuilt.UnbuiltRollout`)."""
    transitions = record.transitions
    return (
        len(transitions) == 1
        and transitions[0].get("trigger") == "fail"
        and transitions[0].get("src") == "pending"
        and transitions[0].get("failed_trigger") is None
        and not record.io
    )


_NOT_REPLAYED_CONFIG_FIELDS = frozenset({"trace", "record"})


def config_from(recorded: Mapping[str, Any]) -> tuple[RolloutConfig, list[str]]:
    """The recorded config as today's :class:`RolloutConfig` (:meth:`RolloutConfig.from_dict`: fields recorded
    under a former name read under today's), and the recorded fields unknown today, which are left out.

    The collector is never tuned: it is the whole process's, and the rollout's behaviour does not depend on it.
    """
    values = {key: value for key, value in recorded.items() if key not in _NOT_REPLAYED_CONFIG_FIELDS}
    values["tune_gc"] = False
    return RolloutConfig.from_dict(values, ignore_unknown=True), RolloutConfig.unknown_keys(recorded)


def _processor_for(merge_size: int | None) -> Any:
    if merge_size is None:
        return None
    return SimpleNamespace(image_processor=SimpleNamespace(merge_size=merge_size))


async def reexecute(
    record: TapeSample,
    tape: TapeFile,
    *,
    tokenizer: Any,
    encoder: ObservationEncoder | None = None,
) -> tuple[Divergence | None, int, list[str]]:
    """Re-run one recorded sample through today's rollout; returns (first divergence or None, turns run, notes)."""
    notes: list[str] = []
    missing = tape.missing_blobs([record.sample, *(entry for entry in record.io if entry.get("refs"))])
    if missing:
        return (
            Divergence(
                "tape", f"the tape lacks {len(missing)} blob(s) this sample needs, e.g. {missing[0]}", line=record.line
            ),
            0,
            notes,
        )
    damaged = tape.damaged_blobs([record.sample, *(entry for entry in record.io if entry.get("refs"))])
    if damaged:
        digest, why = damaged[0]
        return (
            Divergence(
                "tape", f"{len(damaged)} blob(s) this sample needs are damaged, e.g. {digest}: {why}", line=record.line
            ),
            0,
            notes,
        )
    replay = _Replay(record, tape, tokenizer)
    sample: Sample | None = None
    try:
        config, dropped = config_from(record.config)
        if dropped:
            notes.append(f"config fields unknown today were ignored: {', '.join(dropped)}")
        sample = Sample.from_dict(revive(tape.resolve(record.sample)))
        rollout = Rollout(
            sample,
            config=config,
            sampling_params=record.sampling_params,
            client=VLLMClient(transport=_TapeTransport(replay)),
            tokenizer=tokenizer,
            env_factory=_env_factory(replay),
            processor=_processor_for(record.processor_merge_size),
            tracer=NULL_TRACER,
            encoder=encoder,
            hooks=_ComparingHooks(replay),
            sample_id=record.sample_id,
            request_prefix=record.request_prefix,  # request ids are part of what is compared
            suspender=_TapeGate(replay),
        )
    except Exception as error:
        if sample is not None and _unbuilt(record):  # nor could the recording: the fail edge, compared as it fires
            unbuilt = UnbuiltRollout(
                sample,
                error,
                config=config,
                tokenizer=tokenizer,
                hooks=_ComparingHooks(replay),
                sample_id=record.sample_id,
                request_prefix=record.request_prefix,
            )
            unbuilt.fail()
            replay.finish(unbuilt)
            return replay.divergence, 0, notes
        return (
            Divergence(
                "setup",
                f"today's code rejects the recorded sample or config: {type(error).__name__}: {error}",
                line=record.line,
            ),
            0,
            notes,
        )
    if _unbuilt(record):
        recorded = record.result.get("error") or {}
        return (
            Divergence(
                "setup",
                "today's code builds the rollout the recording could not (it failed with "
                f"{recorded.get('type')}: {recorded.get('message')})",
                line=record.line,
            ),
            0,
            notes,
        )
    replay.rollout = rollout
    early_abort = replay.cursor.abort_before_start()
    if early_abort is not None:
        rollout.request_abort(early_abort)
    with contextlib.suppress(Exception):  # the recorded sample may have failed too: the outcome is compared after
        await rollout.run()
    replay.finish(rollout)
    replay.todays_error_first(rollout)
    turns = sum(1 for event in replay.transitions if event.get("trigger") == "step")
    return replay.divergence, turns, notes


__all__ = ["ReplayDiverged", "config_from", "reexecute"]
