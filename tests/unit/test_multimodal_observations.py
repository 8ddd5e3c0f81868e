"""The pure parts of image observations: features placed in the sequence, merged, null items filled, size limits."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from fsm_rollout.errors import (
    ImageFeaturesMissingError,
    ImageTooLargeError,
    MalformedFeaturesError,
    VideoObservationError,
)
from fsm_rollout.multimodal import (
    ImageLimits,
    check_encoded_sizes,
    check_image_limits,
    fill_null_items,
    image_features,
    known_items,
    merge_features,
    observation_image_count,
    place_features,
)


def features(offsets: list[tuple[int, int]], items: list[Any], hashes: list[str], meta: bool = True) -> dict[str, Any]:
    return {
        "mm_hashes": {"image": hashes},
        "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in offsets]},
        "kwargs_data": {"image": items},
        "mm_metadata": {"image": [f"m-{item}" for item in items]} if meta else None,
    }


def test_placing_shifts_every_offset_and_keeps_the_items_in_order() -> None:
    new = image_features(features([(20, 4), (30, 2)], ["a", "b"], ["h1", "h2"]), what="obs")
    assert new is not None
    placed = place_features(new, shift=100, first_offset=110, end=140, known={}, what="obs")
    assert [p["offset"] for p in placed["mm_placeholders"]["image"]] == [120, 130]
    assert placed["kwargs_data"]["image"] == ["a", "b"] and placed["mm_hashes"]["image"] == ["h1", "h2"]


@pytest.mark.parametrize(("shift", "first", "end"), [(100, 125, 140), (100, 110, 131)])
def test_a_placeholder_outside_the_observation_is_refused(shift: int, first: int, end: int) -> None:
    new = image_features(features([(20, 4), (30, 2)], ["a", "b"], ["h1", "h2"]), what="obs")
    assert new is not None
    with pytest.raises(MalformedFeaturesError, match="not inside the observation's tokens"):
        place_features(new, shift=shift, first_offset=first, end=end, known={}, what="obs")


def test_a_null_item_is_filled_from_the_samples_item_of_the_same_hash_or_refused() -> None:
    earlier = features([(3, 2)], ["a"], ["h1"])
    new = image_features(features([(20, 4)], [None], ["h1"], meta=False), what="obs")
    assert new is not None
    placed = place_features(new, shift=0, first_offset=0, end=99, known=known_items(earlier), what="obs")
    assert placed["kwargs_data"]["image"] == ["a"]
    unknown = image_features(features([(20, 4)], [None], ["h9"]), what="obs")
    assert unknown is not None
    with pytest.raises(ImageFeaturesMissingError, match="--mm-processor-cache-gb 0"):
        place_features(unknown, shift=0, first_offset=0, end=99, known=known_items(earlier), what="obs")


def test_merging_appends_and_pads_a_list_only_one_side_has() -> None:
    base = features([(3, 2)], ["a"], ["h1"], meta=False)
    new = features([(10, 4)], ["b"], ["h2"])
    merged = merge_features(base, new)
    assert [p["offset"] for p in merged["mm_placeholders"]["image"]] == [3, 10]
    assert merged["kwargs_data"]["image"] == ["a", "b"] and merged["mm_hashes"]["image"] == ["h1", "h2"]
    assert merged["mm_metadata"]["image"] == [None, "m-b"]
    assert base["kwargs_data"]["image"] == ["a"]  # the sample's earlier features are not changed
    assert merge_features(None, new) == new  # a text-only prompt: the observation's features alone
    assert merge_features('{"mm_hashes": null}', new)["kwargs_data"] == new["kwargs_data"]  # JSON-text features


def test_a_prompts_null_item_is_filled_from_its_twin_and_text_features_stay_text() -> None:
    twin = features([(1, 2), (5, 2)], ["a", None], ["h1", "h1"])
    assert fill_null_items(twin)["kwargs_data"]["image"] == ["a", "a"]
    with pytest.raises(ImageFeaturesMissingError, match=r"image\[1\] is null"):
        fill_null_items(features([(1, 2), (5, 2)], ["a", None], ["h1", "h2"]))
    text = '{"mm_hashes": {"image": ["h1"]}}'
    assert fill_null_items(text) is text and fill_null_items(None) is None


def test_features_of_other_modalities_are_refused_and_mismatched_lists_are_malformed() -> None:
    video = {"mm_placeholders": {"image": [{"offset": 0, "length": 1}], "video": [{"offset": 2, "length": 1}]}}
    with pytest.raises(VideoObservationError, match="video"):
        image_features(video, what="obs")
    short = features([(1, 2), (5, 2)], ["a"], ["h1", "h2"])
    with pytest.raises(MalformedFeaturesError, match=r"kwargs_data\.image must list one entry per image"):
        image_features(short, what="obs")
    assert image_features(None, what="obs") is None
    assert image_features({"mm_placeholders": {"image": []}}, what="obs") is None


def png_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("part", "limits", "match"),
    [
        ({"type": "image", "image": Image.new("RGB", (50, 40))}, ImageLimits(max_pixels=1999), "50x40 = 2000 pixels"),
        ({"type": "image_url", "image_url": {"url": png_url(50, 40)}}, ImageLimits(max_pixels=1999), "2000 pixels"),
        ({"type": "image", "image": png_url(50, 40)}, ImageLimits(max_bytes=10), "bytes is over the limit of 10"),
    ],
)
def test_images_over_the_limits_are_refused_naming_the_image(part: Any, limits: ImageLimits, match: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    with pytest.raises(
        ImageTooLargeError, match=rf"sample 4: observation image 0 \(message \[0\] content\[1\]\).*{match}"
    ):
        check_image_limits(messages, limits, sample_id=4)
    check_image_limits(messages, ImageLimits())  # within the defaults
    assert observation_image_count(messages) == 1


@pytest.mark.parametrize("kind", ["stored png", "jpeg with its header past the probe"])
def test_a_long_data_url_is_checked_from_its_header(kind: str) -> None:
    """A payload longer than the probe the limits check decodes: a PNG's header is in it, a JPEG's after 100 KB
    of ICC profile is not (read from the whole payload)."""
    side = 200
    noise = Image.frombytes(
        "RGB", (side, side), bytes(range(256)) * (side * side * 3 // 256) + bytes(side * side * 3 % 256)
    )
    buffer = io.BytesIO()
    if kind == "stored png":
        noise.save(buffer, format="PNG", compress_level=0)
    else:
        noise.save(buffer, format="JPEG", icc_profile=bytes(100_000))
        assert buffer.getvalue().find(b"\xff\xc0") > 100_000  # the frame header (SOF0) is past the probe
    url = (
        f"data:image/{'png' if kind == 'stored png' else 'jpeg'};base64," + base64.b64encode(buffer.getvalue()).decode()
    )
    assert len(url) > 100_000
    messages = [{"role": "user", "content": [{"type": "image", "image": url}]}]
    with pytest.raises(ImageTooLargeError, match=rf"{side}x{side} = {side * side} pixels"):
        check_image_limits(messages, ImageLimits(max_pixels=side * side - 1))
    check_image_limits(messages, ImageLimits(max_pixels=side * side))


def test_an_encoded_image_over_the_byte_limit_is_refused() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(30, 30)}}]}]
    with pytest.raises(ImageTooLargeError, match=r"observation image 0 \(encoded\)"):
        check_encoded_sizes(messages, ImageLimits(max_bytes=20))
    check_encoded_sizes(messages, ImageLimits())
