"""Writing a tape: one file per trace, appended to from a background thread so the event loop never waits on disk."""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import ConfigError, RolloutError
from fsm_rollout.recording.format import (
    TAPE_SCHEMA_VERSION,
    PendingBlob,
    dumps_line,
    encode_sample_parts,
    tape_path_for,
    tokenizer_fingerprint,
)


class TapeWriter:
    """Appends sample records to one tape file; the file is written by a background thread.

    :meth:`submit` encodes a record on the caller's thread (JSON, blob hashing) and queues the bytes;
    the writer thread appends them and flushes whenever the queue runs empty, so the event loop never waits on the
    disk. :meth:`flush` blocks until everything queued so far is on disk. Writers are shared per path
    (:func:`get_tape_writer`) and closed at interpreter exit.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.run_id = uuid.uuid4().hex[:12]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = self.path.open("ab")
        self._written_blobs: set[str] = set()
        self._encode_lock = threading.Lock()
        self._queue: queue.SimpleQueue[bytes | PendingBlob | threading.Event | None] = queue.SimpleQueue()
        self._tokenizer_info: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._closed = False
        self._error: BaseException | None = None
        self.dropped_blobs: list[str] = []
        """Blobs that could not be written (hash and why); the samples using them replay as lacking them."""
        self._thread = threading.Thread(target=self._drain, name=f"fsm-rollout-tape-{self.run_id}", daemon=True)
        self._thread.start()
        from fsm_rollout._version import __version__

        header = {
            "kind": "header",
            "schema": TAPE_SCHEMA_VERSION,
            "run": self.run_id,
            "created": time.time(),
            "fsm_rollout": __version__,
        }
        self._queue.put(dumps_line(header))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (records submitted after it are dropped)."""
        return self._closed

    def submit(self, record: Mapping[str, Any]) -> None:
        """Encode one sample record and queue it for writing (a no-op once closed or after a write failed)."""
        if self._closed or self._error is not None:
            return
        with self._encode_lock:
            parts = encode_sample_parts(record, self._written_blobs)
            for part in parts:  # in order, under the lock: a blob line always precedes the records using it
                self._queue.put(part)

    def tokenizer_info(self, tokenizer: Any) -> dict[str, Any]:
        """What the tape says about a tokenizer (computed once per tokenizer object)."""
        cached = self._tokenizer_info.get(id(tokenizer))
        if cached is None or cached[0] is not tokenizer:
            cached = (tokenizer, tokenizer_fingerprint(tokenizer))
            self._tokenizer_info[id(tokenizer)] = cached
        return cached[1]

    def flush(self, timeout: float | None = 60.0) -> None:
        """Block until every record queued so far is written and flushed; raises if writing failed."""
        if not self._closed and self._thread.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait(timeout)
        self._raise_if_failed()

    def close(self) -> None:
        """Write what is queued, then close the file (later records are dropped); raises if writing failed."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=60.0)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RolloutError(
                f"writing the tape {self.path} failed ({type(self._error).__name__}: {self._error}); records after "
                "the failure were dropped"
            ) from self._error

    def _blob_line(self, blob: PendingBlob) -> bytes | None:
        """One blob's line; a blob that cannot be written at all is left out (the one sample using it replays as
        lacking it) instead of stopping the tape."""
        try:
            return blob.line()
        except Exception as error:
            self.dropped_blobs.append(f"{blob.digest}: {type(error).__name__}: {error}")
            return None

    def _drain(self) -> None:
        stream = self._stream
        try:
            while True:
                item = self._queue.get()
                while True:
                    if item is None:
                        stream.flush()
                        stream.close()
                        return
                    if isinstance(item, threading.Event):
                        stream.flush()
                        item.set()
                    elif isinstance(item, PendingBlob):
                        line = self._blob_line(item)  # packing (zlib) runs here, off the event loop
                        if line is not None:
                            stream.write(line)
                    else:
                        stream.write(item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                stream.flush()
        except BaseException as error:  # a full disk must not hang flush(): release every waiter
            self._error = error
            with contextlib.suppress(OSError):
                stream.close()
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return
                if isinstance(item, threading.Event):
                    item.set()


_WRITERS: dict[Path, TapeWriter] = {}
_WRITERS_LOCK = threading.RLock()  # re-entered: hold_tape_writer finds or opens the writer under it
_EXIT_HOOK_REGISTERED = False
_HOLDERS: dict[TapeWriter, int] = {}
"""How many owners :func:`hold_tape_writer` gave each writer to that have not released it yet."""
_PINNED: set[TapeWriter] = set()
"""Writers :func:`get_tape_writer` handed out: their callers never release them, so they stay open until exit."""


def get_tape_writer(path: str | Path) -> TapeWriter:
    """The process-wide writer of a tape file (opened once, appended to, closed at exit).

    The exit hook that closes shared writers is registered when the first one is opened, not at import.
    """
    with _WRITERS_LOCK:
        writer = _shared_writer(path)
        _PINNED.add(writer)
    return writer


def hold_tape_writer(path: str | Path) -> TapeWriter:
    """The same shared writer as :func:`get_tape_writer`, for an owner that lets it go with
    :func:`release_tape_writer` (a runner, when it exits): it is closed, and its thread ends, once its last holder
    has released it, unless :func:`get_tape_writer` also handed it out."""
    with _WRITERS_LOCK:
        writer = _shared_writer(path)
        _HOLDERS[writer] = _HOLDERS.get(writer, 0) + 1
    return writer


def release_tape_writer(writer: TapeWriter) -> None:
    """Let go of a writer :func:`hold_tape_writer` gave: the last holder's release closes it (raises as
    :meth:`TapeWriter.close` does); otherwise what is queued so far is flushed."""
    with _WRITERS_LOCK:
        holders = _HOLDERS.pop(writer, 0) - 1
        if holders > 0:
            _HOLDERS[writer] = holders
        last = holders <= 0 and writer not in _PINNED
        if last and _WRITERS.get(writer.path) is writer:
            del _WRITERS[writer.path]
    if last:
        writer.close()
    else:
        writer.flush()


def _shared_writer(path: str | Path) -> TapeWriter:
    global _EXIT_HOOK_REGISTERED
    key = Path(path).expanduser().resolve()
    with _WRITERS_LOCK:
        writer = _WRITERS.get(key)
        if writer is None or writer.closed:
            if writer is not None:  # closed by its user: forget it
                _PINNED.discard(writer)
                _HOLDERS.pop(writer, None)
            writer = TapeWriter(key)
            _WRITERS[key] = writer
        if not _EXIT_HOOK_REGISTERED:
            atexit.register(_close_writers)
            _EXIT_HOOK_REGISTERED = True
    return writer


def tape_writer_for(config: RolloutConfig, *, hold: bool = False) -> TapeWriter | None:
    """The tape writer a config asks for: beside its trace file when ``record`` is on, else None. With ``hold``, it
    comes from :func:`hold_tape_writer` (the caller releases it with :func:`release_tape_writer`)."""
    if not config.record:
        return None
    if config.trace is None or str(config.trace) in ("off", "stdout", "-"):
        raise ConfigError("record=True needs a trace file path: the tape is written beside it")
    path = tape_path_for(config.trace)
    return hold_tape_writer(path) if hold else get_tape_writer(path)


def _close_writers() -> None:
    with _WRITERS_LOCK:
        writers = list(_WRITERS.values())
    for writer in writers:
        try:
            writer.close()
        except RolloutError as error:
            print(f"fsm-rollout: {error}", file=sys.stderr)
