"""Images end to end: a multi-turn rollout with an image prompt against the fake vLLM server over real HTTP.

The fake server's render is given the Qwen2-VL-like image processor of ``testing.fake_vllm.images``: it cuts each
image into 8x8 patches, expands every ``<|image_pad|>`` to ``t*h*w / 2**2`` placeholders, and answers the image
tensors in vLLM's wire format (:mod:`fsm_rollout.multimodal.codec`), as ``vllm serve --enable-scale-out`` does for
Qwen2-VL. Images are drawn with Pillow at test time.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, VLLMClient, capture_transitions
from fsm_rollout.errors import (
    ImageFeaturesMissingError,
    ImageInputError,
    ImageTokenMismatchError,
    MultimodalError,
    ObservationError,
)
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.fake_vllm.images import MERGE, patchify
from fsm_rollout.testing.fake_vllm.images import QwenLikeImageRender as QwenLikeRender

MODEL = "fake-model"
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
QWEN_PROCESSOR = SimpleNamespace(image_processor=SimpleNamespace(merge_size=MERGE))


def draw_figure(width: int, height: int, color: tuple[int, int, int]) -> Image.Image:
    """A geometry figure (a filled triangle) whose size is a multiple of PATCH * MERGE."""
    image = Image.new("RGB", (width, height), color=(255, 255, 255))
    ImageDraw.Draw(image).polygon([(1, height - 1), (width - 1, height - 1), (width // 3, 1)], fill=color)
    return image


@pytest.fixture
def renderer(tokenizer: Any) -> QwenLikeRender:
    return QwenLikeRender(tokenizer)


@pytest.fixture
async def fake_vllm(tokenizer: Any, renderer: QwenLikeRender) -> AsyncIterator[FakeVLLMServer]:
    """Overrides the shared fixture: the fake server with the Qwen2-VL-like render hook."""
    async with FakeVLLMServer(tokenizer, model=MODEL, render_features=renderer) as server:
        yield server


@pytest.fixture
def run_images(make_config: Callable[..., RolloutConfig], client: VLLMClient, tokenizer: Any) -> Callable[..., Any]:
    async def run(
        sample: Sample, *, processor: Any = QWEN_PROCESSOR, envs: ScriptedEnvFactory | None = None, **config: Any
    ) -> tuple[Rollout, list[dict[str, Any]]]:
        rollout = Rollout(
            sample,
            config=make_config(**config),
            sampling_params=dict(SAMPLING),
            client=client,
            tokenizer=tokenizer,
            env_factory=envs or ScriptedEnvFactory(),
            processor=processor,
        )
        with capture_transitions() as events:
            await rollout.run()
        return rollout, events

    return run


async def run_failing(run_images: Callable[..., Any], sample: Sample, error: type[Exception], **kwargs: Any) -> Any:
    with pytest.raises(error) as caught:
        await run_images(sample, **kwargs)
    assert sample.status == Status.FAILED
    return caught.value


FIGURES = ((32, 16, (200, 30, 30)), (48, 32, (30, 30, 200)))  # grids (1, 2, 4) and (1, 4, 6): 2 + 6 placeholders


def image_sample(index: int = 5, images: list[Any] | None = None) -> Sample:
    figures = images if images is not None else [draw_figure(*figure) for figure in FIGURES]
    return Sample(
        prompt="<image>Find the area of the triangle.<image>", index=index, multimodal_inputs={"images": figures}
    )


# ------------------------------------------------------------------------------------ the happy path


async def test_an_image_prompt_rolls_out_over_several_turns_with_features_on_every_request(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, renderer: QwenLikeRender, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="The base is 4."), ScriptedTurn(text="Height 3."), ScriptedTurn(text="6.")])
    sample = image_sample()
    rollout, _ = await run_images(sample, max_turns=3)

    render_body = fake_vllm.requests_to(RENDER_PATH)[0].body
    content = render_body["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url", "image_url", "text"]
    assert all(part["image_url"]["url"].startswith("data:image/png;base64,") for part in content[:2])
    assert content[2]["text"] == "Find the area of the triangle."

    prompt_ids, features = renderer.answers[0]
    generates = [request.body for request in fake_vllm.requests_to(GENERATE_PATH)]
    assert len(generates) == 3
    for body in generates:
        assert body["features"] == features  # exactly as rendered, on every turn
        assert body["token_ids"][: len(prompt_ids)] == prompt_ids  # placeholders stay where render put them
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
    assert rollout.prompt_length == len(prompt_ids)


async def test_the_training_inputs_are_the_decoded_image_tensors(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    figures = [draw_figure(*figure) for figure in FIGURES]
    sample = image_sample(images=figures)
    await run_images(sample, max_turns=2)

    inputs = sample.multimodal_train_inputs
    assert inputs is not None and sorted(inputs) == ["image_grid_thw", "pixel_values"]
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 6]]
    assert inputs["image_grid_thw"].dtype == torch.int64
    expected = np.concatenate([patchify(figure)[0] for figure in figures])
    assert inputs["pixel_values"].dtype == torch.float32
    assert np.array_equal(inputs["pixel_values"].numpy(), expected)


async def test_the_placeholder_count_matches_the_image_grids(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    sample = image_sample()
    await run_images(sample, max_turns=2)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sample.tokens.count(pad) == (1 * 2 * 4 + 1 * 4 * 6) // MERGE**2


async def test_transition_events_carry_no_image_data(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, renderer: QwenLikeRender
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    _, events = await run_images(image_sample(), max_turns=2)
    text = json.dumps(events, default=str)
    _, features = renderer.answers[0]
    assert features is not None
    assert "base64" not in text
    assert not any(item in text for item in features["kwargs_data"]["image"])
    assert max(len(str(value)) for event in events for value in event.values()) < 200


async def test_a_text_only_prompt_sends_no_features_and_has_no_training_inputs(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="42")])
    sample = Sample(prompt="What is 6 * 7?", index=1)
    await run_images(sample, max_turns=1, processor=None)
    assert fake_vllm.requests_to(GENERATE_PATH)[0].body["features"] is None
    assert sample.multimodal_train_inputs is None
    assert sample.status == Status.TRUNCATED


async def test_a_message_list_prompt_with_an_image_path_works(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, tmp_path: Any
) -> None:
    draw_figure(32, 32, (10, 120, 10)).save(tmp_path / "figure.png")
    fake_vllm.script([ScriptedTurn(text="a")])
    prompt = [
        {"role": "system", "content": "You solve geometry problems."},
        {
            "role": "user",
            "content": [{"type": "image", "image": str(tmp_path / "figure.png")}, {"type": "text", "text": "Area?"}],
        },
    ]
    sample = Sample(prompt=prompt, index=2)
    await run_images(sample, max_turns=1)
    inputs = sample.multimodal_train_inputs
    assert inputs is not None and inputs["image_grid_thw"].tolist() == [[1, 4, 4]]


# ------------------------------------------------------------------------------------ failures


async def test_a_placeholder_mismatch_fails_the_sample_with_both_counts(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    wrong_processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=1))
    sample = image_sample()
    error = await run_failing(run_images, sample, ImageTokenMismatchError, max_turns=1, processor=wrong_processor)
    assert (error.image_tokens, error.expected) == (8, 32)
    assert sample.metadata["rollout_error"]["type"] == "ImageTokenMismatchError"


async def test_a_null_feature_item_fails_with_the_server_flag_to_use(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, renderer: QwenLikeRender
) -> None:
    renderer.null_item = 1
    fake_vllm.script([ScriptedTurn(text="a")])
    error = await run_failing(run_images, image_sample(), ImageFeaturesMissingError, max_turns=1)
    assert "image[1] is null" in str(error) and "--mm-processor-cache-gb 0" in str(error)
    assert fake_vllm.requests_to(GENERATE_PATH) == []  # a null item kills vLLM's engine: never sent


async def test_a_null_item_of_a_repeated_prompt_image_is_filled_from_its_twin(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, renderer: QwenLikeRender
) -> None:
    renderer.null_item = 1  # the same figure twice: the engine's cache hit leaves out the second one's tensors
    fake_vllm.script([ScriptedTurn(text="a")])
    figure = draw_figure(*FIGURES[0])
    sample = image_sample(images=[figure, figure])
    await run_images(sample, max_turns=1)
    (request,) = fake_vllm.requests_to(GENERATE_PATH)
    items = request.body["features"]["kwargs_data"]["image"]
    assert items[0] is not None and items[1] == items[0]
    assert sample.multimodal_train_inputs["image_grid_thw"].shape[0] == 2


async def test_image_tokens_without_features_fail_like_the_seed(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, renderer: QwenLikeRender
) -> None:
    fake_vllm.render_features = None  # the plain fake: template ids with one placeholder per image, no features
    fake_vllm.script([ScriptedTurn(text="a")])
    error = await run_failing(run_images, image_sample(), ImageFeaturesMissingError, max_turns=1)
    assert isinstance(error, RuntimeError) and isinstance(error, MultimodalError)
    assert "Found 2 image tokens" in str(error)


@pytest.mark.parametrize(
    ("image", "reason"),
    [
        (b"\x89PNG\r\n", "raw bytes"),
        ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk", "raw base64 without a data: prefix"),
        ("/no/such/figure.png", "not a data: URL, an http\\(s\\) URL, or an existing file"),
        ("NON_IMAGE_FILE", "is not an image file PIL can read"),
        (3.14, "unsupported image type float"),
    ],
)
async def test_a_bad_image_fails_before_any_request_naming_the_image(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer, tmp_path: Any, image: Any, reason: str
) -> None:
    if image == "NON_IMAGE_FILE":
        image = str(tmp_path / "notes.txt")
        (tmp_path / "notes.txt").write_text("a triangle has three sides")
    sample = image_sample(images=[draw_figure(*FIGURES[0]), image])
    error = await run_failing(run_images, sample, ImageInputError, max_turns=1)
    assert fake_vllm.requests == []
    assert "image 1 (messages[0].content[1]): " in str(error)
    assert re.search(reason, str(error))


async def test_an_observation_with_a_bad_image_part_fails_naming_the_part(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    observation = {"role": "user", "content": [{"type": "text", "text": "See:"}, {"type": "image", "image": "x.png"}]}
    envs = ScriptedEnvFactory(steps=[(observation, False)])
    error = await run_failing(run_images, image_sample(), ImageInputError, max_turns=2, envs=envs)
    assert "content[1]" in str(error)
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1


# ------------------------------------------------------------------------------------ after the rollout change


async def test_a_bad_image_error_names_the_sample(run_images: Callable[..., Any], fake_vllm: FakeVLLMServer) -> None:
    sample = image_sample(index=9, images=[draw_figure(*FIGURES[0]), b"\x89PNG"])
    error = await run_failing(run_images, sample, ImageInputError, max_turns=1)
    assert str(error).startswith("sample 9: image 1 (messages[0].content[1]): raw bytes")


async def test_the_render_event_records_image_hashes_only(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    from fsm_rollout.multimodal import build_initial_messages, prepare_render_messages

    fake_vllm.script([ScriptedTurn(text="a")])
    figures = [draw_figure(*figure) for figure in FIGURES]
    _, events = await run_images(image_sample(images=figures), max_turns=1)
    render = next(event for event in events if event["trigger"] == "render")
    expected = prepare_render_messages(build_initial_messages("compare", figures)).image_hashes
    assert render["image_hashes"] == list(expected) and len(expected) == 2


async def test_the_placeholder_token_and_merge_size_come_from_the_config(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    fake_vllm.script([ScriptedTurn(text="a")])
    sample = image_sample()
    await run_images(sample, max_turns=1, processor=None, image_merge_size=2)
    assert sample.status == Status.TRUNCATED
    fake_vllm.script([ScriptedTurn(text="a")])
    other = image_sample(index=6)
    error = await run_failing(
        run_images, other, MultimodalError, max_turns=1, processor=None, image_placeholder_token="<|video_pad|>"
    )
    assert "<|video_pad|>" in str(error)


async def test_a_video_observation_raises_the_specific_error(
    run_images: Callable[..., Any], fake_vllm: FakeVLLMServer
) -> None:
    from fsm_rollout.errors import ImageObservationError, VideoObservationError

    fake_vllm.script([ScriptedTurn(text="a"), ScriptedTurn(text="b")])
    observation = {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}
    envs = ScriptedEnvFactory(steps=[(observation, False)])
    error = await run_failing(run_images, image_sample(), VideoObservationError, max_turns=2, envs=envs)
    assert isinstance(error, ImageObservationError) and isinstance(error, ObservationError)
    assert "content[0] is a 'video' part" in str(error)
