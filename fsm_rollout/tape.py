"""The I/O tape: every engine and environment exchange of a recorded rollout, kept for offline replay.

With recording on (``RolloutConfig(record=True)``, ``fsm-rollout run --record``) each rollout's client, environment
and tracer are wrapped by a :class:`SampleRecorder`; when the sample reaches a terminal state one ``sample`` record
is handed to a :class:`TapeWriter`, which writes it beside the transition trace (``run.jsonl`` →
``run.tape.jsonl``, see :func:`tape_path_for`) from a background thread. Without recording nothing is wrapped.

Format: JSON lines, schema :data:`TAPE_SCHEMA_VERSION`. Three kinds of line:

``{"kind": "header", "schema": 1, "run": ID, "created": TS, "fsm_rollout": VERSION}``
    written each time a process opens the tape (tapes are appended to, like traces).
``{"kind": "blob", "hash": "sha256:<64 hex>", "data": TEXT}``
    one long string (an image data URL, a base64 feature tensor, routed experts ...), stored once per run and
    referenced as ``{"$blob": HASH}`` wherever it occurs. Strings of at least :data:`BLOB_MIN_CHARS` characters
    become blobs; a blob line always comes before the records that use it.
``{"kind": "sample", "schema": 1, "run": ID, ...}``
    one finished rollout:

    ``sample_id``, ``session_id``, ``request_prefix``   identity; the prefix makes generate request ids
    ``started``, ``ended``                              wall-clock seconds
    ``config``, ``sampling_params``                     the ``RolloutConfig`` fields and the sampling parameters
    ``sample``                                          ``Sample.to_dict()`` as the rollout started (PIL images
                                                        as PNG data URLs)
    ``tokenizer``                                       ``name_or_path``, ``vocab_size``, ``eos_token_id``,
                                                        ``chat_template_sha256`` of the local tokenizer
    ``processor_merge_size``                            the image processor's merge size, or null
    ``io``                                              every exchange, in the order it started (below)
    ``transitions``                                     every transition event's fields, as traced, minus
                                                        ``dwell_ms`` (no ``ts``, ``sample_id``, ``session_id``)
    ``result``                                          ``status``, ``reason``, ``prompt_length``,
                                                        ``response_length``, ``tokens``, ``loss_mask`` (runs of
                                                        ``[value, count]``), ``rollout_log_probs``, ``error``

    ``io`` entries (``op`` names the call; an entry that references blobs has ``"refs": true``):

    ``render`` / ``generate`` / ``abort``   ``request`` (the JSON body; for ``generate`` without ``token_ids``,
                                            which are in ``tokens``), ``headers``, and one outcome: ``answer``
                                            (the engine's JSON), ``text`` (a non-JSON answer), ``error`` or
                                            ``cancelled: true``
    ``env_build``                           ``type`` (the environment's class name), ``missing`` (protocol
                                            methods it lacks) or ``error``
    ``reset`` / ``close``                   ``error`` when the call raised
    ``step``                                ``text`` (the model's decoded turn) and ``result``: ``{"observation",
                                            "done"}``, or ``{"tuple_len": N}`` / ``{"type": NAME}`` for a result
                                            that is not a 3-tuple; or ``error``
    ``format_observation``                  ``message`` (what the environment returned) or ``error``
    ``abort_requested``                     ``reason``, ``state``, ``running``, ``in_flight``: a caller's abort,
                                            where it landed

    ``error`` is ``{"type", "module", "message"}`` (plus ``status``/``url``/``body`` for HTTP errors). Values
    that are not JSON become ``{"$object": {"type", "repr"}}``. Token lists (``tokens`` of a generate entry and
    of the result) are ``{"keep": N, "add": [...]}``: the first N ids of the sample's previous token list, then
    ``add``. The previous list is the last generate request's ``token_ids``, before that the render answer's
    ``token_ids`` (when the answer has a list there), before that empty.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import hashlib
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from fsm_rollout import lifecycle
from fsm_rollout.config import DEFAULT_ENV_MODULE, RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH
from fsm_rollout.env import EnvFactory, load_env_factory
from fsm_rollout.errors import ConfigError, EngineHTTPError, RolloutError
from fsm_rollout.multimodal import encode_pil_image, processor_merge_size
from fsm_rollout.trace import Tracer

if TYPE_CHECKING:
    from fsm_rollout.rollout import Rollout

TAPE_SCHEMA_VERSION = 1
BLOB_MIN_CHARS = 1024
"""Strings at least this long are stored once as blobs and referenced by hash."""

ENGINE_OPS: Mapping[str, str] = {RENDER_PATH: "render", GENERATE_PATH: "generate", ABORT_PATH: "abort"}
ENV_METHODS = ("reset", "step", "format_observation", "close")

_REPR_LIMIT = 1000
_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
_SAMPLE_ID_IN_LINE = re.compile(rb'"sample_id":\s*"((?:[^"\\]|\\.)*)"')


class RecordingFormatError(RolloutError, ValueError):
    """A trace or tape cannot be used at all: missing, not JSON lines, or written with another schema version."""


class SchemaVersionError(RecordingFormatError):
    """A trace or tape was written with a schema version this fsm-rollout does not read."""


def tape_path_for(trace: str | Path) -> Path:
    """Where a trace file's tape lives: ``run.jsonl`` → ``run.tape.jsonl``, ``run.log`` → ``run.log.tape.jsonl``."""
    path = Path(trace).expanduser()
    if path.suffix == ".jsonl":
        return path.with_name(path.stem + ".tape.jsonl")
    return path.with_name(path.name + ".tape.jsonl")


# ---------------------------------------------------------------------------------------------------- values


def jsonable(value: Any, *, images_as_urls: bool = False) -> Any:
    """``value`` as JSON-native data: tuples become lists, numpy values lists or numbers, anything else opaque.

    With ``images_as_urls`` PIL images become PNG data URLs (what the rollout would send for them); otherwise they
    are opaque like any other object: ``{"$object": {"type": NAME, "repr": REPR}}``.
    """
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {key if isinstance(key, str) else str(key): jsonable(item, images_as_urls=images_as_urls)
                for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item, images_as_urls=images_as_urls) for item in value]
    if images_as_urls and hasattr(value, "mode") and hasattr(value, "save"):
        return encode_pil_image(value)
    if hasattr(value, "tolist") and type(value).__module__.startswith("numpy"):
        return jsonable(value.tolist(), images_as_urls=images_as_urls)
    return opaque(value)


def opaque(value: Any) -> dict[str, Any]:
    """The stand-in for a value that is not JSON: its class name and (truncated) repr."""
    return {"$object": {"type": type(value).__name__, "repr": repr(value)[:_REPR_LIMIT]}}


def describe_error(error: BaseException) -> dict[str, Any]:
    """An exception as tape data: class name, module and message; HTTP errors keep status, URL and body."""
    described: dict[str, Any] = {
        "type": type(error).__name__,
        "module": type(error).__module__,
        "message": str(error),
    }
    if isinstance(error, EngineHTTPError):
        described.update(status=error.status, url=error.url, body=error.body)
    return described


def token_delta(tokens: list[int], base: list[int]) -> dict[str, Any]:
    """``tokens`` as ``{"keep": N, "add": [...]}`` relative to ``base`` (see the module docstring)."""
    keep = len(base)
    if len(tokens) < keep or tokens[:keep] != base:
        limit = min(len(tokens), len(base))
        keep = 0
        while keep < limit and tokens[keep] == base[keep]:
            keep += 1
    return {"keep": keep, "add": list(tokens[keep:])}


def expand_tokens(delta: Mapping[str, Any], base: list[int]) -> list[int]:
    """The token list a :func:`token_delta` stands for."""
    keep = delta.get("keep")
    add = delta.get("add")
    if not isinstance(keep, int) or not isinstance(add, list) or keep > len(base):
        raise RecordingFormatError(f"malformed token list {_preview(delta)}")
    return base[:keep] + add


def run_lengths(values: Sequence[int] | None) -> list[list[int]] | None:
    """``[1, 1, 0]`` → ``[[1, 2], [0, 1]]``; None stays None."""
    if values is None:
        return None
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


def expand_run_lengths(runs: Sequence[Sequence[int]] | None) -> list[int] | None:
    """The inverse of :func:`run_lengths`."""
    if runs is None:
        return None
    values: list[int] = []
    for value, count in runs:
        values.extend([value] * count)
    return values


def answer_token_ids(answer: Any) -> list[int] | None:
    """The ``token_ids`` list of a render answer (the base of the first generate request's delta), if any."""
    if isinstance(answer, dict):
        token_ids = answer.get("token_ids")
        if isinstance(token_ids, list):
            return token_ids
    return None


class _Externalizer:
    """Replaces long strings with blob references while a record is encoded; knows which blobs are written."""

    def __init__(self, written: set[str]) -> None:
        self._written = written
        self._memo: dict[int, str] = {}  # id(string) → hash: one features string recurs in every generate body
        self.new_blobs: list[bytes] = []
        self.refs = 0

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._string(value) if len(value) >= BLOB_MIN_CHARS else value
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            if value and type(value[0]) in (int, float):
                return value  # token ids, logprobs: no strings inside
            if all(_flat_scalars(item) for item in value):
                return value  # e.g. logprob entries: checking is cheaper than rebuilding
            return [self.value(item) for item in value]
        return value

    def _string(self, text: str) -> dict[str, str]:
        digest = self._memo.get(id(text))
        if digest is None:
            digest = "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
            self._memo[id(text)] = digest
        if digest not in self._written:
            self._written.add(digest)
            self.new_blobs.append(_dumps({"kind": "blob", "hash": digest, "data": text}))
        self.refs += 1
        return {"$blob": digest}


def _flat_scalars(value: Any) -> bool:
    """Whether ``value`` is a dict of numbers and short strings (a list of such dicts is stored as it is)."""
    if type(value) is not dict:
        return False
    for item in value.values():
        if type(item) is str:
            if len(item) >= BLOB_MIN_CHARS:
                return False
        elif item is not None and type(item) not in (int, float, bool):
            return False
    return True


_FRAGMENT: Any = getattr(orjson, "Fragment", None)


def compact_json(value: Any) -> Any:
    """``value`` serialized now (an ``orjson.Fragment``), so that its many small objects need not stay alive.

    Generate answers hold a dict per generated token; kept until the sample ends they would cost the garbage
    collector more than serializing them at once. Without ``orjson.Fragment`` (orjson < 3.9.14) the value is
    kept as it is.
    """
    if _FRAGMENT is None:
        return value
    return _FRAGMENT(orjson.dumps(value, default=_opaque_default, option=_JSON_OPTIONS))


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=_opaque_default, option=_JSON_OPTIONS) + b"\n"


def _opaque_default(value: Any) -> Any:
    return opaque(value)


def encode_sample_record(record: Mapping[str, Any], written_blobs: set[str]) -> bytes:
    """A sample record as tape lines: the blob lines it needs that ``written_blobs`` lacks, then the record.

    Only the exchanges (``io``) and the ``sample`` snapshot are searched for long strings: they carry the images,
    feature tensors and routed experts that repeat; the other fields are written as they are.
    """
    externalizer = _Externalizer(written_blobs)
    encoded = dict(record)
    if "sample" in record:
        encoded["sample"] = externalizer.value(record["sample"])
    entries = []
    for entry in record.get("io", ()):
        before = externalizer.refs
        converted = externalizer.value(entry)
        if externalizer.refs != before:
            converted["refs"] = True
        entries.append(converted)
    encoded["io"] = entries
    return b"".join(externalizer.new_blobs) + _dumps(encoded)


# ---------------------------------------------------------------------------------------------------- writing


class TapeWriter:
    """Appends sample records to one tape file; the file is written by a background thread.

    :meth:`SampleRecorder.finish` encodes a record on the caller's thread (JSON, blob hashing) and queues the bytes;
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
        self._queue: queue.SimpleQueue[bytes | threading.Event | None] = queue.SimpleQueue()
        self._tokenizer_info: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=f"fsm-rollout-tape-{self.run_id}", daemon=True)
        self._thread.start()
        from fsm_rollout import __version__

        header = {"kind": "header", "schema": TAPE_SCHEMA_VERSION, "run": self.run_id, "created": time.time(),
                  "fsm_rollout": __version__}
        self._queue.put(_dumps(header))

    def recorder(self, rollout: Rollout, sampling_params: Mapping[str, Any], *, request_prefix: str) -> SampleRecorder:
        """A recorder for one rollout (call once, at the end of the rollout's construction)."""
        if self._closed:
            raise RolloutError(f"the tape {self.path} is closed")
        return SampleRecorder(self, rollout, sampling_params, request_prefix=request_prefix)

    def submit(self, record: Mapping[str, Any]) -> None:
        """Encode one sample record and queue it for writing (a no-op once closed or after a write failed)."""
        if self._closed or self._error is not None:
            return
        with self._encode_lock:
            data = encode_sample_record(record, self._written_blobs)
        self._queue.put(data)

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
_WRITERS_LOCK = threading.Lock()


def get_tape_writer(path: str | Path) -> TapeWriter:
    """The process-wide writer of a tape file (opened once, appended to, closed at exit)."""
    key = Path(path).expanduser().resolve()
    with _WRITERS_LOCK:
        writer = _WRITERS.get(key)
        if writer is None or writer._closed:
            writer = TapeWriter(key)
            _WRITERS[key] = writer
    return writer


def tape_writer_for(config: RolloutConfig) -> TapeWriter | None:
    """The tape writer a config asks for: beside its trace file when ``record`` is on, else None."""
    if not config.record:
        return None
    if config.trace is None or str(config.trace) in ("off", "stdout", "-"):
        raise ConfigError("record=True needs a trace file path: the tape is written beside it")
    return get_tape_writer(tape_path_for(config.trace))


@atexit.register
def _close_writers() -> None:
    with _WRITERS_LOCK:
        writers = list(_WRITERS.values())
    for writer in writers:
        try:
            writer.close()
        except RolloutError as error:
            print(f"fsm-rollout: {error}", file=sys.stderr)


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer well enough to warn when a replay uses a different one."""
    try:
        vocab_size: int | None = len(tokenizer)
    except TypeError:
        vocab_size = None
    template = getattr(tokenizer, "chat_template", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    name = getattr(tokenizer, "name_or_path", None)
    return {
        "name_or_path": str(name) if name else None,
        "vocab_size": vocab_size,
        "eos_token_id": eos if isinstance(eos, int) else None,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
    }


def config_to_json(config: RolloutConfig) -> dict[str, Any]:
    """The config's fields as JSON (the retry policy is left out: a replay sends no request)."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(config):
        if item.name != "retry":
            value = getattr(config, item.name)
            values[item.name] = jsonable(str(value) if isinstance(value, Path) else value)
    return values


class SampleRecorder:
    """Records one rollout's engine and environment exchanges and, at its terminal transition, submits the record.

    The rollout wires it in itself when it is given a tape (``Rollout(..., tape=writer)`` or ``config.record``):
    its client, tracer and environment factory are replaced by the recording ones below, and ``request_abort``
    reports to :meth:`abort_requested`.
    """

    def __init__(
        self, writer: TapeWriter, rollout: Rollout, sampling_params: Mapping[str, Any], *, request_prefix: str
    ) -> None:
        self._writer = writer
        self._rollout = rollout
        self._request_prefix = request_prefix
        self._started = time.time()
        self._sample = jsonable(rollout.sample.to_dict(), images_as_urls=True)
        self._config = config_to_json(rollout.config)
        self._sampling_params = jsonable(dict(sampling_params))
        self._tokenizer = writer.tokenizer_info(rollout.tokenizer)
        self._merge_size = processor_merge_size(rollout.processor)
        self._io: list[dict[str, Any]] = []
        self._transitions: list[dict[str, Any]] = []
        self._base_tokens: list[int] = []
        self._in_flight = False
        self._finished = False

    # ------------------------------------------------------------------ wiring

    def recording_client(self, client: VLLMClient) -> VLLMClient:
        """A client that sends through ``client`` and records each exchange."""
        if not callable(getattr(client, "post_json", None)):
            raise ConfigError(
                f"recording needs the engine's raw JSON answers: the client {type(client).__name__} has no post_json"
            )
        return RecordingClient(client, self)

    def recording_tracer(self, tracer: Tracer) -> Tracer:
        """A tracer that forwards to ``tracer`` and keeps each transition for the record."""
        return RecordingTracer(tracer, self)

    def recording_env_factory(self, factory: EnvFactory | None) -> EnvFactory:
        """A ``build_env`` that builds through ``factory`` (or the configured module) and records the environment."""
        config = self._rollout.config

        def build_env(**kwargs: Any) -> Any:
            entry = self._entry("env_build")
            try:
                inner = factory or load_env_factory(config.env_path or DEFAULT_ENV_MODULE)
                env = inner(**kwargs)
            except Exception as error:
                entry["error"] = describe_error(error)
                raise
            entry["type"] = type(env).__name__
            missing = [name for name in ENV_METHODS if not callable(getattr(env, name, None))]
            if missing:  # the rollout rejects it; calls on it are not recorded
                entry["missing"] = missing
                return env
            return RecordingEnv(env, self)

        return build_env

    # ------------------------------------------------------------------ recording

    def _entry(self, op: str, **fields: Any) -> dict[str, Any]:
        entry = {"op": op, **fields}
        self._io.append(entry)
        return entry

    def begin_engine(self, path: str, payload: Mapping[str, Any], headers: Mapping[str, str] | None) -> dict[str, Any]:
        """Record a request as it is sent (the outcome is filled in by the client)."""
        op = ENGINE_OPS.get(path, "post")
        entry = self._entry(op, headers=dict(headers) if headers else None)
        if op == "post":
            entry["path"] = path
        if op == "generate" and isinstance(payload.get("token_ids"), list):
            tokens = payload["token_ids"]
            entry["request"] = {key: value for key, value in payload.items() if key != "token_ids"}
            entry["tokens"] = token_delta(tokens, self._base_tokens)
            self._base_tokens = list(tokens)  # the list keeps growing: keep a copy
        else:
            entry["request"] = dict(payload)
        self._in_flight = True
        return entry

    def end_engine(self, entry: dict[str, Any]) -> None:
        """The request ended (answered, failed or cancelled)."""
        self._in_flight = False
        if entry["op"] == "render":
            token_ids = answer_token_ids(entry.get("answer"))
            if token_ids is not None:
                self._base_tokens = list(token_ids)

    def env_call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Record an environment call as it starts."""
        return self._entry(op, **fields)

    def abort_requested(self, reason: str, *, running: bool, in_flight: bool) -> None:
        """The caller asked the rollout to abort (``in_flight``: an engine request was pending)."""
        self._entry("abort_requested", reason=reason, state=self._rollout.state, running=running,
                    in_flight=in_flight)

    def transition(self, fields: Mapping[str, Any]) -> None:
        """Keep one transition's traced fields; submit the record when the rollout reached a terminal state."""
        kept = dict(fields)
        kept.pop("dwell_ms", None)
        self._transitions.append(kept)
        if fields.get("dst") in lifecycle.TERMINAL and not self._finished:
            self._finished = True
            self._writer.submit(self._record())
            self._io = []
            self._transitions = []

    def _record(self) -> dict[str, Any]:
        rollout = self._rollout
        sample = rollout.sample
        return {
            "kind": "sample",
            "schema": TAPE_SCHEMA_VERSION,
            "run": self._writer.run_id,
            "sample_id": rollout.sample_id,
            "session_id": sample.session_id,
            "request_prefix": self._request_prefix,
            "started": self._started,
            "ended": time.time(),
            "tokenizer": self._tokenizer,
            "processor_merge_size": self._merge_size,
            "config": self._config,
            "sampling_params": self._sampling_params,
            "sample": self._sample,
            "io": self._io,
            "transitions": self._transitions,
            "result": {
                "status": str(getattr(sample.status, "value", sample.status)),
                "reason": rollout.reason,
                "prompt_length": rollout.prompt_length,
                "response_length": sample.response_length,
                "tokens": token_delta(list(sample.tokens), self._base_tokens),
                "loss_mask": run_lengths(sample.loss_mask),
                "rollout_log_probs": None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
                "error": jsonable(sample.metadata.get("rollout_error")),
            },
        }


class RecordingClient(VLLMClient):
    """A :class:`VLLMClient` that sends through another client's ``post_json`` and records every exchange.

    ``render``, ``generate`` and ``abort`` are the base class's, so the answers are parsed exactly as without
    recording; the tape keeps the raw JSON.
    """

    def __init__(self, inner: VLLMClient, recorder: SampleRecorder) -> None:
        super().__init__(getattr(inner, "base_url", "http://recorded.invalid"))
        self._inner = inner
        self._recorder = recorder

    async def post_json(
        self, path: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> Any:
        entry = self._recorder.begin_engine(path, payload, headers)
        try:
            answer = await self._inner.post_json(path, payload, headers=headers)
        except asyncio.CancelledError:
            entry["cancelled"] = True
            raise
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        else:
            if isinstance(answer, str):
                entry["text"] = answer
            else:
                entry["answer"] = compact_json(answer) if entry["op"] == "generate" else answer
        finally:
            self._recorder.end_engine(entry)
        return answer


class RecordingEnv:
    """Wraps one environment: calls go through unchanged and are recorded (results as JSON, errors described)."""

    def __init__(self, env: Any, recorder: SampleRecorder) -> None:
        self._env = env
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def reset(self) -> Any:
        entry = self._recorder.env_call("reset")
        try:
            return self._env.reset()
        except Exception as error:
            entry["error"] = describe_error(error)
            raise

    def step(self, response_text: str) -> Any:
        entry = self._recorder.env_call("step", text=response_text)
        try:
            result = self._env.step(response_text)
            if isinstance(result, tuple) and len(result) == 3:
                entry["result"] = {"observation": jsonable(result[0]), "done": bool(result[1])}
            elif isinstance(result, tuple):
                entry["result"] = {"tuple_len": len(result)}
            else:
                entry["result"] = {"type": type(result).__name__}
        except Exception as error:  # bool(done) raising fails the rollout the same way unpacking it would
            entry.pop("result", None)
            entry["error"] = describe_error(error)
            raise
        return result

    def format_observation(self, observation: Any) -> Any:
        entry = self._recorder.env_call("format_observation")
        try:
            message = self._env.format_observation(observation)
        except Exception as error:
            entry["error"] = describe_error(error)
            raise
        entry["message"] = jsonable(message)
        return message

    def close(self) -> Any:
        entry = self._recorder.env_call("close")
        try:
            return self._env.close()
        except Exception as error:
            entry["error"] = describe_error(error)
            raise


class RecordingTracer(Tracer):
    """Forwards transition events to the rollout's tracer and hands their fields to the recorder."""

    def __init__(self, inner: Tracer, recorder: SampleRecorder) -> None:
        super().__init__(None)
        self._inner = inner
        self._recorder = recorder

    @property
    def enabled(self) -> bool:
        return True

    def emit(self, fields: dict[str, Any]) -> None:
        self._inner.emit(dict(fields))  # the inner tracer's sink adds to the dict it is given
        self._recorder.transition(fields)

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.close()


# ---------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class LineProblem:
    """A line of a trace or tape that could not be used (and was skipped)."""

    file: Path
    line: int
    message: str
    sample_id: str | None = None
    """The sample the line seems to belong to, when its text names one."""

    def __str__(self) -> str:
        owner = f" (sample {self.sample_id})" if self.sample_id is not None else ""
        return f"{self.file.name} line {self.line}{owner}: {self.message}"


def read_json_lines(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[LineProblem]]:
    """Every JSON-object line of a file with its 1-based line number, and the lines that could not be read.

    A last line without its newline that does not parse is reported as cut off (a crashed writer); any other
    unreadable line as corrupted. Blank lines are skipped silently.
    """
    try:
        stream = path.open("rb")
    except OSError as error:
        raise RecordingFormatError(f"cannot read {path}: {error.strerror or error}") from error
    rows: list[tuple[int, dict[str, Any]]] = []
    problems: list[LineProblem] = []
    with stream:
        for number, raw in enumerate(stream, 1):
            if not raw.strip():
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as error:
                owner = _SAMPLE_ID_IN_LINE.search(raw)
                sample_id = owner.group(1).decode("utf-8", "replace") if owner else None
                if not raw.endswith(b"\n"):
                    message = f"cut off mid-line after {len(raw)} bytes (the writer probably crashed); skipped"
                else:
                    message = f"not valid JSON ({error}); skipped"
                problems.append(LineProblem(path, number, message, sample_id))
                continue
            if not isinstance(value, dict):
                problems.append(LineProblem(path, number, f"a JSON {type(value).__name__}, not an object; skipped"))
                continue
            rows.append((number, value))
    return rows, problems


@dataclass(frozen=True)
class TapeSample:
    """One sample record of a tape (its fields as written; blob references unresolved)."""

    line: int
    sample_id: str | None
    session_id: str | None
    request_prefix: str
    config: dict[str, Any]
    sampling_params: dict[str, Any]
    sample: dict[str, Any]
    io: list[dict[str, Any]]
    transitions: list[dict[str, Any]]
    result: dict[str, Any]
    tokenizer: dict[str, Any]
    processor_merge_size: int | None
    run: str | None = None

    @property
    def status(self) -> str | None:
        """The recorded terminal state."""
        value = self.result.get("status")
        return value if isinstance(value, str) else None

    @property
    def reason(self) -> str | None:
        """The recorded terminal reason."""
        value = self.result.get("reason")
        return value if isinstance(value, str) else None


_REQUIRED_SAMPLE_FIELDS: Mapping[str, type] = {
    "request_prefix": str,
    "config": dict,
    "sampling_params": dict,
    "sample": dict,
    "io": list,
    "transitions": list,
    "result": dict,
}


@dataclass
class TapeFile:
    """A tape read from disk: its sample records, its blobs, and the lines that could not be used."""

    path: Path
    samples: list[TapeSample] = field(default_factory=list)
    blobs: dict[str, str] = field(default_factory=dict)
    problems: list[LineProblem] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)

    def resolve(self, value: Any) -> Any:
        """``value`` with blob references replaced by their text (a missing blob raises ``KeyError``)."""
        if isinstance(value, dict):
            if len(value) == 1:
                digest = value.get("$blob")
                if isinstance(digest, str):
                    return self.blobs[digest]
            return {key: self.resolve(item) for key, item in value.items()}
        if isinstance(value, list):
            if value and type(value[0]) in (int, float):
                return value
            return [self.resolve(item) for item in value]
        return value

    def missing_blobs(self, value: Any) -> list[str]:
        """Blob references in ``value`` that the tape does not hold."""
        return [digest for digest in _blob_refs(value) if digest not in self.blobs]


def _blob_refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        digest = value.get("$blob")
        if len(value) == 1 and isinstance(digest, str):
            yield digest
            return
        for item in value.values():
            yield from _blob_refs(item)
    elif isinstance(value, list) and value and type(value[0]) not in (int, float):
        for item in value:
            yield from _blob_refs(item)


def read_tape(path: str | Path) -> TapeFile:
    """Read a tape: unreadable lines and malformed records become problems; another schema version is an error."""
    tape = TapeFile(Path(path))
    rows, problems = read_json_lines(tape.path)
    tape.problems.extend(problems)
    for number, row in rows:
        kind = row.get("kind")
        schema = row.get("schema")
        if kind in ("header", "sample") and schema != TAPE_SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{tape.path} line {number}: tape schema {schema!r}, but this fsm-rollout reads tape schema "
                f"{TAPE_SCHEMA_VERSION}; replay it with the fsm-rollout version that recorded it"
            )
        if kind == "header":
            if isinstance(row.get("run"), str):
                tape.runs.append(row["run"])
        elif kind == "blob":
            digest, data = row.get("hash"), row.get("data")
            if isinstance(digest, str) and isinstance(data, str):
                tape.blobs[digest] = data
            else:
                tape.problems.append(LineProblem(tape.path, number, "blob line lacks a hash or its data; skipped"))
        elif kind == "sample":
            sample = _tape_sample(number, row)
            if isinstance(sample, str):
                tape.problems.append(LineProblem(tape.path, number, sample, _str_or_none(row.get("sample_id"))))
            else:
                tape.samples.append(sample)
        else:
            tape.problems.append(LineProblem(tape.path, number, f"unknown record kind {kind!r}; skipped"))
    if not tape.samples and not tape.runs:
        raise RecordingFormatError(f"{tape.path} is not an fsm-rollout tape (no header and no sample record)")
    return tape


def _tape_sample(number: int, row: dict[str, Any]) -> TapeSample | str:
    wrong = [name for name, kind in _REQUIRED_SAMPLE_FIELDS.items() if not isinstance(row.get(name), kind)]
    if wrong:
        return f"sample record lacks or mistypes {', '.join(wrong)}; skipped"
    if not all(isinstance(entry, dict) and isinstance(entry.get("op"), str) for entry in row["io"]):
        return "sample record has an io entry without an op; skipped"
    if not all(isinstance(event, dict) for event in row["transitions"]):
        return "sample record has a transition that is not an object; skipped"
    merge = row.get("processor_merge_size")
    tokenizer = row.get("tokenizer")
    return TapeSample(
        line=number,
        sample_id=_str_or_none(row.get("sample_id")),
        session_id=_str_or_none(row.get("session_id")),
        request_prefix=row["request_prefix"],
        config=row["config"],
        sampling_params=row["sampling_params"],
        sample=row["sample"],
        io=row["io"],
        transitions=row["transitions"],
        result=row["result"],
        tokenizer=tokenizer if isinstance(tokenizer, dict) else {},
        processor_merge_size=merge if isinstance(merge, int) and not isinstance(merge, bool) else None,
        run=_str_or_none(row.get("run")),
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _preview(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = [
    "BLOB_MIN_CHARS",
    "TAPE_SCHEMA_VERSION",
    "LineProblem",
    "RecordingClient",
    "RecordingEnv",
    "RecordingFormatError",
    "RecordingTracer",
    "SampleRecorder",
    "SchemaVersionError",
    "TapeFile",
    "TapeSample",
    "TapeWriter",
    "get_tape_writer",
    "read_json_lines",
    "read_tape",
    "tape_path_for",
    "tape_writer_for",
]
