"""The demo dataset: enough questions, deterministic figures, labels the Geo3K environment accepts."""

from __future__ import annotations

import base64
import io
import json
import math
from types import SimpleNamespace

import pytest
from PIL import Image

from fsm_rollout import Sample
from fsm_rollout.data.demo import FIGURE_SIZE, demo_records, demo_samples
from fsm_rollout.envs.geo3k import build_env

# Each question's answer worked out by hand, in question order.
HAND_COMPUTED = [
    180 - 50 - 60,  # missing angle of a triangle
    90 - 35,  # other acute angle of a right triangle
    (180 - 40) / 2,  # base angle of an isosceles triangle
    45 + 75,  # exterior angle = sum of the remote interior angles
    math.hypot(3, 4),
    math.hypot(5, 12),
    math.sqrt(10**2 - 6**2),
    math.hypot(2, 2),
    10 / 2,  # side opposite 30 degrees is half the hypotenuse
    2 * math.pi * 5,
    math.pi * 6**2,
    14 / 2,
    math.pi * (10 / 2) ** 2,
    round(math.pi * 12, 2),
    8 * 5,
    math.hypot(8, 6),
    2 * (9 + 4),
    10 * 6 / 2,
    180 - 130,  # supplementary angles on a straight line
    65,  # vertical angles are equal
    7**2,
    360 - 90 - 80 - 110,  # angles of a quadrilateral
]


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_there_are_at_least_sixteen_questions() -> None:
    assert len(demo_samples()) >= 16
    assert len(demo_records()) == len(demo_samples())


def test_every_question_has_a_hand_computed_answer() -> None:
    assert len(HAND_COMPUTED) == len(demo_samples())


@pytest.mark.parametrize("index", range(len(HAND_COMPUTED)))
def test_label_agrees_with_the_hand_computed_answer(index: int) -> None:
    sample = demo_samples()[index]
    env = build_env(sample=sample, args=SimpleNamespace(max_turns=2))
    env.reset()
    _, _, info = env.step(
        f'<tool_call>{{"name": "calc_score", "arguments": {{"answer": "{HAND_COMPUTED[index]!r}"}}}}</tool_call>'
    )
    assert info["score"] == 1.0, (sample.prompt, sample.label, HAND_COMPUTED[index])


def test_the_environment_scores_every_label_as_correct() -> None:
    for sample in demo_samples():
        env = build_env(sample=sample, args=SimpleNamespace(max_turns=2))
        env.reset()
        answer = json.dumps({"name": "calc_score", "arguments": {"answer": sample.label}})
        observation, done, _ = env.step(f"<tool_call>{answer}</tool_call>")
        assert observation.startswith("Correct (score 1.0)."), sample.label
        assert not done
        assert sample.reward == 1.0


def test_samples_have_the_documented_shape() -> None:
    for index, sample in enumerate(demo_samples()):
        assert isinstance(sample, Sample)
        assert sample.index == index
        assert isinstance(sample.prompt, str)
        assert sample.prompt.startswith("<image>")
        assert sample.prompt.count("<image>") == 1
        assert "calc_score" in sample.prompt
        assert "<tool_call>" in sample.prompt
        assert isinstance(sample.label, str)
        assert sample.metadata == {"source": "fsm-rollout demo"}
        assert sample.multimodal_inputs is not None
        assert len(sample.multimodal_inputs["images"]) == 1


def test_images_are_rgb_of_the_figure_size() -> None:
    for sample in demo_samples():
        assert sample.multimodal_inputs is not None
        image = sample.multimodal_inputs["images"][0]
        assert image.mode == "RGB"
        assert image.size == FIGURE_SIZE == (256, 256)


def test_figures_are_not_blank() -> None:
    for sample in demo_samples():
        assert sample.multimodal_inputs is not None
        colours = sample.multimodal_inputs["images"][0].getcolors(maxcolors=1 << 16)
        assert colours is not None
        assert len(colours) > 2


def test_samples_are_fresh_objects_on_every_call() -> None:
    first, second = demo_samples(), demo_samples()
    assert first[0] is not second[0]
    first[0].metadata["touched"] = True
    assert "touched" not in second[0].metadata
    assert "touched" not in demo_samples()[0].metadata


def test_figures_are_deterministic_across_calls() -> None:
    first, second = demo_samples(), demo_samples()
    for one, other in zip(first, second, strict=True):
        assert one.multimodal_inputs is not None
        assert other.multimodal_inputs is not None
        assert _png_bytes(one.multimodal_inputs["images"][0]) == _png_bytes(other.multimodal_inputs["images"][0])
    assert demo_records() == demo_records()


def test_records_are_json_lines_with_small_png_data_urls() -> None:
    records = demo_records()
    samples = demo_samples()
    for record, sample in zip(records, samples, strict=True):
        line = json.dumps(record)
        assert json.loads(line) == record
        assert set(record) == {"prompt", "images", "label", "metadata"}
        assert record["prompt"] == sample.prompt
        assert record["label"] == sample.label
        assert record["metadata"] == {"source": "fsm-rollout demo"}
        (url,) = record["images"]
        assert url.startswith("data:image/png;base64,")
        assert len(url) < 12_000
        decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert decoded.size == FIGURE_SIZE
        assert sample.multimodal_inputs is not None
        assert decoded.convert("RGB").tobytes() == sample.multimodal_inputs["images"][0].tobytes()
