"""Dataset lines become pending samples; bad lines are errors with their line numbers (or skipped and counted)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from fsm_rollout.runtime.dataset import DatasetError, load_jsonl


def write_lines(path: Path, *lines: object) -> Path:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else orjson.dumps(line) for line in lines) + b"\n")
    return path


def test_lines_become_pending_samples_in_order(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "calc_score"}}]
    path = write_lines(
        tmp_path / "d.jsonl",
        {"prompt": "<image> Find x.", "images": ["data:image/png;base64,AAAA"], "label": "70", "tools": tools},
        {"prompt": [{"role": "user", "content": "hi"}], "metadata": {"k": 1}},
    )
    samples = load_jsonl(path).samples
    assert [sample.index for sample in samples] == [0, 1]
    assert samples[0].multimodal_inputs == {"images": ["data:image/png;base64,AAAA"]}
    assert samples[0].label == "70"
    assert samples[0].metadata == {"tools": tools}
    assert samples[1].prompt == [{"role": "user", "content": "hi"}]
    assert samples[1].metadata == {"k": 1}
    assert samples[1].multimodal_inputs is None


def test_relative_image_paths_resolve_against_the_dataset_folder(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", {"prompt": "<image>x", "images": ["figs/a.png"]})
    assert load_jsonl(path).samples[0].multimodal_inputs == {"images": [str(tmp_path / "figs/a.png")]}


def test_blank_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert len(load_jsonl(path).samples) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{not json", "unexpected"),
        ([1, 2], "JSON object"),
        ({"label": 1}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [{"content": "no role"}]}, "prompt\\[0\\]"),
        ({"prompt": "x", "images": "a.png"}, "images"),
        ({"prompt": "x", "images": [b"x".hex(), 3]}, "images"),
        ({"prompt": "x", "metadata": []}, "metadata"),
        ({"prompt": "x", "tools": {"a": 1}}, "tools"),
        ({"prompt": "x", "labels": 1}, "unknown keys"),
    ],
)
def test_a_bad_line_names_its_line_number(tmp_path: Path, line: object, message: str) -> None:
    path = write_lines(tmp_path / "d.jsonl", {"prompt": "ok"}, line)
    with pytest.raises(DatasetError, match=message) as caught:
        load_jsonl(path)
    assert caught.value.line == 2
    assert str(caught.value).startswith(f"{path}:2: ")


def test_skip_bad_keeps_good_lines_and_counts_bad_ones(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", {"prompt": "a"}, b"oops", {"prompt": "b"})
    dataset = load_jsonl(path, skip_bad=True)
    assert [sample.prompt for sample in dataset.samples] == ["a", "b"]
    assert [sample.index for sample in dataset.samples] == [0, 1]
    assert [bad.line for bad in dataset.skipped] == [2]


def test_a_missing_file_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_jsonl(tmp_path / "absent.jsonl")
