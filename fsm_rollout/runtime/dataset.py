"""Reading rollout datasets: one JSON object per line, turned into pending samples with clear errors per line.

A line is ``{"prompt": str | [messages], "images": [...], "label": ..., "metadata": {...}, "tools": [...]}``;
only ``prompt`` is required. Images are data URLs, ``http(s)`` URLs or file paths (relative paths resolve against
the dataset file's folder); a string prompt marks where each image goes with ``<image>``. ``tools`` ends up in
``sample.metadata["tools"]``, where the rollout sends it to the chat template.

With ``columns_to_row=True`` (``--env trl:...``: a TRL dataset's own columns, ``{"prompt": ..., "start": 3}``), any
other key is a column of the row and lands in ``sample.metadata["row"]``, which a TRL environment's
``reset(**row)`` gets; otherwise an unknown key is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.errors import RolloutError
from fsm_rollout.sample import Sample

KNOWN_KEYS = frozenset({"prompt", "images", "label", "metadata", "tools"})


class DatasetError(RolloutError, ValueError):
    """A dataset line is not a valid sample; the message names the file and line number."""

    def __init__(self, message: str, *, path: str, line: int) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


@dataclass
class Dataset:
    """Samples read from a file, and the lines skipped as bad (with their errors) when skipping was asked for."""

    samples: list[Sample]
    skipped: list[DatasetError] = field(default_factory=list)


def _check_messages(prompt: list[Any]) -> str | None:
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return f"prompt[{index}] must be a chat message {{'role': str, 'content': ...}}"
    return None


def sample_from_record(
    record: Any, *, index: int, base_dir: Path | None = None, columns_to_row: bool = False
) -> Sample:
    """Build a pending sample from one decoded dataset record (raises ValueError with what is wrong); with
    ``columns_to_row``, keys other than the known ones go to ``metadata["row"]`` (see the module docstring)."""
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - KNOWN_KEYS)
    if unknown and not columns_to_row:
        raise ValueError(f"unknown keys {unknown} (known: {sorted(KNOWN_KEYS)})")
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        problem = _check_messages(prompt)
        if problem:
            raise ValueError(problem)
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError("'prompt' must be a non-empty string or a list of chat messages")
    images = record.get("images", [])
    if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
        raise ValueError("'images' must be a list of strings (data URLs, http(s) URLs or file paths)")
    resolved = [_resolve_image(image, base_dir) for image in images]
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError("'metadata' must be an object")
    tools = record.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("'tools' must be a list of tool objects")
        metadata = {**metadata, "tools": tools}
    if unknown:
        row = metadata.get("row") or {}
        if not isinstance(row, dict):
            raise ValueError("'metadata.row' must be an object")
        metadata = {**metadata, "row": {**row, **{key: record[key] for key in unknown}}}
    return Sample(
        prompt=prompt,
        index=index,
        label=record.get("label"),
        metadata=dict(metadata),
        multimodal_inputs={"images": resolved} if resolved else None,
    )


def _resolve_image(image: str, base_dir: Path | None) -> str:
    if image.startswith(("data:", "http://", "https://")) or base_dir is None:
        return image
    path = Path(image).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines of a file with their 1-based line numbers."""
    with path.open("rb") as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield number, line


def load_jsonl(path: str | Path, *, skip_bad: bool = False, columns_to_row: bool = False) -> Dataset:
    """Read a JSONL dataset; a bad line raises :class:`DatasetError` (or is skipped and kept in ``skipped``).
    ``columns_to_row``: unknown keys are the row's columns (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError("no such file", path=str(file), line=0)
    dataset = Dataset(samples=[])
    for number, line in iter_lines(file):
        try:
            record = orjson.loads(line)
            sample = sample_from_record(
                record, index=len(dataset.samples), base_dir=file.parent, columns_to_row=columns_to_row
            )
        except (orjson.JSONDecodeError, ValueError) as error:
            bad = DatasetError(str(error), path=str(file), line=number)
            if not skip_bad:
                raise bad from error
            dataset.skipped.append(bad)
            continue
        dataset.samples.append(sample)
    return dataset
