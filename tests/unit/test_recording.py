"""The tape format: token deltas, run lengths, blobs stored once, tolerant line reading, the writer, path checks."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.errors import ConfigError, EngineHTTPError, RolloutError
from fsm_rollout.recording import (
    BLOB_MIN_CHARS,
    LineProblem,
    RecordingFormatError,
    SchemaVersionError,
    TapeFile,
    TapeWriter,
    read_json_lines,
    read_tape,
    tape_path_for,
    tape_writer_for,
)
from fsm_rollout.recording.format import (
    describe_error,
    encode_sample_record,
    expand_run_lengths,
    expand_tokens,
    jsonable,
    run_lengths,
    token_delta,
)
from fsm_rollout.replay import TracedPath, check_path, rebuild_error, revive

LONG = "data:image/png;base64," + "A" * BLOB_MIN_CHARS


def sample_record(sample_id: str, *, io: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "kind": "sample",
        "schema": 1,
        "run": "r",
        "sample_id": sample_id,
        "session_id": None,
        "request_prefix": "fsm-x",
        "config": {},
        "sampling_params": {},
        "sample": {"prompt": "q"},
        "io": io or [],
        "transitions": [],
        "result": {"status": "completed"},
    }


# --------------------------------------------------------------------------- values


def test_the_tape_sits_beside_the_trace() -> None:
    assert tape_path_for("out/run.jsonl") == Path("out/run.tape.jsonl")
    assert tape_path_for("run.log") == Path("run.log.tape.jsonl")


@pytest.mark.parametrize(
    ("tokens", "base", "keep"),
    [([1, 2, 3, 4], [1, 2], 2), ([1, 2], [], 0), ([1, 9, 3], [1, 2, 3], 1), ([1], [1, 2], 1), ([], [], 0)],
)
def test_token_lists_are_stored_as_a_delta_on_the_previous_list(tokens: list[int], base: list[int], keep: int) -> None:
    delta = token_delta(tokens, base)
    assert delta["keep"] == keep
    assert expand_tokens(delta, base) == tokens


def test_a_delta_that_keeps_more_than_the_base_is_malformed() -> None:
    with pytest.raises(RecordingFormatError, match="malformed token list"):
        expand_tokens({"keep": 3, "add": []}, [1])


def test_loss_masks_are_stored_as_runs() -> None:
    mask = [1, 1, 0, 0, 0, 1]
    assert run_lengths(mask) == [[1, 2], [0, 3], [1, 1]]
    assert expand_run_lengths(run_lengths(mask)) == mask
    assert run_lengths(None) is None and expand_run_lengths(None) is None


def test_values_that_are_not_json_become_named_stand_ins() -> None:
    class Board:
        def __repr__(self) -> str:
            return "<Board 3x3>"

    assert jsonable({"a": (1, 2), 3: Board()}) == {
        "a": [1, 2],
        "3": {"$object": {"type": "Board", "repr": "<Board 3x3>"}},
    }
    revived = revive(jsonable(Board()))
    assert type(revived).__name__ == "Board"
    assert repr(revived) == "<Board 3x3>"


def test_pil_images_become_data_urls_only_when_asked() -> None:
    from PIL import Image

    image = Image.new("RGB", (4, 4), (1, 2, 3))
    assert jsonable(image, images_as_urls=True).startswith("data:image/png;base64,")
    assert jsonable(image)["$object"]["type"] == "Image"


def test_errors_keep_their_class_name_and_message_through_the_tape() -> None:
    described = describe_error(EngineHTTPError("POST x answered HTTP 400", status=400, url="x", body="{}"))
    assert described["status"] == 400
    rebuilt = rebuild_error(described)
    assert type(rebuilt).__name__ == "EngineHTTPError"
    assert str(rebuilt) == "POST x answered HTTP 400"
    assert str(rebuild_error(describe_error(KeyError("k")))) == "'k'"


# --------------------------------------------------------------------------- blobs


def test_a_long_string_is_stored_once_as_a_blob_across_records() -> None:
    written: set[str] = set()
    io = [{"op": "render", "request": {"image": LONG}, "answer": {"short": "x"}}, {"op": "reset"}]
    first = encode_sample_record(sample_record("1", io=io), written)
    second = encode_sample_record(sample_record("2", io=io), written)
    first_lines = [orjson.loads(line) for line in first.splitlines()]
    assert [line["kind"] for line in first_lines] == ["blob", "sample"]
    assert [orjson.loads(line)["kind"] for line in second.splitlines()] == ["sample"]
    entry = first_lines[1]["io"][0]
    assert entry["request"]["image"] == {"$blob": first_lines[0]["hash"]}
    assert entry["refs"] is True
    assert "refs" not in first_lines[1]["io"][1]


def test_blob_references_resolve_and_missing_ones_are_found() -> None:
    tape = TapeFile(Path("t"), blobs={"sha256:a": LONG})
    assert tape.resolve({"x": [{"$blob": "sha256:a"}, 1]}) == {"x": [LONG, 1]}
    assert tape.missing_blobs([{"$blob": "sha256:a"}, {"y": {"$blob": "sha256:b"}}]) == ["sha256:b"]


# --------------------------------------------------------------------------- reading


def test_unreadable_lines_are_reported_with_their_numbers_and_the_rest_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"broken": , "sample_id": "7"}\n[1, 2]\n{"b": 2}\n{"c": 3, "sample_id": "9", "d')
    rows, problems = read_json_lines(path)
    assert [number for number, _ in rows] == [1, 5]
    assert [(problem.line, problem.sample_id) for problem in problems] == [(3, "7"), (4, None), (6, "9")]
    assert "not valid JSON" in problems[0].message
    assert "cut off mid-line" in problems[2].message
    assert str(problems[0]).startswith("t.jsonl line 3 (sample 7): ")


def test_a_missing_file_is_a_recording_format_error(tmp_path: Path) -> None:
    with pytest.raises(RecordingFormatError, match="cannot read"):
        read_json_lines(tmp_path / "nope.jsonl")


def test_a_tape_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.tape.jsonl"
    path.write_bytes(orjson.dumps({"kind": "header", "schema": 4, "run": "r"}) + b"\n")
    with pytest.raises(
        SchemaVersionError,
        match=r"tape schema 4, but this fsm-rollout reads tape schema 3 \(and the "
        r"older 1, 2\)",
    ):
        read_tape(path)


def test_a_schema_1_tape_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "t.tape.jsonl"
    path.write_bytes(
        b"".join(
            orjson.dumps(line) + b"\n"
            for line in (
                {"kind": "header", "schema": 1, "run": "r"},
                {"kind": "blob", "hash": "sha256:a", "data": LONG},
                {**sample_record("0"), "schema": 1},
            )
        )
    )
    tape = read_tape(path)
    assert [record.sample_id for record in tape.samples] == ["0"]
    assert tape.blobs["sha256:a"] == LONG


def feature_like_base64(size: int) -> str:
    """Base64 of float32 patches of a mostly uniform image, like vLLM's multimodal feature items."""
    values = np.full(size // 4, 1.9303, dtype=np.float32)
    values[::97] = np.linspace(-1.0, 1.0, len(values[::97]), dtype=np.float32)
    return base64.b64encode(values.tobytes()).decode("ascii")


def test_long_compressible_base64_blobs_are_packed_and_come_back_exactly(tmp_path: Path) -> None:
    text = feature_like_base64(300_000)
    record = sample_record("0", io=[{"op": "render", "answer": {"features": {"kwargs_data": {"image": [text]}}}}])
    data = encode_sample_record(record, set())
    blob = orjson.loads(data.splitlines()[0])
    assert blob["encoding"] == "zlib+base64"
    assert len(blob["data"]) < len(text) / 10
    assert blob["hash"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()  # the hash of the text itself
    path = tmp_path / "t.tape.jsonl"
    path.write_bytes(orjson.dumps({"kind": "header", "schema": 2, "run": "r"}) + b"\n" + data)
    tape = read_tape(path)
    (entry,) = tape.samples[0].io
    assert tape.resolve(entry)["answer"]["features"]["kwargs_data"]["image"] == [text]


@pytest.mark.parametrize(
    "text",
    [
        "A" * 70_000 + "!",  # not base64
        base64.b64encode(np.random.default_rng(0).bytes(60_000)).decode("ascii"),  # does not compress
        "data:image/png;base64," + base64.b64encode(b"x" * 60_000).decode("ascii"),  # a data URL, not bare base64
    ],
    ids=["not-base64", "incompressible", "data-url"],
)
def test_blobs_that_would_not_come_back_exactly_or_would_not_shrink_are_stored_as_they_are(text: str) -> None:
    record = sample_record("0", io=[{"op": "render", "answer": {"x": text}}])
    blob = orjson.loads(encode_sample_record(record, set()).splitlines()[0])
    assert "encoding" not in blob
    assert blob["data"] == text


def test_a_tape_writer_packs_blobs_on_its_own_thread_and_keeps_blobs_before_their_records(tmp_path: Path) -> None:
    text = feature_like_base64(300_000)
    writer = TapeWriter(tmp_path / "t.tape.jsonl")
    for index in range(3):
        writer.submit(sample_record(str(index), io=[{"op": "render", "answer": {"features": text}}]))
    writer.close()
    kinds = [orjson.loads(line)["kind"] for line in (tmp_path / "t.tape.jsonl").read_bytes().splitlines()]
    assert kinds == ["header", "blob", "sample", "sample", "sample"]
    assert [record.sample_id for record in read_tape(tmp_path / "t.tape.jsonl").samples] == ["0", "1", "2"]


def test_an_unknown_blob_encoding_is_a_problem_and_the_sample_that_needs_it_lacks_it(tmp_path: Path) -> None:
    path = tmp_path / "t.tape.jsonl"
    path.write_bytes(
        b"".join(
            orjson.dumps(line) + b"\n"
            for line in (
                {"kind": "header", "schema": 2, "run": "r"},
                {"kind": "blob", "hash": "sha256:a", "encoding": "brotli", "data": "xx"},
                sample_record("0", io=[{"op": "render", "answer": {"$blob": "sha256:a"}, "refs": True}]),
            )
        )
    )
    tape = read_tape(path)
    assert any("blob encoding 'brotli' is unknown" in problem.message for problem in tape.problems)
    assert tape.missing_blobs(tape.samples[0].io) == ["sha256:a"]


def test_a_file_without_tape_records_is_not_a_tape(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"event": "transition"}\n')
    with pytest.raises(RecordingFormatError, match="not an fsm-rollout tape"):
        read_tape(path)


def test_a_malformed_sample_record_is_a_problem_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.tape.jsonl"
    bad = sample_record("3")
    del bad["io"]
    path.write_bytes(
        orjson.dumps({"kind": "header", "schema": 1, "run": "r"})
        + b"\n"
        + orjson.dumps(bad)
        + b"\n"
        + orjson.dumps(sample_record("4"))
        + b"\n"
    )
    tape = read_tape(path)
    assert [sample.sample_id for sample in tape.samples] == ["4"]
    assert tape.problems == [LineProblem(path, 2, "sample record lacks or mistypes io; skipped", "3")]


# --------------------------------------------------------------------------- writing


def test_the_writer_appends_a_header_then_blobs_before_the_records_that_use_them(tmp_path: Path) -> None:
    path = tmp_path / "run.tape.jsonl"
    writer = TapeWriter(path)
    writer.submit(sample_record("1", io=[{"op": "render", "request": {"image": LONG}}]))
    writer.flush()
    kinds = [orjson.loads(line)["kind"] for line in path.read_bytes().splitlines()]
    assert kinds == ["header", "blob", "sample"]
    writer.submit(sample_record("2", io=[{"op": "render", "request": {"image": LONG}}]))
    writer.close()
    tape = read_tape(path)
    assert [sample.sample_id for sample in tape.samples] == ["1", "2"]
    assert len(tape.blobs) == 1
    assert tape.runs == [writer.run_id]


def test_a_reopened_tape_is_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "run.tape.jsonl"
    for sample_id in ("1", "2"):
        writer = TapeWriter(path)
        writer.submit(sample_record(sample_id))
        writer.close()
    tape = read_tape(path)
    assert [sample.sample_id for sample in tape.samples] == ["1", "2"]
    assert len(tape.runs) == 2


def test_recording_needs_a_trace_file() -> None:
    with pytest.raises(ConfigError, match="record=True needs a trace file path"):
        RolloutConfig(engine_url="http://x:1", model="m", max_turns=1, record=True, trace="stdout")
    assert tape_writer_for(RolloutConfig(engine_url="http://x:1", model="m", max_turns=1)) is None


# --------------------------------------------------------------------------- checking paths


def path_of(*edges: tuple[str, str, str] | tuple[str, str, str, str], first_line: int = 10) -> TracedPath:
    path = TracedPath(sample_id="1", session_id=None)
    for offset, edge in enumerate(edges):
        event = {"src": edge[0], "trigger": edge[1], "dst": edge[2]}
        if len(edge) == 4:
            event["reason"] = edge[3]
        path.events.append(event)
        path.lines.append(first_line + offset)
    return path


def test_a_path_of_table_edges_ending_terminal_is_legal() -> None:
    verdict, findings = check_path(
        path_of(
            ("pending", "render", "rendered"),
            ("rendered", "generate", "generating"),
            ("generating", "step", "truncated", "length"),
        )
    )
    assert (verdict, findings) == ("legal", [])


def test_an_edge_missing_from_the_table_is_illegal_with_its_line() -> None:
    verdict, findings = check_path(path_of(("pending", "render", "rendered"), ("rendered", "step", "stepping")))
    assert verdict == "illegal"
    assert findings[0] == "line 11: rendered --step--> stepping is not a transition of today's table"


def test_a_reason_the_edge_cannot_give_is_illegal() -> None:
    verdict, findings = check_path(
        path_of(("pending", "render", "rendered"), ("rendered", "generate", "truncated", "length"))
    )
    assert verdict == "illegal"
    assert "with reason 'length'; today's table gives 'budget_exhausted'" in findings[0]


def test_an_abort_needs_the_callers_reason() -> None:
    assert check_path(path_of(("pending", "abort", "aborted", "weight_update")))[0] == "legal"
    assert check_path(path_of(("pending", "abort", "aborted")))[0] == "illegal"


def test_a_path_that_stops_in_a_non_terminal_state_is_unfinished() -> None:
    verdict, findings = check_path(path_of(("pending", "render", "rendered")))
    assert verdict == "unfinished"
    assert findings == ["unfinished: the last transition (line 10) leaves the sample in rendered"]


def test_a_jump_between_states_is_illegal_unless_an_unreadable_line_explains_it() -> None:
    path = path_of(("pending", "render", "rendered"), ("generating", "step", "truncated", "length"))
    assert check_path(path)[0] == "illegal"
    unreadable = [LineProblem(Path("t"), 10, "not valid JSON"), LineProblem(Path("t"), 11, "x")]
    path = path_of(("pending", "render", "rendered"), ("generating", "step", "truncated", "length"), first_line=10)
    path.lines = [10, 12]
    verdict, findings = check_path(path, unreadable)
    assert verdict == "damaged"
    assert "unreadable line 11 lies in between" in findings[0]


def test_a_transition_after_the_end_is_illegal() -> None:
    verdict, findings = check_path(
        path_of(("pending", "abort", "aborted", "x"), ("aborted", "fail", "failed", "error"))
    )
    assert verdict == "illegal"
    assert findings[0] == "line 11: aborted --fail--> failed after the sample ended in aborted"


# --------------------------------------------------------------------------- more blobs


def test_an_image_late_in_a_message_list_is_still_stored_as_a_blob() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": LONG}}]},
        {"role": "assistant", "content": "ok"},
    ]
    encoded = encode_sample_record(sample_record("1", io=[{"op": "render", "request": {"messages": messages}}]), set())
    assert LONG.encode() not in encoded.splitlines()[-1]


def test_a_failed_write_is_raised_at_flush_and_later_records_are_dropped(tmp_path: Path) -> None:
    writer = TapeWriter(tmp_path / "run.tape.jsonl")
    writer.flush()

    def full_disk(data: bytes) -> int:
        raise OSError(28, "No space left on device")

    writer._stream.write = full_disk  # type: ignore[method-assign]
    writer.submit(sample_record("1"))
    with pytest.raises(RolloutError, match=r"writing the tape .* failed \(OSError: \[Errno 28\] No space left"):
        writer.flush()
    writer.submit(sample_record("2"))
    assert writer._queue.empty()
    with pytest.raises(RolloutError):
        writer.close()


def test_a_long_blob_that_cannot_be_written_is_left_out_and_the_tape_goes_on(tmp_path: Path) -> None:
    unwritable = "\ud800" + "A" * 70_000  # a lone surrogate: no JSON encoder writes it
    writer = TapeWriter(tmp_path / "t.tape.jsonl")
    writer.submit(sample_record("0", io=[{"op": "step", "text": unwritable}]))
    writer.submit(sample_record("1"))
    writer.close()
    tape = read_tape(tmp_path / "t.tape.jsonl")
    assert [record.sample_id for record in tape.samples] == ["0", "1"]
    assert len(writer.dropped_blobs) == 1
    assert tape.missing_blobs(tape.samples[0].io) != []
