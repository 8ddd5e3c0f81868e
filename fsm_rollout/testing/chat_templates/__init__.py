"""The shipped chat templates of thinking models (:mod:`fsm_rollout.tokens.chat_templates`, where the files live),
and the Qwen2 test tokenizer wearing one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_rollout.tokens.chat_templates import CHAT_TEMPLATE_NAMES, chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE_NAMES", "chat_template", "tokenizer_with_chat_template"]


def tokenizer_with_chat_template(name: str) -> PreTrainedTokenizerFast:
    """A fresh copy of the Qwen2 test tokenizer wearing a shipped template (see
    :func:`~fsm_rollout.testing.templates.qwen_tokenizer_with_template`; the real Qwen3.5/3.6 vocabulary, where
    ``<think>`` and the tool tags are special tokens, is :mod:`fsm_rollout.testing.qwen3_6_tokenizer`)."""
    from fsm_rollout.testing.templates import qwen_tokenizer_with_template

    return qwen_tokenizer_with_template(chat_template(name))
