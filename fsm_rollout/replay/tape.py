"""Reading one sample's record off the tape as a re-execution consumes it.

:class:`TapeCursor` hands out the record's ``io`` entries in the order they were recorded, resolves their blob
references, keeps the token list that generate requests are recorded relative to, and knows where the recorded
caller aborts (``abort_requested`` entries) landed. Anything the tape cannot give (no entry left, another call
next, a missing blob, a malformed token list) is returned as a :class:`~fsm_rollout.replay.compare.Divergence`;
the cursor raises nothing.

:func:`revive` and :func:`rebuild_error` turn recorded environment values and errors back into Python objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsm_rollout.recording.format import RecordingFormatError, answer_token_ids, expand_run_lengths, expand_tokens
from fsm_rollout.recording.reader import TapeFile, TapeSample
from fsm_rollout.replay.compare import Divergence, Outcome


class RecordedError(Exception):
    """An error the recording saw, raised again under its original class name (``type(error).__name__``)."""


class _Opaque:
    """Stands in for a recorded value that was not JSON: same class name, same repr."""

    def __init__(self, text: str) -> None:
        self._repr = text

    def __repr__(self) -> str:
        return self._repr


# One class per recorded name, so that values of one recorded class share a type as they did.
_ERROR_CLASSES: dict[tuple[str, str], type[RecordedError]] = {}
_OPAQUE_CLASSES: dict[str, type[_Opaque]] = {}


def rebuild_error(described: Mapping[str, Any]) -> RecordedError:
    """The exception a tape's ``error`` entry describes, with the recorded class name and message."""
    name = str(described.get("type") or "Exception")
    module = str(described.get("module") or "fsm_rollout.replay")
    cls = _ERROR_CLASSES.get((module, name))
    if cls is None:
        cls = type(name, (RecordedError,), {"__module__": module})
        _ERROR_CLASSES[(module, name)] = cls
    return cls(str(described.get("message", "")))


def revive(value: Any) -> Any:
    """Recorded environment data with ``{"$object": ...}`` stand-ins turned back into same-named, same-repr objects."""
    if isinstance(value, dict):
        described = value.get("$object")
        if len(value) == 1 and isinstance(described, dict):
            name = str(described.get("type") or "object")
            cls = _OPAQUE_CLASSES.get(name)
            if cls is None:
                cls = type(name, (_Opaque,), {})
                _OPAQUE_CLASSES[name] = cls
            return cls(str(described.get("repr", "")))
        return {key: revive(item) for key, item in value.items()}
    if isinstance(value, list):
        return [revive(item) for item in value]
    return value


def describe_entry(entry: Mapping[str, Any]) -> str:
    """An ``io`` entry as the call it records, for messages."""
    op = entry.get("op")
    if op == "abort_requested":
        return f"an abort ({entry.get('reason')}) requested in state {entry.get('state')}"
    if op in ("render", "generate", "abort"):
        return f"the {op} endpoint"
    if op == "post":
        return f"POST {entry.get('path')}"
    if op == "env_build":
        return "build_env()"
    return f"env.{op}()"


class TapeCursor:
    """One sample record's ``io`` entries, consumed in order."""

    def __init__(self, record: TapeSample, tape: TapeFile) -> None:
        self.record = record
        self.tape = tape
        self.position = 0
        self.base_tokens: list[int] = []
        """The token list the next generate request's ``tokens`` delta is relative to (see the tape format)."""

    @property
    def transitions(self) -> list[dict[str, Any]]:
        """The transition events the record kept."""
        return self.record.transitions

    def peek(self) -> dict[str, Any] | None:
        """The next entry, left in place (None when all are consumed)."""
        entries = self.record.io
        return entries[self.position] if self.position < len(entries) else None

    def take(self, op: str, call: str) -> dict[str, Any] | Divergence:
        """The next entry, which must record ``op`` (``call`` names today's call in the divergence otherwise)."""
        entry = self.peek()
        if entry is None:
            return Divergence(
                "missing answer",
                f"today's rollout calls {call}, but the recording has no more calls (the tape has no answer for it)",
            )
        if entry["op"] != op:
            return Divergence(
                "unexpected call",
                f"today's rollout calls {call}, but the recording's next call is {describe_entry(entry)}",
            )
        self.position += 1
        return entry

    def value(self, entry: Mapping[str, Any], key: str) -> Any:
        """An entry's field with its blob references resolved (a :class:`Divergence` when a blob is missing)."""
        value = entry.get(key)
        if not entry.get("refs"):
            return value
        try:
            return self.tape.resolve(value)
        except KeyError as error:
            return Divergence("tape", f"the tape lacks blob {error.args[0]} (tape line {self.record.line})")
        except RecordingFormatError as error:
            return Divergence("tape", f"a blob of this sample is damaged: {error} (tape line {self.record.line})")

    def generate_tokens(self, entry: Mapping[str, Any]) -> list[int] | Divergence | None:
        """The ``token_ids`` a generate entry recorded (None when it kept none); they become the next base."""
        delta = entry.get("tokens")
        if entry.get("op") != "generate" or not isinstance(delta, dict):
            return None
        try:
            tokens = expand_tokens(delta, self.base_tokens)
        except RecordingFormatError as error:
            return Divergence("tape", f"the generate request: {error}")
        self.base_tokens = tokens
        return tokens

    def answered(self, entry: Mapping[str, Any]) -> None:
        """A render answer's ``token_ids`` are the base of the first generate request's delta."""
        if entry.get("op") == "render":
            token_ids = answer_token_ids(entry.get("answer"))
            if token_ids is not None:
                self.base_tokens = list(token_ids)

    # ------------------------------------------------------------------ caller aborts

    def abort_before_start(self) -> str | None:
        """The reason of an abort the recording got before the sample started, consuming it."""
        entry = self.peek()
        if entry is not None and entry["op"] == "abort_requested" and not entry.get("running", True):
            self.position += 1
            return str(entry.get("reason"))
        return None

    def abort_landing(self, state: str, *, in_flight: bool) -> str | None:
        """The reason of a recorded abort request that arrived here (in ``state``, with or without a request
        pending), consuming it."""
        entry = self.peek()
        if entry is None or entry["op"] != "abort_requested" or entry.get("state") != state:
            return None
        if bool(entry.get("in_flight")) != in_flight:
            return None
        self.position += 1
        return str(entry.get("reason"))

    # ------------------------------------------------------------------ the result

    def recorded_tokens(self) -> list[int] | None:
        """The sample's final tokens as recorded (token lists are deltas along the io entries), if readable."""
        base: list[int] = []
        try:
            for entry in self.record.io:
                if entry["op"] == "generate" and isinstance(entry.get("tokens"), dict):
                    base = expand_tokens(entry["tokens"], base)
                elif entry["op"] == "render":
                    token_ids = answer_token_ids(entry.get("answer"))
                    if token_ids is not None:
                        base = list(token_ids)
            tokens = self.record.result.get("tokens")
            return expand_tokens(tokens, base) if isinstance(tokens, dict) else None
        except RecordingFormatError:
            return None

    def recorded_outcome(self) -> Outcome | Divergence:
        """The recorded result as an :class:`Outcome`."""
        result = self.record.result
        tokens = self.recorded_tokens()
        if tokens is None:
            return Divergence("tape", f"the recorded result has no readable tokens (tape line {self.record.line})")
        prompt_length = result.get("prompt_length")
        return Outcome(
            tokens=tokens,
            prompt_length=prompt_length if isinstance(prompt_length, int) else 0,
            loss_mask=expand_run_lengths(result.get("loss_mask")),
            rollout_log_probs=result.get("rollout_log_probs"),
            status=result.get("status"),
            reason=result.get("reason"),
            error=result.get("error"),
            branches=tuple(
                (list(branch.get("tokens") or []), expand_run_lengths(branch.get("loss_mask")))
                for branch in result.get("branches") or ()
                if isinstance(branch, dict)
            ),
        )


__all__ = ["RecordedError", "TapeCursor", "describe_entry", "rebuild_error", "revive"]
