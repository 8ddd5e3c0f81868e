"""Internal: real chat templates of thinking models, shipped as data (each file's header names its source); the
embedded engine serves ``qwen3_6`` with its thinking model, and the tests use them all.

* ``qwen3``: Qwen3. History drops the ``<think>`` block of every assistant turn at or before the last user query;
  ``enable_thinking=False`` pre-fills an empty think block in the generation prompt.
* ``qwen3_5``: Qwen3.5 (thinking). The generation prompt opens ``<think>\\n``; history drops thinking as Qwen3 does.
* ``qwen3_6``: Qwen3.6, Qwen3.5 plus the ``preserve_thinking`` switch that keeps every turn's thinking.
* ``qwen3_8``: Qwen3.8. Keeps thinking by default, but reads it from ``reasoning_content`` only and writes every
  kept turn as ``<think>\\n{reasoning}\\n</think>\\n\\n``: a turn that did not reason, sampled after an open
  ``<think>\\n``, comes back as a closed empty block.
* ``tool_call_thinking``: written for these tests; keeps thinking only on tool-call turns (and after the last user
  message), strips it elsewhere.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Final

__all__ = ["CHAT_TEMPLATE_NAMES", "chat_template"]

CHAT_TEMPLATE_NAMES: Final = ("qwen3", "qwen3_5", "qwen3_6", "qwen3_8", "tool_call_thinking")
"""The shipped templates, by name (file ``<name>.jinja`` in this package)."""


@functools.cache
def chat_template(name: str) -> str:
    """The text of a shipped template (its source header is a Jinja comment, which renders nothing)."""
    if name not in CHAT_TEMPLATE_NAMES:
        raise ValueError(f"no shipped chat template {name!r}; the templates are {list(CHAT_TEMPLATE_NAMES)}")
    return importlib.resources.files(__name__).joinpath(f"{name}.jinja").read_text(encoding="utf-8")
