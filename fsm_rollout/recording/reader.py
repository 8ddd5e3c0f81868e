"""Reading a tape: its sample records, its blobs, and the lines that could not be used."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.recording.format import (
    PACKED_ENCODING,
    READABLE_TAPE_SCHEMAS,
    TAPE_SCHEMA_VERSION,
    RecordingFormatError,
    SchemaVersionError,
    unpack_blob,
)

_SAMPLE_ID_IN_LINE = re.compile(rb'"sample_id":\s*"((?:[^"\\]|\\.)*)"')


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
    rollout_uid: str | None = None
    """Unique to the rollout (schema 2; None in older tapes)."""

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


class Blobs(Mapping[str, str]):
    """A tape's blobs by hash. Packed ones are kept packed and unpacked when looked up (the last few are kept
    unpacked: one feature item recurs in every generate request of its sample)."""

    _KEEP_UNPACKED = 4

    def __init__(self) -> None:
        self._stored: dict[str, tuple[str | None, str]] = {}
        self._unpacked: OrderedDict[str, str] = OrderedDict()

    def store(self, digest: str, data: str, encoding: str | None = None) -> None:
        """Keep one blob line's content (``encoding`` None: stored as it is)."""
        self._stored[digest] = (encoding, data)

    def __getitem__(self, digest: str) -> str:
        encoding, data = self._stored[digest]
        if encoding is None:
            return data
        text = self._unpacked.get(digest)
        if text is None:
            text = unpack_blob(encoding, data)
            self._unpacked[digest] = text
            if len(self._unpacked) > self._KEEP_UNPACKED:
                self._unpacked.popitem(last=False)
        else:
            self._unpacked.move_to_end(digest)
        return text

    def __contains__(self, digest: object) -> bool:
        return digest in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


@dataclass
class TapeFile:
    """A tape read from disk: its sample records, its blobs, and the lines that could not be used."""

    path: Path
    samples: list[TapeSample] = field(default_factory=list)
    blobs: Blobs = field(default_factory=Blobs)
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

    def damaged_blobs(self, value: Any) -> list[tuple[str, str]]:
        """Blob references in ``value`` whose stored (packed) form does not unpack, with the reason."""
        damaged = []
        for digest in _blob_refs(value):
            if digest in self.blobs:
                try:
                    self.blobs[digest]
                except RecordingFormatError as error:
                    damaged.append((digest, str(error)))
        return damaged


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
        if kind in ("header", "sample") and schema not in READABLE_TAPE_SCHEMAS:
            older = ", ".join(str(version) for version in sorted(READABLE_TAPE_SCHEMAS - {TAPE_SCHEMA_VERSION}))
            raise SchemaVersionError(
                f"{tape.path} line {number}: tape schema {schema!r}, but this fsm-rollout reads tape schema "
                f"{TAPE_SCHEMA_VERSION} (and the older {older}); replay it with the fsm-rollout version that "
                "recorded it"
            )
        if kind == "header":
            if isinstance(row.get("run"), str):
                tape.runs.append(row["run"])
        elif kind == "blob":
            digest, data, encoding = row.get("hash"), row.get("data"), row.get("encoding")
            if encoding is not None and encoding != PACKED_ENCODING:
                tape.problems.append(LineProblem(tape.path, number, f"blob encoding {encoding!r} is unknown; skipped"))
            elif isinstance(digest, str) and isinstance(data, str):
                tape.blobs.store(digest, data, encoding)
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
        rollout_uid=_str_or_none(row.get("rollout_uid")),
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
