"""The real Qwen2 tokenizer for tests and tools: the names of :mod:`fsm_rollout.engine.local.vocab`, kept here.

The tokenizer build and the cache directory moved into the embedded engine (which builds its model directories from
them and must not import ``testing``); this module keeps the old import path working.
"""

from fsm_rollout.engine.local.cache import CACHE_ENV_VAR, cache_dir
from fsm_rollout.engine.local.vocab import (
    BUILD_MARKER,
    BUILD_VERSION,
    QWEN2_PRETOKENIZE_PATTERN,
    QWEN2_SPECIAL_TOKENS,
    QWEN2_VL_CHAT_TEMPLATE,
    load_qwen_tokenizer,
    qwen_tokenizer_dir,
)

__all__ = [
    "BUILD_MARKER",
    "BUILD_VERSION",
    "CACHE_ENV_VAR",
    "QWEN2_PRETOKENIZE_PATTERN",
    "QWEN2_SPECIAL_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "cache_dir",
    "load_qwen_tokenizer",
    "qwen_tokenizer_dir",
]
