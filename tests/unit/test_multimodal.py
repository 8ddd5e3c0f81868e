"""Specification of ``fsm_rollout.multimodal``: prompt messages, images as render URLs, training features and
the image-token check. Images are drawn with Pillow at test time."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import fsm_rollout.multimodal.features as multimodal_features
from fsm_rollout import multimodal
from fsm_rollout.errors import (
    FeatureCodecError,
    ImageFeaturesMissingError,
    ImageInputError,
    ImageMergeSizeUnknownError,
    ImageTokenMismatchError,
    MalformedFeaturesError,
    MultimodalError,
)
from fsm_rollout.multimodal import (
    IMAGE_PAD_TOKEN,
    CheckpointImageConfig,
    build_initial_messages,
    checkpoint_merge_size,
    decode_train_features,
    feature_item_decoder,
    image_content_hash,
    image_pad_token_id,
    image_to_render_url,
    is_image_part,
    load_image_processor,
    messages_for_render,
    prepare_render_messages,
    processor_merge_size,
    validate_image_tokens,
)
from fsm_rollout.multimodal.codec import (
    FieldElem,
    FieldSpec,
    KwargsItem,
    encode_item,
    qwen_vl_image_items,
    render_features,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mm_items"
PAD = 151655  # <|image_pad|> in the Qwen2 vocabulary


def draw_figure(size: tuple[int, int] = (32, 24), mode: str = "RGB", color: Any = (30, 90, 200)) -> Image.Image:
    """A small geometry figure: a triangle on a white background."""
    image = Image.new("RGB", size, color=(255, 255, 255))
    width, height = size
    ImageDraw.Draw(image).polygon([(2, height - 2), (width - 2, height - 2), (width // 2, 2)], outline=color)
    return image if mode == "RGB" else image.convert(mode)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def decoded_image(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2])))
    image.load()
    return image


# ------------------------------------------------------------------------------------ initial messages


def test_a_message_list_prompt_is_copied_message_by_message() -> None:
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    messages = build_initial_messages(prompt, [draw_figure()])
    assert messages == prompt
    messages[0]["content"] = "changed"
    assert prompt[0]["content"] == "Be brief."


def test_a_string_prompt_becomes_one_user_message_with_image_parts_first() -> None:
    first, second = draw_figure(), draw_figure((16, 16))
    messages = build_initial_messages("<image>  Find the area.<image>", [first, second])
    assert messages == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": first},
                {"type": "image", "image": second},
                {"type": "text", "text": "Find the area."},
            ],
        }
    ]


def test_a_string_prompt_without_images_has_only_its_text() -> None:
    assert build_initial_messages(" What is 6 * 7?", None) == [
        {"role": "user", "content": [{"type": "text", "text": "What is 6 * 7?"}]}
    ]


# ------------------------------------------------------------------------------------ images to URLs


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "CMYK"])
def test_a_pil_image_becomes_an_rgb_png_data_url(mode: str) -> None:
    image = draw_figure(mode=mode)
    url = image_to_render_url(image)
    decoded = decoded_image(url)
    assert decoded.format == "PNG"
    assert decoded.mode == "RGB"
    assert decoded.size == image.size
    assert np.array_equal(np.asarray(decoded), np.asarray(image.convert("RGB")))


def test_a_data_url_is_passed_through() -> None:
    url = data_url(png_bytes(draw_figure()))
    assert image_to_render_url(url) == url


def test_the_geo3k_none_media_type_is_fixed_to_png() -> None:
    payload = base64.b64encode(png_bytes(draw_figure())).decode("ascii")
    assert image_to_render_url(f"data:image/None;base64,{payload}") == f"data:image/png;base64,{payload}"


@pytest.mark.parametrize("url", ["http://example.com/figure.png", "https://example.com/a.jpg?x=1"])
def test_http_urls_are_passed_through(url: str) -> None:
    assert image_to_render_url(url) == url


def test_a_local_image_file_is_read_and_sent_as_a_png_data_url(tmp_path: Path) -> None:
    image = draw_figure()
    path = tmp_path / "figure.jpg"
    image.save(path, format="JPEG", quality=95)
    decoded = decoded_image(image_to_render_url(str(path)))
    assert decoded.size == image.size


def test_a_local_path_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    draw_figure().save(tmp_path / "figure.png")
    assert decoded_image(image_to_render_url("~/figure.png")).size == (32, 24)


def test_a_pathlib_path_is_a_local_path(tmp_path: Path) -> None:
    draw_figure().save(tmp_path / "figure.png")
    assert decoded_image(image_to_render_url(tmp_path / "figure.png")).size == (32, 24)


BAD_IMAGE_REASONS = {
    "bytes": r"raw bytes \(\d+ bytes\) are not an accepted image",
    "bytearray": "raw bytes",
    "raw_base64": "raw base64 without a data: prefix",
    "raw_base64_jpeg_prefix": "raw base64 without a data: prefix",
    "missing_file": r"not a data: URL, an http\(s\) URL, or an existing file",
    "non_image_file": "is not an image file PIL can read",
    "directory": "is not a file",
    "empty_string": "the image string is empty",
    "ftp_url": "unsupported URL scheme 'ftp'",
    "file_url": "pass the local path itself",
    "data_url_not_base64": "only base64 data: URLs",
    "data_url_without_comma": "no ','",
    "data_url_bad_base64": "not valid base64",
    "data_url_not_an_image": "not an image PIL can read",
    "data_url_empty": "is empty",
    "int": "unsupported image type int",
    "numpy_array": "PIL.Image.fromarray",
    "dataset_dict": "undecoded dataset image",
}
"""Every kind of image input that must be refused, with the reason its error must give."""


def bad_image(kind: str, tmp_path: Path) -> Any:
    png = png_bytes(draw_figure())
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "folder").mkdir(exist_ok=True)
    images: dict[str, Any] = {
        "bytes": png,
        "bytearray": bytearray(png),
        "raw_base64": base64.b64encode(png).decode("ascii"),
        "raw_base64_jpeg_prefix": "/9j/4AAQSkZJRg",
        "missing_file": str(tmp_path / "missing.png"),
        "non_image_file": str(tmp_path / "notes.txt"),
        "directory": str(tmp_path / "folder"),
        "empty_string": "",
        "ftp_url": "ftp://example.com/a.png",
        "file_url": f"file://{tmp_path}/a.png",
        "data_url_not_base64": "data:image/png,rawpixels",
        "data_url_without_comma": "data:image/png;base64",
        "data_url_bad_base64": "data:image/png;base64,@@@@",
        "data_url_not_an_image": data_url(b"hello world"),
        "data_url_empty": "data:image/png;base64,",
        "int": 42,
        "numpy_array": np.zeros((4, 4, 3), dtype=np.uint8),
        "dataset_dict": {"bytes": png, "path": None},
    }
    return images[kind]


@pytest.mark.parametrize("kind", sorted(BAD_IMAGE_REASONS))
def test_an_unusable_image_is_refused_with_a_specific_reason(kind: str, tmp_path: Path) -> None:
    with pytest.raises(ImageInputError, match=BAD_IMAGE_REASONS[kind]) as caught:
        image_to_render_url(bad_image(kind, tmp_path))
    assert isinstance(caught.value, ValueError)  # the seed raised ValueError


def test_an_overlong_raw_base64_string_is_not_mistaken_for_a_path() -> None:
    text = base64.b64encode(png_bytes(draw_figure((200, 200)))).decode("ascii") * 3
    with pytest.raises(ImageInputError, match="raw base64"):
        image_to_render_url(text)


@pytest.mark.parametrize("kind", sorted(BAD_IMAGE_REASONS))
def test_an_image_error_names_the_sample_and_the_image_index(kind: str, tmp_path: Path) -> None:
    messages = build_initial_messages("<image><image>Solve.", [draw_figure(), bad_image(kind, tmp_path)])
    with pytest.raises(ImageInputError, match=r"^sample 7: image 1 \(messages\[0\]\.content\[1\]\): "):
        prepare_render_messages(messages, sample_id=7)


def test_image_parts_become_image_url_parts_and_other_parts_are_copied() -> None:
    figure = draw_figure()
    messages = [
        {"role": "system", "content": "You solve geometry."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": figure},
                {"type": "image", "image": None},
                {"type": "text", "text": "Area?"},
            ],
        },
    ]
    rendered = messages_for_render(messages)
    assert rendered[0] == messages[0] and rendered[0] is not messages[0]
    parts = rendered[1]["content"]
    assert parts[0] == {"type": "image_url", "image_url": {"url": image_to_render_url(figure)}}
    assert parts[1] == {"type": "image", "image": None}
    assert parts[2] == {"type": "text", "text": "Area?"}
    assert messages[1]["content"][0]["image"] is figure  # the input is not modified


def test_a_content_part_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(ImageInputError, match=r"sample 3: messages\[0\]\.content\[0\] must be a dict, got str"):
        prepare_render_messages([{"role": "user", "content": ["text"]}], sample_id=3)


def test_render_messages_carry_one_content_hash_per_image_and_no_image_data() -> None:
    figure = draw_figure()
    url = data_url(png_bytes(draw_figure((8, 8))))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": figure},
                {"type": "image", "image": "https://example.com/a.png"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    hashes = prepare_render_messages(messages).image_hashes
    assert hashes == (
        "sha256:" + hashlib.sha256(png_bytes(figure)).hexdigest()[:16],
        "url-sha256:" + hashlib.sha256(b"https://example.com/a.png").hexdigest()[:16],
        "sha256:" + hashlib.sha256(png_bytes(draw_figure((8, 8)))).hexdigest()[:16],
    )
    assert prepare_render_messages(messages).image_hashes == hashes  # deterministic


def test_the_same_image_hashes_the_same_whichever_way_it_is_given(tmp_path: Path) -> None:
    figure = draw_figure()
    figure.save(tmp_path / "figure.png")
    as_pil = prepare_render_messages(build_initial_messages("x", [figure])).image_hashes
    as_url = prepare_render_messages(build_initial_messages("x", [image_to_render_url(figure)])).image_hashes
    as_path = prepare_render_messages(build_initial_messages("x", [str(tmp_path / "figure.png")])).image_hashes
    assert as_pil == as_url == as_path
    assert as_pil != prepare_render_messages(build_initial_messages("x", [draw_figure((9, 9))])).image_hashes


def test_image_content_hash_of_a_data_url_hashes_the_decoded_bytes() -> None:
    data = png_bytes(draw_figure())
    assert image_content_hash(data_url(data)) == "sha256:" + hashlib.sha256(data).hexdigest()[:16]


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "image", "image": "x.png"}, True),
        ({"type": "image_url", "image_url": {"url": "https://e.com/a.png"}}, True),
        ({"image": "x.png"}, True),
        ({"type": "text", "text": "hello"}, False),
        ("text", False),
    ],
)
def test_is_image_part(part: Any, expected: bool) -> None:
    assert is_image_part(part) is expected


# ------------------------------------------------------------------------------------ training features


def fixture_text(name: str) -> str:
    return (FIXTURES / f"{name}.b64").read_text().strip()


def qwen_features(*names: str) -> dict[str, Any]:
    return {
        "mm_hashes": {"image": [f"hash-{name}" for name in names]},
        "mm_placeholders": {"image": [{"offset": 10 * index, "length": 4} for index in range(len(names))]},
        "kwargs_data": {"image": [fixture_text(name) for name in names]},
        "mm_metadata": None,
    }


@pytest.mark.parametrize("features", [None, "", {}])
def test_no_features_give_no_training_inputs(features: Any) -> None:
    assert decode_train_features(features) is None


@pytest.mark.parametrize(
    "features",
    [{"mm_hashes": {}}, {"kwargs_data": None}, {"kwargs_data": {"audio": []}}, {"kwargs_data": {"image": []}}],
)
def test_features_without_image_items_give_no_training_inputs(features: Any) -> None:
    assert decode_train_features(features) is None


def test_one_image_gives_its_tensors_with_the_grid_as_one_row() -> None:
    inputs = decode_train_features(qwen_features("qwen2_vl_image0"))
    assert inputs is not None
    assert sorted(inputs) == ["image_grid_thw", "pixel_values"]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["image_grid_thw"].dtype == torch.int64
    assert inputs["pixel_values"].shape == (16, 12)
    assert inputs["pixel_values"].dtype == torch.float32


def test_several_images_are_concatenated_along_dim_0_in_image_order() -> None:
    inputs = decode_train_features(qwen_features("qwen2_vl_image0", "qwen2_vl_image1"))
    assert inputs is not None
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6]]
    first = decode_train_features(qwen_features("qwen2_vl_image0"))
    second = decode_train_features(qwen_features("qwen2_vl_image1"))
    assert first is not None and second is not None
    expected = torch.cat([first["pixel_values"], second["pixel_values"]])
    assert inputs["pixel_values"].shape == (28, 12)
    assert inputs["pixel_values"].view(torch.int32).equal(expected.view(torch.int32))  # NaN-safe, bit for bit


def test_features_may_arrive_as_a_json_string() -> None:
    inputs = decode_train_features(json.dumps(qwen_features("qwen2_vl_image1")))
    assert inputs is not None and inputs["image_grid_thw"].tolist() == [[1, 2, 6]]


def test_only_tensor_values_are_kept() -> None:
    features = {"kwargs_data": {"image": [fixture_text("mixed_nested")]}}
    inputs = decode_train_features(features)
    assert inputs is not None
    assert sorted(inputs) == ["empty_f32", "int64_extremes", "scalar_f32", "scalar_i64"]


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([1, 2], "must decode to a dictionary, got list"),
        ("{not json", "not JSON"),
        ({"kwargs_data": ["x"]}, "kwargs_data must be a dictionary or null"),
        ({"kwargs_data": {"image": "abc"}}, "kwargs_data.image must be a list"),
        ({"kwargs_data": {"image": [42]}}, r"image\[0\] must be base64 text, got int"),
        ({"mm_hashes": {"image": "h"}, "kwargs_data": {"image": []}}, "mm_hashes.image must be a list"),
        ({"mm_hashes": {"image": ["a", "b"]}, "kwargs_data": {"image": ["x"]}}, "2 image.* kwargs_data.image has 1"),
    ],
)
def test_features_of_the_wrong_shape_raise_a_type_error(features: Any, message: str) -> None:
    with pytest.raises(MalformedFeaturesError, match=message) as caught:
        decode_train_features(features, sample_id=4)
    assert isinstance(caught.value, TypeError)  # the seed raised TypeError
    assert str(caught.value).startswith("sample 4: ")


def test_a_null_item_says_how_to_start_the_server() -> None:
    features = qwen_features("qwen2_vl_image0", "qwen2_vl_image1")
    features["kwargs_data"]["image"][1] = None
    with pytest.raises(ImageFeaturesMissingError, match=r"image\[1\] is null .*--mm-processor-cache-gb 0"):
        decode_train_features(features)


def test_images_named_without_tensors_say_how_to_get_them() -> None:
    features = qwen_features("qwen2_vl_image0")
    features["kwargs_data"] = None
    with pytest.raises(ImageFeaturesMissingError, match=r"1 image.*no image tensors.*--mm-processor-cache-gb 0"):
        decode_train_features(features)


def test_an_undecodable_item_names_its_index() -> None:
    features = {"kwargs_data": {"image": [fixture_text("qwen2_vl_image0"), "bm90IG1zZ3BhY2s="]}}
    with pytest.raises(FeatureCodecError, match=r"sample 2: features\.kwargs_data\.image\[1\]"):
        decode_train_features(features, sample_id=2)


def test_items_that_cannot_be_concatenated_are_a_multimodal_error() -> None:
    wide = KwargsItem(pixel_values=FieldElem(torch.zeros(2, 5), FieldSpec.batched()))
    narrow = KwargsItem(pixel_values=FieldElem(torch.zeros(2, 3), FieldSpec.batched()))
    features = {"kwargs_data": {"image": [encode_item(wide), encode_item(narrow)]}}
    with pytest.raises(MultimodalError, match=r"'pixel_values' cannot be concatenated .*\(2, 5\), \(2, 3\)"):
        decode_train_features(features)


@pytest.fixture
def vllm_codec_cache() -> Iterator[None]:
    multimodal_features._vllm_item_decoder.cache_clear()
    yield
    multimodal_features._vllm_item_decoder.cache_clear()


def test_vllms_decoder_is_used_when_vllm_is_importable(monkeypatch: pytest.MonkeyPatch, vllm_codec_cache: None) -> None:
    calls: list[str] = []

    def decode_mm_kwargs_item(text: str) -> Any:
        calls.append(text)
        from fsm_rollout.multimodal.codec import decode_item

        return decode_item(text)

    module = types.ModuleType(multimodal.VLLM_MM_SERDE_MODULES[0])
    module.decode_mm_kwargs_item = decode_mm_kwargs_item  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, multimodal.VLLM_MM_SERDE_MODULES[0], module)
    assert feature_item_decoder() is decode_mm_kwargs_item
    decode_train_features(qwen_features("qwen2_vl_image0"))
    assert calls == [fixture_text("qwen2_vl_image0")]


def test_the_builtin_decoder_is_used_when_vllm_is_not_importable(
    monkeypatch: pytest.MonkeyPatch, vllm_codec_cache: None
) -> None:
    for name in multimodal.VLLM_MM_SERDE_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    from fsm_rollout.multimodal.codec import decode_item

    assert feature_item_decoder() is decode_item


# ------------------------------------------------------------------------------------ image-token check


class StubTokenizer:
    """Knows only the tokens it is given; unknown tokens map to ``unk_token_id`` (or None, or raise)."""

    def __init__(self, vocab: dict[str, int], *, unknown: str = "unk") -> None:
        self.vocab = vocab
        self.unknown = unknown
        self.unk_token_id = 0 if unknown == "unk" else None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        if token in self.vocab:
            return self.vocab[token]
        if self.unknown == "raise":
            raise KeyError(token)
        return self.unk_token_id


QWEN = StubTokenizer({IMAGE_PAD_TOKEN: PAD})
QWEN_PROCESSOR = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2))


def grid_inputs(*grids: tuple[int, int, int]) -> dict[str, Any]:
    return {"image_grid_thw": torch.tensor(grids, dtype=torch.int64)}


@pytest.mark.parametrize("unknown", ["unk", "none", "raise"])
def test_a_text_only_sample_passes_when_the_tokenizer_lacks_the_placeholder(unknown: str) -> None:
    tokenizer = StubTokenizer({}, unknown=unknown)
    assert image_pad_token_id(tokenizer) is None
    validate_image_tokens([1, 2, 3], tokenizer, None, None)


def test_a_text_only_sample_passes_with_a_qwen_tokenizer() -> None:
    validate_image_tokens([1, 2, 3], QWEN, None, None)


def test_image_features_need_a_tokenizer_that_knows_the_placeholder() -> None:
    with pytest.raises(MultimodalError, match="does not define the image placeholder token '<\\|image_pad\\|>'"):
        validate_image_tokens([1, 2], StubTokenizer({}), QWEN_PROCESSOR, grid_inputs((1, 4, 4)))


def test_the_placeholder_count_must_be_the_grid_size_over_merge_size_squared() -> None:
    tokens = [1, *[PAD] * 4, 2, *[PAD] * 3, 3]
    validate_image_tokens(tokens, QWEN, QWEN_PROCESSOR, grid_inputs((1, 4, 4), (1, 2, 6)))


def test_a_placeholder_mismatch_reports_both_counts() -> None:
    tokens = [1, *[PAD] * 5, 2, 9, PAD]
    with pytest.raises(ImageTokenMismatchError) as caught:
        validate_image_tokens(tokens, QWEN, QWEN_PROCESSOR, grid_inputs((1, 4, 4)), prompt_length=7, sample_id="s-1")
    error = caught.value
    assert (error.image_tokens, error.expected) == (6, 4)
    assert isinstance(error, RuntimeError)  # the seed raised RuntimeError
    message = str(error)
    assert message.startswith("sample s-1: ")
    assert "image_tokens=6 (5 in the prompt, 1 after it), expected_image_tokens=4" in message
    assert "image_grid_thw=[[1, 4, 4]], merge_size=2" in message


def test_image_features_without_any_placeholder_are_a_mismatch() -> None:
    with pytest.raises(ImageTokenMismatchError, match="image_tokens=0, expected_image_tokens=4"):
        validate_image_tokens([1, 2, 3], QWEN, QWEN_PROCESSOR, grid_inputs((1, 4, 4)))


def test_placeholders_without_image_features_say_the_features_are_missing() -> None:
    with pytest.raises(ImageFeaturesMissingError, match="Found 2 image tokens, but multimodal render features"):
        validate_image_tokens([1, PAD, PAD], QWEN, QWEN_PROCESSOR, None)


def test_placeholders_with_features_that_have_no_grid_name_the_features() -> None:
    with pytest.raises(MultimodalError, match=r"no image_grid_thw .*\['pixel_values'\]"):
        validate_image_tokens([1, PAD], QWEN, QWEN_PROCESSOR, {"pixel_values": torch.zeros(1, 3)})


def test_the_placeholder_token_is_configurable() -> None:
    tokenizer = StubTokenizer({"<image>": 32000})
    validate_image_tokens(
        [1, 32000, 32000, 2], tokenizer, None, grid_inputs((1, 2, 4)), placeholder_token="<image>", merge_size=2
    )
    with pytest.raises(ImageTokenMismatchError, match="placeholder='<image>'"):
        validate_image_tokens(
            [1, 32000, 2], tokenizer, None, grid_inputs((1, 2, 4)), placeholder_token="<image>", merge_size=2
        )


@pytest.mark.parametrize(
    ("processor", "expected"),
    [
        (None, None),
        (QWEN_PROCESSOR, 2),
        (SimpleNamespace(merge_size=4), 4),
        (SimpleNamespace(image_processor=SimpleNamespace()), None),
        (SimpleNamespace(merge_size=True), None),
    ],
)
def test_merge_size_comes_from_the_image_processor_or_the_processor(processor: Any, expected: int | None) -> None:
    assert processor_merge_size(processor) == expected


def test_merge_size_from_the_config_works_without_a_processor() -> None:
    validate_image_tokens([PAD] * 4, QWEN, None, grid_inputs((1, 4, 4)), merge_size=2)


@pytest.mark.parametrize("processor", [None, SimpleNamespace(image_processor=SimpleNamespace())])
def test_image_features_without_a_known_merge_size_say_so_instead_of_assuming_one(processor: Any) -> None:
    with pytest.raises(ImageMergeSizeUnknownError) as caught:
        validate_image_tokens([PAD] * 4, QWEN, processor, grid_inputs((1, 4, 4)), sample_id="s-2")
    message = str(caught.value)
    assert message.startswith("sample s-2: ") and "the image merge size is unknown" in message
    assert ("no processor was given" if processor is None else "the processor has no merge_size") in message
    assert "set image_merge_size (the placeholder count fits merge_size 2)" in message
    assert not isinstance(caught.value, ImageTokenMismatchError) and isinstance(caught.value, MultimodalError)


def test_merge_size_one_is_used_when_configured() -> None:
    validate_image_tokens([PAD] * 16, QWEN, None, grid_inputs((1, 4, 4)), merge_size=1)


def test_text_only_samples_need_no_merge_size() -> None:
    validate_image_tokens([1, 2, 3], QWEN, None, None)
    validate_image_tokens([1, 2, 3], QWEN, None, {})


QWEN2_VL_PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def qwen2_vl_checkpoint(directory: Path) -> Path:
    """A checkpoint directory with only the image processor's config (enough for the image processor alone)."""
    directory.mkdir(exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PREPROCESSOR_CONFIG))
    return directory


def test_the_image_processor_gives_the_merge_size_when_the_processor_cannot_load(tmp_path: Path) -> None:
    processor = load_image_processor(str(qwen2_vl_checkpoint(tmp_path / "qwen2-vl")))
    assert processor_merge_size(processor) == 2
    validate_image_tokens([PAD] * 4, QWEN, processor, grid_inputs((1, 4, 4)))


def test_the_preprocessor_config_gives_the_merge_size_when_no_image_processor_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    def unavailable(*_: Any, **__: Any) -> Any:
        raise ImportError("this image processor requires the Torchvision library")

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", unavailable)
    checkpoint = qwen2_vl_checkpoint(tmp_path / "qwen2-vl")
    processor = load_image_processor(str(checkpoint))
    assert processor == CheckpointImageConfig(merge_size=2, source=str(checkpoint / "preprocessor_config.json"))
    assert processor_merge_size(processor) == 2
    assert checkpoint_merge_size(checkpoint) == 2


def test_a_text_only_checkpoint_has_no_image_processor(tmp_path: Path) -> None:
    assert load_image_processor(str(tmp_path)) is None
    (tmp_path / "preprocessor_config.json").write_text('{"merge_size": "two"}')
    assert checkpoint_merge_size(tmp_path) is None


def test_config_and_processor_merge_sizes_must_agree() -> None:
    with pytest.raises(MultimodalError, match="merge_size 4 from the config differs from the processor's 2"):
        validate_image_tokens([PAD] * 4, QWEN, QWEN_PROCESSOR, grid_inputs((1, 4, 4)), merge_size=4)


def test_a_grid_that_is_not_made_of_rows_of_three_is_malformed() -> None:
    with pytest.raises(MalformedFeaturesError, match="not a list of \\(t, h, w\\) rows"):
        validate_image_tokens([PAD], QWEN, None, {"image_grid_thw": torch.tensor([1, 2])})


def test_decoded_features_pass_the_check_against_expanded_placeholders() -> None:
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])
    items = qwen_vl_image_items(torch.zeros(28, 3), grid)
    inputs = decode_train_features(render_features(items, [(1, 4), (6, 3)]))
    validate_image_tokens([1, *[PAD] * 4, 2, *[PAD] * 3], QWEN, QWEN_PROCESSOR, inputs)
