"""Image observations under the ``fork`` and ``per_turn`` history policies, on the fake server's Qwen-like render.

These policies re-render the whole conversation at each observation, so the conversation must hold the images
themselves (as the render request sends them): every later render and generate request then carries the images of
its prefix, each sequence's training inputs are the features of its own prompt's render, and a null item the engine
leaves out of a re-render (its processor cache has the image) is filled from the sample's item before a generate
request could carry it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from PIL import Image, ImageDraw

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.errors import ImageTooLargeError
from fsm_rollout.multimodal import decode_train_features, prepare_render_messages
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, QwenLikeImageRender, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0, "seed": 3}
PROMPT = [{"role": "user", "content": "Walk to the goal. Answer with a move."}]
TURNS = [f"Move {index}: right." for index in range(4)]


def board(cell: tuple[int, int], size: int = 64) -> Image.Image:
    image = Image.new("RGB", (size, size), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    x, y = cell
    draw.rectangle([x * 16 + 2, y * 16 + 2, x * 16 + 14, y * 16 + 14], fill=(200, 40, 40))
    return image


def image_message(*cells: tuple[int, int], text: str = "The board:") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, *({"type": "image", "image": board(cell)} for cell in cells)],
    }


OBSERVATIONS: list[tuple[Any, bool]] = [
    (image_message((0, 0), (1, 0), text="Before and after:"), False),
    ("Not a legal move; try again.", False),
    (image_message((1, 1)), False),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake() -> AsyncIterator[FakeVLLMServer]:
    tokenizer = load_qwen_tokenizer()
    async with FakeVLLMServer(tokenizer, model="fake-model", render_features=QwenLikeImageRender(tokenizer)) as server:
        yield server


async def run(fake: FakeVLLMServer, policy: str, *, cache_hits: bool = False, **config: Any) -> Sample:
    tokenizer = load_qwen_tokenizer()
    fake.requests.clear()
    fake.render_features = QwenLikeImageRender(tokenizer, cache_hits=cache_hits)
    fake.script([ScriptedTurn(text=text) for text in TURNS])
    sample = Sample(prompt=PROMPT, index=1)
    values = {"engine_url": fake.url, "model": "fake-model", "max_turns": 4, "image_merge_size": 2,
              "history_policy": policy, "check_invariants": True, **config}  # fmt: skip
    async with VLLMClient(fake.url) as client:
        await Rollout(sample, config=RolloutConfig(**values), sampling_params=dict(SAMPLING), client=client,
                      tokenizer=tokenizer, env_factory=ScriptedEnvFactory(steps=OBSERVATIONS)).run()  # fmt: skip
    return sample


def generate_image_counts(fake: FakeVLLMServer) -> list[int]:
    counts = []
    for request in fake.requests_to(GENERATE_PATH):
        items = ((request.body.get("features") or {}).get("kwargs_data") or {}).get("image") or []
        assert None not in items  # a null item kills vLLM
        counts.append(len(items))
    return counts


def conversation(turns: int) -> list[dict[str, Any]]:
    """The conversation after ``turns`` model turns and their observations."""
    messages: list[dict[str, Any]] = [dict(message) for message in PROMPT]
    for index in range(turns):
        messages.append({"role": "assistant", "content": TURNS[index]})
        observation = OBSERVATIONS[index][0]
        messages.append(observation if isinstance(observation, dict) else {"role": "user", "content": observation})
    return messages


async def engine_features(fake: FakeVLLMServer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    fake.render_features = QwenLikeImageRender(load_qwen_tokenizer())
    async with VLLMClient(fake.url) as client:
        rendered = await client.render({"model": "fake-model", "messages": prepare_render_messages(messages).messages})
    decoded = decode_train_features(rendered.generate_body.get("features"))
    assert decoded is not None
    return decoded


@pytest.mark.parametrize("cache_hits", [False, True], ids=["tensors", "processor-cache-hits"])
async def test_under_fork_image_observations_extend_the_sequence_with_every_image(
    fake: FakeVLLMServer, cache_hits: bool
) -> None:
    sample = await run(fake, "fork", cache_hits=cache_hits)
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
    assert not sample.branches  # the Qwen template writes history back as it is: nothing forks
    assert len(fake.requests_to(RENDER_PATH)) == 1 + 3  # the prompt, then one re-render per observation
    assert generate_image_counts(fake) == [0, 2, 2, 3]  # every generate request carries every image so far
    expected = await engine_features(fake, conversation(3))
    inputs = sample.multimodal_train_inputs
    assert inputs is not None and inputs["image_grid_thw"].shape[0] == 3
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    records = [part for record in sample.metadata["observations"] for message in record["messages"]
               if isinstance(message["content"], list) for part in message["content"]]  # fmt: skip
    assert [part["image_hash"][:7] for part in records if part.get("type") == "image"] == ["sha256:"] * 3


async def test_under_per_turn_each_rows_training_inputs_are_the_images_of_its_prompt(fake: FakeVLLMServer) -> None:
    sample = await run(fake, "per_turn", cache_hits=True)
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
    assert generate_image_counts(fake) == [0, 2, 2, 3]  # each row's prompt is the render of its whole history
    rows = [*sample.branches, None]  # the last row is the sample itself
    assert len(rows) == 4
    for index, row in enumerate(rows):
        inputs = (sample if row is None else row).multimodal_train_inputs
        images = [0, 2, 2, 3][index]
        if not images:
            assert inputs is None
            continue
        expected = await engine_features(fake, conversation(index))
        assert inputs is not None and inputs["image_grid_thw"].shape[0] == images
        assert torch.equal(inputs["pixel_values"], expected["pixel_values"])


async def test_under_fork_an_image_over_the_limit_is_refused_before_any_render(fake: FakeVLLMServer) -> None:
    with pytest.raises(ImageTooLargeError, match="observation_image_max_pixels"):
        await run(fake, "fork", observation_image_max_pixels=32 * 32)
    assert len(fake.requests_to(RENDER_PATH)) == 1  # only the prompt's
