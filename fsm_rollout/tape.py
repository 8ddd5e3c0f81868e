"""Deprecated: the I/O tape moved to :mod:`fsm_rollout.recording` (format, writer, recorder, reader).

The names this module had are re-exported from there; ``RecordingClient`` and ``RecordingTracer`` are gone (the
recorder plugs in as a transport and as the rollout's hooks: see :func:`fsm_rollout.recording.recorded_rollout`).
"""

from __future__ import annotations

import warnings

from fsm_rollout.recording import (
    BLOB_MIN_CHARS,
    TAPE_SCHEMA_VERSION,
    LineProblem,
    RecordingEnv,
    RecordingFormatError,
    SampleRecorder,
    SchemaVersionError,
    TapeFile,
    TapeSample,
    TapeWriter,
    get_tape_writer,
    read_json_lines,
    read_tape,
    tape_path_for,
    tape_writer_for,
)

warnings.warn(
    "fsm_rollout.tape is deprecated: import from fsm_rollout.recording instead", DeprecationWarning, stacklevel=2
)

__all__ = [
    "BLOB_MIN_CHARS",
    "TAPE_SCHEMA_VERSION",
    "LineProblem",
    "RecordingEnv",
    "RecordingFormatError",
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
