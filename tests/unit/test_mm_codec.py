"""Specification of ``fsm_rollout.multimodal.codec``: vLLM's multimodal item wire format, read and written without vLLM.

The fixtures in ``tests/fixtures/mm_items`` were encoded by real vLLM (``make_mm_fixtures.py``); the built-in
decoder must return bit-identical tensors, and re-encoding must give vLLM's bytes back.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from fsm_rollout.errors import FeatureCodecError, MultimodalError
from fsm_rollout.multimodal.codec import (
    FieldElem,
    FieldSpec,
    KwargsItem,
    decode_item,
    decode_item_msgpack,
    decode_item_tensors,
    decode_tensor,
    encode_item,
    encode_item_msgpack,
    encode_tensor,
    qwen_vl_image_items,
    render_features,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mm_items"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FIXTURE_NAMES = MANIFEST["items"]


def fixture_text(name: str) -> str:
    return (FIXTURES / f"{name}.b64").read_text().strip()


def fixture_expected(name: str) -> dict[str, Any]:
    fields: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())["fields"]
    return fields


def described(data: Any) -> Any:
    """Data in the fixtures' JSON form: a tensor as dtype, shape and the hex of its raw bytes."""
    if data is None or isinstance(data, bool | int | float):
        return data
    if isinstance(data, torch.Tensor):
        raw = data.flatten().contiguous().view(torch.uint8).numpy().tobytes()
        return {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape), "hex": raw.hex()}
    return [described(part) for part in data]


def wire_options(spec: FieldSpec) -> dict[str, Any]:
    """A FieldSpec's options in wire form (slices as [start, stop, step])."""

    def unslice(value: Any) -> Any:
        if isinstance(value, slice):
            return [value.start, value.stop, value.step]
        if isinstance(value, list | tuple):
            return [unslice(part) for part in value]
        return value

    return {key: unslice(value) for key, value in spec.options.items()}


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.flatten().contiguous().view(torch.uint8).numpy().tobytes()


def ramp(count: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixture script's deterministic values."""
    return ((torch.arange(count, dtype=torch.int64) % 97 - 48).to(torch.float64) / 8).to(dtype)


# ------------------------------------------------------------------------------------ real-vLLM fixtures


def test_fixtures_were_encoded_by_real_vllm_and_cover_every_required_dtype() -> None:
    assert MANIFEST["encoder"].endswith("mm_serde.encode_mm_kwargs_item")
    assert MANIFEST["vllm_version"]
    dtypes: set[str] = set()

    def collect(data: Any) -> None:
        if isinstance(data, dict):
            dtypes.add(data["dtype"])
        elif isinstance(data, list):
            for part in data:
                collect(part)

    for name in FIXTURE_NAMES:
        for field in fixture_expected(name).values():
            collect(field["data"])
    assert {"float32", "float16", "bfloat16", "uint8", "int64"} <= dtypes


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_builtin_decoder_returns_vllms_tensors_bit_for_bit(name: str) -> None:
    item = decode_item(fixture_text(name))
    expected = fixture_expected(name)
    assert sorted(item) == sorted(expected)
    for key, field in expected.items():
        assert described(item[key].data) == field["data"], key


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_builtin_decoder_reads_vllms_field_kinds_and_options(name: str) -> None:
    item = decode_item(fixture_text(name))
    for key, field in fixture_expected(name).items():
        kind, options = field["field"]
        assert item[key].field.kind == kind
        assert wire_options(item[key].field) == options


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_reencoding_a_decoded_vllm_item_gives_vllms_exact_bytes(name: str) -> None:
    text = fixture_text(name)
    assert encode_item(decode_item(text)) == text


def test_flat_slices_decode_to_slice_objects() -> None:
    item = decode_item(fixture_text("bfloat16_flat_dim1"))
    spec = item["embeds_bf16"].field
    assert spec.options["dim"] == 1
    assert spec.options["slices"] == [(slice(None), slice(0, 3)), (slice(None), slice(3, 7))]


def test_qwen_vl_image_items_split_a_batch_exactly_like_vllms_processor() -> None:
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]], dtype=torch.int64)
    pixel_values = ramp(28 * 12, torch.float32).reshape(-1, 12)
    pixel_values[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")])
    pixel_values[1, 0] = 1.0e-40
    items = qwen_vl_image_items(pixel_values, grid)
    assert [encode_item(item) for item in items] == [fixture_text("qwen2_vl_image0"), fixture_text("qwen2_vl_image1")]


def test_decode_item_tensors_gives_field_names_to_tensors() -> None:
    data = decode_item_tensors(fixture_text("qwen2_vl_image1"))
    assert data["image_grid_thw"].tolist() == [1, 2, 6]
    assert data["pixel_values"].shape == (12, 12)
    assert data["pixel_values"].dtype == torch.float32


def test_decoded_tensors_own_writable_memory() -> None:
    text = fixture_text("uint8_batched")
    first = decode_item_tensors(text)["raw_pixels"]
    first.zero_()
    assert decode_item_tensors(text)["raw_pixels"].sum() > 0


def test_a_decoded_item_behaves_like_vllms_item() -> None:
    item = decode_item(fixture_text("mixed_nested"))
    assert isinstance(item, KwargsItem)
    data = item.get_data()
    assert data["cached"] is None
    assert data["plain_float"] == 0.5
    assert data["plain_int"] == 7
    assert [tensor.tolist() for tensor in data["tensor_list"]] == [[1, 2], [3, 4, 5]]
    assert data["scalar_f32"].shape == ()
    assert data["empty_f32"].shape == (0, 3)


# ------------------------------------------------------------------------------------ own round trips


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.float64,
        torch.bool,
        torch.complex64,
    ],
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (5, 7), (2, 3, 4)])
def test_encode_then_decode_is_bit_identical(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    count = int(np.prod(shape)) if shape else 1
    source = (torch.arange(count, dtype=torch.int64) * 7919 % 251).to(torch.uint8)
    tensor = source.repeat_interleave(dtype.itemsize)[: count * dtype.itemsize].view(dtype).reshape(shape)
    item = KwargsItem(x=FieldElem(tensor, FieldSpec.batched()))
    decoded = decode_item(encode_item(item))["x"].data
    assert decoded.dtype == dtype
    assert tuple(decoded.shape) == shape
    assert raw_bytes(decoded) == raw_bytes(tensor)


@pytest.mark.parametrize("nbytes", [1, 2, 4, 8, 16, 17, 255, 256, 65535, 65536, 70000])
def test_every_msgpack_ext_size_class_round_trips(nbytes: int) -> None:
    tensor = (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8)
    wire = encode_tensor(tensor)
    assert wire[2].code == 3 and len(wire[2].data) == nbytes
    decoded = decode_item(encode_item(KwargsItem(x=FieldElem(tensor, FieldSpec.batched()))))["x"].data
    assert torch.equal(decoded, tensor)


def test_non_contiguous_tensors_are_encoded_in_c_order() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[:, 1:4].t()
    decoded = decode_item(encode_item(KwargsItem(x=FieldElem(view, FieldSpec.batched()))))["x"].data
    assert torch.equal(decoded, view.contiguous())


def test_numpy_arrays_are_encoded_as_the_torch_tensor_they_hold() -> None:
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    wire = encode_tensor(array)
    assert wire[:2] == ["int64", [2, 3]]
    assert decode_tensor(wire).tolist() == array.tolist()


def test_field_constructors_use_vllms_option_order() -> None:
    assert list(FieldSpec.batched().options) == ["keep_on_cpu"]
    assert list(FieldSpec.flat([slice(0, 2)]).options) == ["keep_on_cpu", "slices", "dim"]
    assert list(FieldSpec.shared(2).options) == ["keep_on_cpu", "batch_size"]
    assert FieldSpec.flat_from_sizes([2, 3], dim=1).options["slices"] == [
        (slice(None), slice(0, 2)),
        (slice(None), slice(2, 5)),
    ]


def test_render_features_carry_hashes_placeholders_and_encoded_items() -> None:
    items = qwen_vl_image_items(torch.zeros(8, 4), torch.tensor([[1, 2, 4]]))
    features = render_features(items, [(5, 2)])
    assert features["mm_placeholders"] == {"image": [{"offset": 5, "length": 2}]}
    assert len(features["mm_hashes"]["image"]) == 1
    decoded = decode_item(features["kwargs_data"]["image"][0])
    assert decoded["image_grid_thw"].data.tolist() == [1, 2, 4]
    with pytest.raises(FeatureCodecError):
        render_features(items, [(5, 2), (9, 2)])


def test_qwen_vl_image_items_reject_grids_that_do_not_cover_the_pixels() -> None:
    with pytest.raises(FeatureCodecError, match="sums to 8 patches"):
        qwen_vl_image_items(torch.zeros(9, 4), torch.tensor([[1, 2, 4]]))


# ------------------------------------------------------------------------------------ malformed payloads


def packed(payload: Any) -> str:
    return base64.b64encode(msgpack.packb(payload, use_bin_type=True)).decode("ascii")


def tensor_elem(wire_tensor: Any) -> dict[str, Any]:
    return {"x": {"data": wire_tensor, "field": ["batched", {"keep_on_cpu": False}]}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"\xc1").decode(), "not valid msgpack"),
        (packed([1, 2]), "must be a msgpack map"),
        (packed({"x": {"data": None}}), "expected a map with 'data' and 'field'"),
        (packed({"x": {"data": None, "field": "flat"}}), r"'field' must be \[kind, options\]"),
        (packed(tensor_elem(["float32", [1], 0])), "stored out of band"),
        (packed(tensor_elem(["float32", [1], {"handle": 1}])), "stored out of band"),
        (packed(tensor_elem(["float32", [1], msgpack.ExtType(1, b"\x80\x04N.")])), r"ext type 1 \(pickle\)"),
        (packed(tensor_elem(["float32", [1], b"\0\0\0\0"])), "must be a msgpack ext"),
        (packed(tensor_elem(["float99", [1], msgpack.ExtType(3, b"\0" * 4)])), "not a torch dtype"),
        (packed(tensor_elem(["__class__", [1], msgpack.ExtType(3, b"\0" * 4)])), "invalid tensor dtype"),
        (packed(tensor_elem(["float32", [2], msgpack.ExtType(3, b"\0" * 4)])), "needs 8 bytes, got 4"),
        (packed(tensor_elem(["float32", [-1], msgpack.ExtType(3, b"")])), "non-negative ints"),
        (packed(tensor_elem(["float32", [1]])), r"\[dtype, shape, data\]"),
        (packed({"x": {"data": "text", "field": ["batched", {}]}}), "unexpected data of type str"),
        (packed({"x": {"data": None, "field": ["flat", {"slices": [[0, 1]]}]}}), r"\[start, stop, step\]"),
    ],
)
def test_malformed_items_raise_a_codec_error_saying_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(FeatureCodecError, match=message) as caught:
        decode_item(text)
    assert isinstance(caught.value, MultimodalError)
    assert isinstance(caught.value, ValueError)


def test_decode_item_takes_text_not_bytes() -> None:
    with pytest.raises(FeatureCodecError, match="base64 text"):
        decode_item(b"abc")  # type: ignore[arg-type]


def test_decode_item_msgpack_reads_the_payload_under_the_base64() -> None:
    item = KwargsItem(x=FieldElem(torch.tensor([1, 2]), FieldSpec.batched()))
    assert decode_item_msgpack(encode_item_msgpack(item))["x"].data.tolist() == [1, 2]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"x": FieldElem("text", FieldSpec.batched())}, "cannot encode data of type str"),
        ({"x": torch.zeros(1)}, "expected a FieldElem"),
        ({"x": FieldElem(None, FieldSpec("flat", {"slices": ["a"]}))}, "must be slice objects"),
        ({"x": FieldElem(np.array([object()]), FieldSpec.batched())}, "dtype object cannot be encoded"),
    ],
)
def test_unencodable_items_raise_a_codec_error(item: Any, message: str) -> None:
    with pytest.raises(FeatureCodecError, match=message):
        encode_item(item)
