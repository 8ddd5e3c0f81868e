"""Fixtures for the seed differential tests: the vime stand-in on ``sys.path`` for one test at a time."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

STANDIN_ROOT = Path(__file__).resolve().parent / "vime_standin"


def _drop_vime_modules() -> None:
    for name in [name for name in sys.modules if name == "vime" or name.startswith("vime.")]:
        del sys.modules[name]


@pytest.fixture
def vime_standin(tokenizer: Any) -> Iterator[ModuleType]:
    """Put the vime stand-in on ``sys.path`` for one test; yields its ``vllm_rollout`` with the tokenizer set.

    ``vime*`` modules are dropped before and after, so every test starts with a fresh ``GenerateState``
    singleton and nothing of the stand-in leaks into other tests.
    """
    root = str(STANDIN_ROOT)
    _drop_vime_modules()
    sys.path.insert(0, root)
    try:
        vllm_rollout = importlib.import_module("vime.rollout.vllm_rollout")
        vllm_rollout.TOKENIZER = tokenizer
        vllm_rollout.PROCESSOR = None
        yield vllm_rollout
    finally:
        _drop_vime_modules()
        if root in sys.path:
            sys.path.remove(root)
