"""Tracing: one structlog JSON line per lifecycle transition, with a stable, versioned schema.

Schema (``schema`` = :data:`TRACE_SCHEMA_VERSION`), one object per line:

``event``            ``"transition"`` (a gateway session's own transitions are ``"session_transition"`` lines
                     with ``session_id``, ``trigger``, ``src``, ``dst``, ``reason``; readers skip them)
``schema``           schema version (int)
``ts``               wall-clock time of the transition, seconds since the epoch (float)
``sample_id``        the sample's id (its ``index`` when set, else a generated id)
``session_id``       the sample's session id (``x-session-id``), or null
``rollout_uid``       unique to one rollout of the sample (an index reused across steps gets a new one)
``trigger``          the event fired: ``render``, ``generate``, ``step``, ``observe``, ``abort``, ``fail``
``src`` / ``dst``    states before and after
``turn``             0-based turn index when the transition fired
``response_length``  response-side tokens so far (after the transition's actions)
``remaining_budget`` response budget left, or null when unbounded
``dwell_ms``         time spent in ``src``
``queued_ms``        a runner's batch, group or stream only, on a sample's first transition: how long it waited
                     for a concurrency slot before its rollout was made (``pending`` dwell starts after it)
``reason``           terminal edges only: why the sample ended (``env_done``, ``max_turns``, ``length``, ...)
payload summaries    ``prompt_tokens`` and ``image_hashes`` (render; one ``sha256:<16 hex>`` of each image's bytes,
                     or ``url-sha256:<16 hex>`` of an http(s) URL's text), ``generated_tokens``, ``finish``,
                     ``eos_inserted`` (step), ``observation_tokens`` and, for an observation with images,
                     ``observation_image_hashes`` (generate from observing),
                     ``error_type``/``error`` and ``failed_trigger`` (fail)

Never raw images or whole token arrays. Per-sample keys (``sample_id``, ``session_id``, ``rollout_uid``) are bound
as structlog contextvars in the task that drives the sample, so the user's own structlog lines inside environment
code carry them too. Tracing never configures structlog globally.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import structlog
from structlog.contextvars import get_contextvars, merge_contextvars

TRACE_SCHEMA_VERSION = 1
TRANSITION_EVENT = "transition"

_CAPTURES: list[list[dict[str, Any]]] = []


def _stamp_and_render(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> bytes:
    """The last processor: add the schema version and the wall-clock time, render one JSON line."""
    event_dict["schema"] = TRACE_SCHEMA_VERSION
    event_dict["ts"] = time.time()
    return orjson.dumps(event_dict, default=str, option=orjson.OPT_APPEND_NEWLINE)


class _TransitionLogger(structlog.BoundLoggerBase):
    """structlog wrapper class with the one method the tracer needs: run the processor chain on a transition's
    fields and hand the rendered line to the logger.

    It does what ``BoundLoggerBase._process_event`` does (bound context, then the fields, then ``event``; each
    processor in turn; :class:`structlog.DropEvent` drops the line) on the fields dict itself, which the caller
    builds fresh for each transition, instead of copying it twice through keyword arguments.
    """

    def transition(self, fields: dict[str, Any], event: str = TRANSITION_EVENT) -> None:
        event_dict: Any = {**self._context, **fields} if self._context else fields
        event_dict["event"] = event
        logger = self._logger
        try:
            for processor in self._processors:
                event_dict = processor(logger, "info", event_dict)
        except structlog.DropEvent:
            return
        logger.msg(event_dict)


class _LineWriter:
    """The structlog logger behind a tracer: appends each rendered line to a buffered stream without flushing.

    structlog's ``BytesLogger`` flushes on every line (a system call per transition); here the stream is flushed
    when a sample finishes (:meth:`Tracer.flush`) and when the buffer fills.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._write = stream.write

    def msg(self, line: bytes) -> None:
        self._write(line)


class Tracer:
    """Writes transition events to one sink (a binary stream), or nowhere when ``stream`` is None."""

    def __init__(self, stream: BinaryIO | None, *, owns_stream: bool = False) -> None:
        self._stream = stream
        self._owns_stream = owns_stream
        self._log: Any = None
        if stream is not None:
            self._log = _TransitionLogger(
                _LineWriter(stream), processors=[merge_contextvars, _stamp_and_render], context={}
            )

    @property
    def enabled(self) -> bool:
        """Whether events are written anywhere (a sink, or an active :func:`capture_transitions`)."""
        return self._log is not None or bool(_CAPTURES)

    def transition(self, **fields: Any) -> None:
        """Emit one transition event (see the module docstring for the fields)."""
        self.emit(fields)

    def emit(self, fields: dict[str, Any]) -> None:
        """Emit one transition event from a dict the tracer may keep and change (the rollout builds one per
        transition). Tracers that forward or inspect events override this method."""
        if _CAPTURES:  # before the sink's processors add to ``fields``
            event = {"event": TRANSITION_EVENT, **get_contextvars(), **fields}
            for captured in _CAPTURES:
                captured.append(dict(event))
        if self._log is not None:
            self._log.transition(fields)

    def other_event(self, event: str, fields: dict[str, Any]) -> None:
        """Write an event that is not a rollout's transition (``event`` names it, e.g. a gateway session's
        ``session_transition``) to the sink; readers of transitions skip it, and captures do not see it."""
        if self._log is not None:
            self._log.transition(fields, event)

    def flush(self) -> None:
        """Push buffered lines to the sink (called when a sample reaches a terminal state); nothing once closed."""
        if self._stream is not None and not self._stream.closed:
            self._stream.flush()

    def close(self) -> None:
        """Flush, and close the sink if this tracer opened it (a later :func:`get_tracer` opens it again)."""
        if self._stream is not None and not self._stream.closed:
            self._stream.flush()
            if self._owns_stream:
                self._stream.close()
                with _TRACERS_LOCK:
                    for registry in (_TRACERS, _TRACERS_BY_SINK):
                        for key in [key for key, tracer in registry.items() if tracer is self]:
                            del registry[key]
                    _PINNED.discard(self)
                    _HOLDERS.pop(self, None)


NULL_TRACER = Tracer(None)
"""A tracer that writes nothing (events still reach :func:`capture_transitions`)."""

_TRACERS: dict[str, Tracer] = {}
_TRACERS_BY_SINK: dict[Any, Tracer] = {}
"""The same tracers by the sink as given (relative paths with the working directory): a dictionary lookup per
rollout instead of resolving the path, which costs system calls."""
_HOLDERS: dict[Tracer, int] = {}
"""How many owners :func:`hold_tracer` gave each tracer to that have not released it yet."""
_PINNED: set[Tracer] = set()
"""Tracers :func:`get_tracer` handed out: their callers never release them, so they stay open until exit."""
_TRACERS_LOCK = threading.RLock()  # re-entered: hold_tracer finds or opens the tracer under it


def get_tracer(sink: str | Path | None) -> Tracer:
    """The process-wide tracer for a sink: None or ``"off"`` (nothing), ``"stdout"`` or ``"-"``, or a file path.

    File sinks are opened once, in append mode, and shared by every rollout that names the same path; one handed
    out here stays open until the process exits (see :func:`hold_tracer` for one that is closed when let go).
    """
    with _TRACERS_LOCK:
        tracer = _shared_tracer(sink)
        _PINNED.add(tracer)
    return tracer


def hold_tracer(sink: str | Path | None) -> Tracer:
    """The same shared tracer as :func:`get_tracer`, for an owner that lets it go with :func:`release_tracer`
    (a runner, when it exits): a file sink is closed once its last holder has released it, unless
    :func:`get_tracer` also handed it out."""
    with _TRACERS_LOCK:
        tracer = _shared_tracer(sink)
        _HOLDERS[tracer] = _HOLDERS.get(tracer, 0) + 1
    return tracer


def release_tracer(tracer: Tracer) -> None:
    """Let go of a tracer :func:`hold_tracer` gave; the last holder's release flushes and closes a file sink
    (a later :func:`get_tracer` or :func:`hold_tracer` opens it again)."""
    with _TRACERS_LOCK:
        holders = _HOLDERS.pop(tracer, 0) - 1
        if holders > 0:
            _HOLDERS[tracer] = holders
        last = holders <= 0 and tracer not in _PINNED
    if last:
        tracer.close()
    else:
        tracer.flush()


def _shared_tracer(sink: str | Path | None) -> Tracer:
    if sink is None or sink == "off":
        return NULL_TRACER
    given = str(sink)
    if isinstance(sink, str) and sink in ("stdout", "-"):
        fast_key: Any = ("stdout",)
    else:  # a path (a Path("stdout") is a file called stdout)
        fast_key = ("path", given) if os.path.isabs(given) else ("path", os.getcwd(), given)
    tracer = _TRACERS_BY_SINK.get(fast_key)
    if tracer is not None:
        return tracer
    key = "stdout" if sink in ("stdout", "-") else str(Path(sink).expanduser().resolve())
    with _TRACERS_LOCK:
        tracer = _TRACERS.get(key)
        if tracer is None:
            if key == "stdout":
                tracer = Tracer(sys.stdout.buffer)
            else:
                Path(key).parent.mkdir(parents=True, exist_ok=True)
                tracer = Tracer(open(key, "ab"), owns_stream=True)  # noqa: SIM115 - lives as long as the process
            _TRACERS[key] = tracer
        _TRACERS_BY_SINK[fast_key] = tracer
    return tracer


@contextmanager
def capture_transitions() -> Iterator[list[dict[str, Any]]]:
    """Collect every transition event emitted inside the block (for tests); yields the list being filled."""
    captured: list[dict[str, Any]] = []
    _CAPTURES.append(captured)
    try:
        yield captured
    finally:
        # by identity: two captures may hold equal lists
        del _CAPTURES[next(i for i, c in enumerate(_CAPTURES) if c is captured)]
