"""The transition trace: JSON lines with a versioned schema, to a file, stdout or nowhere."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from structlog.contextvars import bound_contextvars

from fsm_rollout.trace import NULL_TRACER, TRACE_SCHEMA_VERSION, Tracer, capture_transitions, get_tracer

pytestmark = pytest.mark.synthetic_paths


def test_file_sink_writes_one_json_line_per_transition(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tracer = get_tracer(path)
    with bound_contextvars(sample_id="s1", session_id=None):
        tracer.transition(trigger="render", src="pending", dst="rendered")
        tracer.transition(trigger="generate", src="rendered", dst="generating")
    tracer.close()
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [line["trigger"] for line in lines] == ["render", "generate"]
    assert all(line["event"] == "transition" and line["schema"] == TRACE_SCHEMA_VERSION for line in lines)
    assert all(line["sample_id"] == "s1" and isinstance(line["ts"], float) for line in lines)


def test_the_same_path_shares_one_tracer(tmp_path: Path) -> None:
    assert get_tracer(tmp_path / "t.jsonl") is get_tracer(str(tmp_path / "t.jsonl"))


def test_off_writes_nothing_and_is_disabled() -> None:
    assert get_tracer(None) is NULL_TRACER
    assert get_tracer("off") is NULL_TRACER
    assert not NULL_TRACER.enabled


def test_capture_sees_events_of_a_disabled_tracer() -> None:
    with capture_transitions() as events:
        assert NULL_TRACER.enabled
        NULL_TRACER.transition(trigger="abort", src="pending", dst="aborted")
    assert events == [{"event": "transition", "trigger": "abort", "src": "pending", "dst": "aborted"}]
    NULL_TRACER.transition(trigger="x", src="a", dst="b")
    assert len(events) == 1


def test_stream_tracer_writes_bytes(tmp_path: Path) -> None:
    path = tmp_path / "raw.jsonl"
    with path.open("wb") as stream:
        Tracer(stream).transition(trigger="render", src="pending", dst="rendered", dwell_ms=1.5)
    assert orjson.loads(path.read_bytes())["dwell_ms"] == 1.5


def test_a_capture_and_a_file_sink_each_get_the_event_as_emitted(tmp_path: Path) -> None:
    path = tmp_path / "both.jsonl"
    tracer = get_tracer(path)
    fields = {"trigger": "render", "src": "pending", "dst": "rendered", "turn": 0}
    with capture_transitions() as events, bound_contextvars(sample_id="s9", session_id=None, step=4):
        tracer.emit(dict(fields))
    tracer.close()
    (line,) = [orjson.loads(raw) for raw in path.read_bytes().splitlines()]
    assert line == {
        **fields,
        "event": "transition",
        "sample_id": "s9",
        "session_id": None,
        "step": 4,
        "schema": TRACE_SCHEMA_VERSION,
        "ts": line["ts"],
    }
    assert events == [{**fields, "event": "transition", "sample_id": "s9", "session_id": None, "step": 4}]


def test_a_closed_file_tracer_is_reopened_by_the_next_lookup(tmp_path: Path) -> None:
    path = tmp_path / "again.jsonl"
    first = get_tracer(path)
    first.transition(trigger="render", src="pending", dst="rendered")
    first.close()
    second = get_tracer(path)
    assert second is not first
    second.transition(trigger="generate", src="rendered", dst="generating")
    second.close()
    assert [orjson.loads(raw)["trigger"] for raw in path.read_bytes().splitlines()] == ["render", "generate"]


def test_a_path_called_stdout_is_a_file_and_the_word_stdout_is_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from fsm_rollout import trace

    monkeypatch.setattr(trace, "_TRACERS", {})  # this test's own registry: the process's stdout tracer stays as is
    monkeypatch.setattr(trace, "_TRACERS_BY_SINK", {})
    monkeypatch.chdir(tmp_path)
    as_file = get_tracer(Path("stdout"))
    as_stream = get_tracer("stdout")
    assert as_file is not as_stream
    assert as_stream._stream is sys.stdout.buffer
    assert get_tracer(Path("stdout")) is as_file
    as_file.close()
    assert (tmp_path / "stdout").exists()


def test_a_relative_sink_follows_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    monkeypatch.chdir(first_dir)
    first = get_tracer("rel.jsonl")
    monkeypatch.chdir(second_dir)
    second = get_tracer("rel.jsonl")
    assert first is not second
    assert get_tracer(str(first_dir / "rel.jsonl")) is first  # the same file, however it is named
    first.close()
    second.close()
    assert (first_dir / "rel.jsonl").exists() and (second_dir / "rel.jsonl").exists()
