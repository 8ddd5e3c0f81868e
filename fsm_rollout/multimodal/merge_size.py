"""The image merge size of a processor or a checkpoint, which the image-token check divides the grids by.

:func:`load_image_processor` finds it for checkpoints whose full processor does not load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def processor_merge_size(processor: Any) -> int | None:
    """``merge_size`` of a processor's image processor (or of the processor itself), or None."""
    if processor is None:
        return None
    image_processor = getattr(processor, "image_processor", processor)
    return _positive_int(getattr(image_processor, "merge_size", None))


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class CheckpointImageConfig:
    """What the image-token check needs of an image processor, read from a checkpoint's preprocessor config."""

    merge_size: int
    source: str


PREPROCESSOR_CONFIG = "preprocessor_config.json"


def checkpoint_merge_size(path: str | os.PathLike[str]) -> int | None:
    """``merge_size`` from ``preprocessor_config.json`` in a local checkpoint directory, or None."""
    config_file = Path(path).expanduser() / PREPROCESSOR_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _positive_int(config.get("merge_size")) if isinstance(config, dict) else None


def load_image_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """An object with the checkpoint's image ``merge_size``, for when its full processor cannot be loaded.

    Qwen2-VL's ``AutoProcessor`` also builds a video processor that needs torchvision; its image processor does
    not. Tried in order: ``AutoImageProcessor``, then ``merge_size`` from a local ``preprocessor_config.json``
    (as a :class:`CheckpointImageConfig`). None when neither exists, as for a text-only checkpoint.
    ``trust_remote_code`` lets an image processor that ships Python code run it.
    """
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)  # type: ignore[no-untyped-call,unused-ignore]
    except Exception:  # any failure (missing files, backends, remote code): the config file is read next
        pass
    merge_size = checkpoint_merge_size(path)
    if merge_size is None:
        return None
    return CheckpointImageConfig(merge_size=merge_size, source=str(Path(path).expanduser() / PREPROCESSOR_CONFIG))
