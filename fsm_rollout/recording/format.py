"""The tape format: value encoding, blobs, token deltas, and the exceptions for unusable recordings.

Format: JSON lines, schema :data:`TAPE_SCHEMA_VERSION`. Three kinds of line:

``{"kind": "header", "schema": 3, "run": ID, "created": TS, "fsm_rollout": VERSION}``
    written each time a process opens the tape (tapes are appended to, like traces).
``{"kind": "blob", "hash": "sha256:<64 hex>", "data": TEXT}``
    one long string (an image data URL, a base64 feature tensor, routed experts ...), stored once per run and
    referenced as ``{"$blob": HASH}`` wherever it occurs. Strings of at least :data:`BLOB_MIN_CHARS` characters
    become blobs; a blob line always comes before the records that use it. The hash is that of TEXT.
``{"kind": "blob", "hash": ..., "encoding": "zlib+base64", "data": PACKED}``
    the same for a long base64 string whose bytes compress well (vLLM's multimodal feature items, float patches
    of mostly uniform images): PACKED is the base64 of the zlib-compressed decoded bytes, and TEXT is their
    canonical base64 again, so the string comes back exactly. Only strings of at least
    :data:`PACK_MIN_CHARS` characters that are canonical base64 and shrink to under :data:`PACK_MAX_RATIO` of
    their size are packed; the packing runs on the writer's thread. (Schema 1 tapes, written before packing, have
    no ``encoding`` and are read as they are.)
``{"kind": "sample", "schema": 3, "run": ID, ...}``
    one finished rollout:

    ``sample_id``, ``session_id``, ``rollout_uid``,     identity (``rollout_uid`` is unique per rollout, from
    ``request_prefix``                                  schema 2); the prefix makes generate request ids
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
    ``reset`` / ``close``                   ``error`` when the call raised; a ``reset`` that returned a step has
                                            ``result``: ``{"step": STEP}``
    ``step``                                ``text`` (the model's decoded turn) and ``result``: ``{"step": STEP}``
                                            (:meth:`StepResult.to_json <fsm_rollout.envs.step.StepResult.to_json>`:
                                            ``observation``, ``done``, ``reward``, ``truncated``, ``end``,
                                            ``next_call``, ``info``), or ``{"tuple_len": N}`` / ``{"type": NAME}``
                                            for a result that is neither a step nor a 3-tuple, ``{"contract_error":
                                            MESSAGE}`` for one the rollout refuses; or ``error`` (schema 2 and
                                            before: ``{"observation", "done"}`` and ``"truncated"`` when the info
                                            had it)
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

import base64
import binascii
import dataclasses
import hashlib
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH
from fsm_rollout.errors import EngineHTTPError, RolloutError
from fsm_rollout.multimodal import encode_pil_image

if TYPE_CHECKING:
    from fsm_rollout.config import RolloutConfig

TAPE_SCHEMA_VERSION = 3
READABLE_TAPE_SCHEMAS = frozenset({1, 2, 3})
"""Tape schemas this version reads: 2 adds packed blobs to 1 and changes nothing else; 3 records an environment
step as its typed :class:`~fsm_rollout.envs.step.StepResult` (older steps are read by
:mod:`fsm_rollout.replay.legacy_steps`)."""
PACK_MIN_CHARS = 64 * 1024
"""Blob strings at least this long are considered for packing."""
PACK_MAX_RATIO = 0.75
"""A blob is packed only when its packed form is under this share of its text."""
PACKED_ENCODING = "zlib+base64"
BLOB_MIN_CHARS = 1024
"""Strings at least this long are stored once as blobs and referenced by hash."""

ENGINE_OPS: Mapping[str, str] = {RENDER_PATH: "render", GENERATE_PATH: "generate", ABORT_PATH: "abort"}
ENV_METHODS = ("reset", "step", "format_observation", "close")

_REPR_LIMIT = 1000
_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


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


def jsonable(value: Any, *, images_as_urls: bool = False, fast_png: bool = False) -> Any:
    """``value`` as JSON-native data: tuples become lists, numpy values lists or numbers, anything else opaque.

    With ``images_as_urls`` PIL images become PNG data URLs (what the rollout would send for them: ``fast_png`` for
    an observation's, see :func:`~fsm_rollout.multimodal.prepare_render_messages`); otherwise they are opaque like
    any other object: ``{"$object": {"type": NAME, "repr": REPR}}``.
    """
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {
            key if isinstance(key, str) else str(key): jsonable(item, images_as_urls=images_as_urls, fast_png=fast_png)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [jsonable(item, images_as_urls=images_as_urls, fast_png=fast_png) for item in value]
    if images_as_urls and hasattr(value, "mode") and hasattr(value, "save"):
        return encode_pil_image(value, fast=fast_png)
    if hasattr(value, "tolist") and type(value).__module__.startswith("numpy"):
        return jsonable(value.tolist(), images_as_urls=images_as_urls, fast_png=fast_png)
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
        raise RecordingFormatError(f"malformed token list {preview(delta)}")
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
        self.new_blobs: list[bytes | PendingBlob] = []
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
            self.new_blobs.append(PendingBlob(digest, text) if len(text) >= PACK_MIN_CHARS else blob_line(digest, text))
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


def dumps_line(value: Any) -> bytes:
    return orjson.dumps(value, default=_opaque_default, option=_JSON_OPTIONS) + b"\n"


def _opaque_default(value: Any) -> Any:
    return opaque(value)


@dataclasses.dataclass(frozen=True, slots=True)
class PendingBlob:
    """A blob line still to be made (and maybe packed), so that the packing can run off the caller's thread."""

    digest: str
    text: str

    def line(self) -> bytes:
        return blob_line(self.digest, self.text)


def blob_line(digest: str, text: str) -> bytes:
    """The tape line of one blob: packed when it is long canonical base64 that compresses well, else as it is."""
    if len(text) >= PACK_MIN_CHARS:
        packed = _packed(text)
        if packed is not None:
            return dumps_line({"kind": "blob", "hash": digest, "encoding": PACKED_ENCODING, "data": packed})
    return dumps_line({"kind": "blob", "hash": digest, "data": text})


def _packed(text: str) -> str | None:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    if base64.b64encode(raw).decode("ascii") != text:  # only what unpacks to the very same string
        return None
    packed = base64.b64encode(zlib.compress(raw, 6)).decode("ascii")
    return packed if len(packed) < PACK_MAX_RATIO * len(text) else None


def unpack_blob(encoding: str | None, data: str) -> str:
    """A blob's text from its stored form; raises :class:`RecordingFormatError` for an unknown or damaged one."""
    if encoding is None:
        return data
    if encoding != PACKED_ENCODING:
        raise RecordingFormatError(f"unknown blob encoding {encoding!r}")
    try:
        return base64.b64encode(zlib.decompress(base64.b64decode(data, validate=True))).decode("ascii")
    except (binascii.Error, ValueError, zlib.error) as error:
        raise RecordingFormatError(f"a packed blob does not unpack: {error}") from error


def encode_sample_parts(record: Mapping[str, Any], written_blobs: set[str]) -> list[bytes | PendingBlob]:
    """A sample record as tape lines, the blob lines it needs that ``written_blobs`` lacks first; long blobs come as
    :class:`PendingBlob` for the writer's thread to pack.

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
    return [*externalizer.new_blobs, dumps_line(encoded)]


def encode_sample_record(record: Mapping[str, Any], written_blobs: set[str]) -> bytes:
    """:func:`encode_sample_parts` as the bytes of the lines."""
    return b"".join(
        part.line() if isinstance(part, PendingBlob) else part for part in encode_sample_parts(record, written_blobs)
    )


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
    """The config as the tape records it: :meth:`RolloutConfig.to_dict` (no API key, no ``reward_fn``)."""
    return {key: jsonable(value) for key, value in config.to_dict().items()}


def preview(value: Any, limit: int = 120) -> str:
    """A short repr for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
