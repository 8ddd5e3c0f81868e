"""compat.generate's shared resources: one HTTP client per event loop and engine URL (closed with the loop), the
tokenizer and the processor."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fsm_rollout import RolloutConfig, VLLMClient, compat
from fsm_rollout.multimodal import IMAGE_PAD_TOKEN, processor_merge_size, validate_image_tokens

REPO = Path(__file__).resolve().parents[2]


def clients_seen() -> tuple[VLLMClient, VLLMClient, VLLMClient]:
    first = RolloutConfig(engine_url="http://127.0.0.1:8000", model="m", max_turns=1)
    second = RolloutConfig(engine_url="http://127.0.0.1:8001", model="m", max_turns=1)

    async def within_one_loop() -> tuple[VLLMClient, VLLMClient, VLLMClient]:
        return compat._client_for(first), compat._client_for(first), compat._client_for(second)

    return asyncio.run(within_one_loop())


def test_one_loop_shares_a_client_per_engine_url() -> None:
    a, again, other = clients_seen()
    assert a is again
    assert other is not a


def test_a_new_event_loop_gets_new_clients() -> None:
    first_loop, _, _ = clients_seen()
    second_loop, _, _ = clients_seen()
    assert second_loop is not first_loop


def test_a_checkpoint_whose_processor_needs_torchvision_still_gives_the_image_merge_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    """Qwen2-VL's AutoProcessor fails without torchvision; the merge size then comes from the image processor
    (a checkpoint's preprocessor_config.json is all it needs), so 4 placeholders for a 4x4 grid pass the check."""
    import transformers

    checkpoint = tmp_path / "qwen2-vl-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
                "merge_size": 2,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "min_pixels": 3136,
                "max_pixels": 12845056,
            }
        )
    )

    def needs_torchvision(*_: Any, **__: Any) -> Any:
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it was not found")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", needs_torchvision)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_, **__: tokenizer)
    monkeypatch.setattr(compat, "_TOKENIZERS", {})
    loaded_tokenizer, processor = compat._load_tokenizer_and_processor(str(checkpoint))
    assert loaded_tokenizer is tokenizer
    assert processor_merge_size(processor) == 2
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    grid = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    validate_image_tokens([1, *[pad] * 4, 2], tokenizer, processor, grid)  # merge size 1 would expect 16


TRAINER = """
import asyncio, sys, threading
from types import SimpleNamespace
from urllib.parse import urlsplit

from fsm_rollout import Sample, compat
from fsm_rollout.runtime import loop_shutdown
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

TOKENIZER = load_qwen_tokenizer()
compat.register_tokenizer("fake-model", TOKENIZER)


async def one_rollout():
    async with FakeVLLMServer(TOKENIZER, model="fake-model") as server:
        server.script([ScriptedTurn(text="42")])
        url = urlsplit(server.url)
        args = SimpleNamespace(vllm_router_ip=url.hostname, vllm_router_port=url.port, hf_checkpoint="fake-model",
                               max_turns=1, rollout_max_context_len=None, partial_rollout=False,
                               rollout_interaction_env_path="fsm_rollout.testing.envs")
        sampling = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
        sample = await compat.generate(args, Sample(prompt="What is 6 * 7?"), sampling)
        print("rollout", sample.status.value, flush=True)


asyncio.run(one_rollout())
asyncio.run(one_rollout())
print("after asyncio.run:", len(compat._CLIENTS), len(loop_shutdown._PENDING), flush=True)
background = asyncio.new_event_loop()  # a trainer's loop thread, still running at exit
threading.Thread(target=background.run_forever, daemon=True).start()
asyncio.run_coroutine_threadsafe(one_rollout(), background).result()
left_open = asyncio.new_event_loop()  # a loop never closed
left_open.run_until_complete(one_rollout())
"""


def test_clients_never_closed_by_the_caller_leave_no_unclosed_session_warning(tmp_path: Path) -> None:
    """asyncio.run twice, a loop thread and a loop left open, and close_clients() never called: the clients are
    closed when their loop shuts down, or at exit, so aiohttp has no unclosed session or connector to report."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-X", "dev", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("rollout truncated") == 4, result.stdout + result.stderr
    assert "after asyncio.run: 0 0" in result.stdout  # nothing kept for the loops asyncio.run closed
    assert "unclosed" not in result.stderr.lower(), result.stderr


def test_closing_clients_every_step_registers_one_shutdown_hook_per_loop() -> None:
    from fsm_rollout.runtime import loop_shutdown

    async def steps() -> int:
        loop = asyncio.get_running_loop()
        config = RolloutConfig(engine_url="http://127.0.0.1:9", model="m", max_turns=1)
        for _ in range(20):
            compat._client_for(config)
            await compat.close_clients()
        return len(loop_shutdown._PENDING.get(loop, {}))

    assert asyncio.run(steps()) == 1


def test_the_seed_compat_path_keeps_trusting_the_checkpoint_code_as_the_seed_trainer_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import transformers

    seen: list[tuple[str, bool]] = []

    def recording(kind: str) -> Any:
        def from_pretrained(path: str, **options: Any) -> Any:
            seen.append((kind, options.get("trust_remote_code", False)))
            if kind == "processor":
                raise ImportError("needs torchvision")
            return object()

        return from_pretrained

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording("tokenizer"))
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", recording("processor"))
    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", recording("image processor"))
    monkeypatch.setattr(compat, "_TOKENIZERS", {})
    compat._load_tokenizer_and_processor(str(tmp_path))
    assert seen == [("tokenizer", True), ("processor", True), ("image processor", True)]


def test_the_image_processor_runs_its_own_code_only_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import transformers

    from fsm_rollout.multimodal import load_image_processor

    seen: list[bool] = []
    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained",
                        lambda path, **options: seen.append(options["trust_remote_code"]) or object())  # fmt: skip
    load_image_processor(str(tmp_path))
    load_image_processor(str(tmp_path), trust_remote_code=True)
    assert seen == [False, True]
