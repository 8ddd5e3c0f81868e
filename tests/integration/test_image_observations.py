"""Image observations end to end: environments that answer with images, on the fake server and the embedded engine.

The reference for every rollout is the engine's own render of the whole conversation (every image, in order): the
sample's tokens must equal it with the model's turns spliced in where the conversation has their text (the model's
tokens need not be the canonical tokens of their text, so the conversation carries a marker the splice replaces),
and its training inputs must equal the features of that render, decoded.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from PIL import Image, ImageDraw

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, Status, VLLMClient, capture_transitions
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.errors import (
    ImageFeaturesMissingError,
    ImageInputError,
    ImageTooLargeError,
    VideoObservationError,
)
from fsm_rollout.multimodal import decode_train_features, prepare_render_messages
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import (
    GENERATE_PATH,
    RENDER_PATH,
    FakeVLLMServer,
    QwenLikeImageRender,
    ScriptedTurn,
)
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SAMPLING = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0, "seed": 3}
MERGE = 2
PROMPT = [{"role": "user", "content": "Walk to the goal. Answer with a move."}]


def board(cell: tuple[int, int], size: int = 64) -> Image.Image:
    """A 4x4 grid board with the agent's cell filled (sides are multiples of 16 for the fake's patches)."""
    image = Image.new("RGB", (size, size), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    step = size // 4
    for line in range(0, size, step):
        draw.line([(line, 0), (line, size)], fill=(90, 90, 90))
        draw.line([(0, line), (size, line)], fill=(90, 90, 90))
    x, y = cell
    draw.rectangle([x * step + 2, y * step + 2, (x + 1) * step - 2, (y + 1) * step - 2], fill=(200, 40, 40))
    return image


def image_message(*cells: tuple[int, int], text: str = "The board:") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, *({"type": "image", "image": board(cell)} for cell in cells)],
    }


OBSERVATIONS: list[tuple[Any, bool]] = [
    (image_message((0, 0), (1, 0), text="Before and after:"), False),  # two images in one observation
    ("Not a legal move; try again.", False),  # a text observation between image ones
    (image_message((1, 1)), False),
]


class Target:
    def __init__(self, kind: str, url: str, model: str, fake: FakeVLLMServer | None) -> None:
        self.kind, self.url, self.model, self.fake = kind, url, model, fake


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local_engine() -> AsyncIterator[LocalEngine]:
    async with LocalEngine(torch_threads=1) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake_images() -> AsyncIterator[FakeVLLMServer]:
    tokenizer = load_qwen_tokenizer()
    async with FakeVLLMServer(tokenizer, model="fake-model", render_features=QwenLikeImageRender(tokenizer)) as fake:
        yield fake


@pytest.fixture(params=["fake", "local"])
def target(request: pytest.FixtureRequest, local_engine: LocalEngine, fake_images: FakeVLLMServer) -> Target:
    if request.param == "local":
        return Target("local", local_engine.url, local_engine.served_model_name, None)
    fake_images.requests.clear()
    fake_images.render_features = QwenLikeImageRender(load_qwen_tokenizer())
    return Target("fake", fake_images.url, "fake-model", fake_images)


async def rollout(
    target: Target, sample: Sample, envs: ScriptedEnvFactory, *, turns: int = 4, **config: Any
) -> tuple[Sample, list[dict[str, Any]]]:
    if target.fake is not None:
        target.fake.script([ScriptedTurn(text=f"Move {i}: right.") for i in range(turns)])
    values: dict[str, Any] = {
        "engine_url": target.url,
        "model": target.model,
        "max_turns": turns,
        "check_invariants": True,
        "image_merge_size": MERGE,
        "retry": RetryPolicy(max_attempts=1, base_delay_s=0.01),
    }
    values.update(config)
    async with VLLMClient(target.url, retry=values["retry"]) as client:
        runner = Rollout(
            sample,
            config=RolloutConfig(**values),
            sampling_params=dict(SAMPLING),
            client=client,
            tokenizer=load_qwen_tokenizer(),
            env_factory=envs,
        )
        with capture_transitions() as events:
            await runner.run()
    return sample, events


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


async def full_render(target: Target, sample: Sample, observations: list[Any]) -> tuple[list[int], dict[str, Any]]:
    """The engine's render of the whole conversation, with the sample's turns spliced in for their markers."""
    tokenizer = load_qwen_tokenizer()
    turns = turn_runs(sample)
    messages: list[dict[str, Any]] = [dict(message) for message in PROMPT]
    for index in range(len(turns) - 1):
        messages.append({"role": "assistant", "content": f"[[{index}]]"})
        observation = observations[index]
        messages.append(observation if isinstance(observation, dict) else {"role": "user", "content": observation})
    payload = {"model": target.model, "messages": prepare_render_messages(messages).messages}
    async with VLLMClient(target.url) as client:
        rendered = await client.render(payload)
    ids = list(rendered.token_ids)
    for index, turn in enumerate(turns[:-1]):
        marker = tokenizer.encode(f"[[{index}]]", add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)
        body = turn[:-1] if turn[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") else turn
        ids[at : at + len(marker)] = body
    return ids + turns[-1], rendered.generate_body.get("features") or {}


def image_counts(target: Target) -> list[int]:
    assert target.fake is not None
    counts = []
    for request in target.fake.requests_to(GENERATE_PATH):
        features = request.body.get("features") or {}
        items = (features.get("kwargs_data") or {}).get("image") or []
        assert None not in items  # a null item kills vLLM
        counts.append(len(items))
    return counts


# ------------------------------------------------------------------------------------ the happy path


async def test_image_observations_equal_the_engines_render_of_the_whole_conversation(target: Target) -> None:
    envs = ScriptedEnvFactory(steps=OBSERVATIONS)
    sample, events = await rollout(target, Sample(prompt=PROMPT, index=1), envs)
    assert sample.status == Status.TRUNCATED and sample.metadata["rollout_reason"] == "max_turns"
    if target.fake is not None:
        assert image_counts(target) == [0, 2, 2, 3]  # every generate request carries every image so far
        assert len(target.fake.requests_to(RENDER_PATH)) == 1 + 2  # one render per image observation
    expected_ids, expected_features = await full_render(target, sample, [obs for obs, _ in OBSERVATIONS])
    assert sample.tokens == expected_ids
    expected = decode_train_features(expected_features)
    inputs = sample.multimodal_train_inputs
    assert expected is not None and inputs is not None
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    assert inputs["image_grid_thw"].shape[0] == 3
    observed = [event for event in events if event["trigger"] == "generate" and event["src"] == "observing"]
    assert [len(event.get("observation_image_hashes", [])) for event in observed] == [2, 0, 1]
    images = [part for record in sample.metadata["observations"] for m in record["messages"] for part in m["content"]
              if isinstance(m["content"], list) and part.get("type") == "image"]  # fmt: skip
    assert [part["image_hash"].startswith("sha256:") for part in images] == [True] * 3


async def test_an_image_observation_as_a_tool_result_with_an_image_url_part(target: Target, tmp_path: Any) -> None:
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]
    path = str(tmp_path / "board.png")
    board((2, 2)).save(path, format="PNG")
    result = {"role": "tool", "tool_call_id": "call_0", "name": "look",
              "content": [{"type": "image_url", "image_url": {"url": path}}]}  # fmt: skip
    envs = ScriptedEnvFactory(steps=[([result], False)])
    sample, _ = await rollout(target, Sample(prompt=PROMPT, index=2, metadata={"tools": tools}), envs, turns=2)
    inputs = sample.multimodal_train_inputs
    assert inputs is not None and inputs["image_grid_thw"].shape[0] == 1
    assert sample.status == Status.TRUNCATED


# ------------------------------------------------------------------------------------ budgets and boundaries


async def test_an_image_observation_that_does_not_fit_ends_the_sample_without_any_of_it(target: Target) -> None:
    envs = ScriptedEnvFactory(steps=[("Text first.", False), (image_message((3, 3)), False)])
    # Room for the prompt, two short turns and the text observation, not for the image's placeholders as well.
    probe, _ = await rollout(
        target, Sample(prompt=PROMPT, index=3), ScriptedEnvFactory(steps=[("Text first.", False)]), turns=2
    )
    limit = len(probe.tokens) + 12 + 6
    sample, _ = await rollout(target, Sample(prompt=PROMPT, index=3), envs, turns=3, rollout_max_context_len=limit)
    assert sample.status == Status.TRUNCATED
    truncation = sample.metadata["multiturn_truncation"]
    assert truncation["reason"] == "insufficient_budget_for_next_turn"
    assert truncation["observation_tokens"] >= truncation["remaining_budget"]
    pad = load_qwen_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    assert pad not in sample.tokens and sample.multimodal_train_inputs is None
    assert len(sample.tokens) <= limit
    assert len(sample.metadata["observations"]) == 1  # the text one only


async def test_the_context_limit_counts_the_expanded_image_tokens(target: Target) -> None:
    sample, _ = await rollout(
        target, Sample(prompt=PROMPT, index=4), ScriptedEnvFactory(steps=OBSERVATIONS[:1]), turns=2
    )
    pad = load_qwen_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    placeholders = sample.tokens.count(pad)
    assert placeholders > 2  # expanded, not one per image
    grids = sample.multimodal_train_inputs["image_grid_thw"]
    assert placeholders == int((grids.prod(dim=1) // MERGE**2).sum())


# ------------------------------------------------------------------------------------ refusals


async def test_a_video_part_is_refused_with_a_typed_error_and_the_env_closed_once(target: Target) -> None:
    video = {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}
    envs = ScriptedEnvFactory(steps=[(video, False)])
    with pytest.raises(VideoObservationError, match="'video' part"):
        await rollout(target, Sample(prompt=PROMPT, index=5), envs, turns=2)
    assert envs.last.close_count == 1


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's shape; no pixel data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("image", "error", "match", "config"),
    [
        ("BOMB", ImageTooLargeError, "refused as a decompression bomb", {}),
        ("BIG", ImageTooLargeError, "over the limit of 1000 \\(RolloutConfig.observation_image_max_pixels\\)",
         {"observation_image_max_pixels": 1000}),
        ("BYTES", ImageTooLargeError, "bytes is over the limit of 100", {"observation_image_max_bytes": 100}),
        ("/no/such/board.png", ImageInputError, "not a data: URL", {}),
    ],
)  # fmt: skip
async def test_a_bad_observation_image_fails_the_sample_keeping_its_data(
    target: Target, tmp_path: Any, image: Any, error: type[Exception], match: str, config: dict[str, Any]
) -> None:
    if image == "BOMB":
        image = str(tmp_path / "bomb.png")
        (tmp_path / "bomb.png").write_bytes(png_claiming(30000, 30000))
    elif image in ("BIG", "BYTES"):
        image = board((0, 0))
    envs = ScriptedEnvFactory(
        steps=[
            (image_message((0, 0)), False),
            ({"role": "user", "content": [{"type": "image", "image": image}]}, False),
        ]
    )
    sample = Sample(prompt=PROMPT, index=6)
    if "observation_image_max_bytes" in config:  # the first observation must pass: the second one's PNG is the same
        envs = ScriptedEnvFactory(
            steps=[("Look.", False), ({"role": "user", "content": [{"type": "image", "image": image}]}, False)]
        )
    with pytest.raises(error, match=match):
        await rollout(target, sample, envs, turns=3, **config)
    assert sample.status == Status.FAILED
    assert sample.metadata["rollout_error"]["type"] == error.__name__
    assert envs.last.close_count == 1
    assert sample.response_length > 0 and len(sample.loss_mask) == sample.response_length  # its data is kept


# ------------------------------------------------------------------------------------ the processor-cache trap


async def test_a_null_item_for_an_image_the_sample_holds_is_filled_from_it(fake_images: FakeVLLMServer) -> None:
    target = Target("fake", fake_images.url, "fake-model", fake_images)
    fake_images.requests.clear()
    fake_images.render_features = QwenLikeImageRender(load_qwen_tokenizer(), cache_hits=True)
    same = [(image_message((0, 0)), False), (image_message((0, 0)), False)]
    sample, _ = await rollout(target, Sample(prompt=PROMPT, index=7), ScriptedEnvFactory(steps=same), turns=3)
    assert sample.status == Status.TRUNCATED
    assert image_counts(target) == [0, 1, 2]
    answers = fake_images.render_features.answers
    assert answers[-1][1] is not None and answers[-1][1]["kwargs_data"]["image"] == [None]  # the engine left it out
    grids = sample.multimodal_train_inputs["image_grid_thw"]
    assert grids.shape[0] == 2 and torch.equal(grids[0], grids[1])


async def test_a_null_item_no_one_holds_fails_naming_the_engine_flag_before_any_request(
    fake_images: FakeVLLMServer,
) -> None:
    target = Target("fake", fake_images.url, "fake-model", fake_images)
    fake_images.requests.clear()
    fake_images.render_features = QwenLikeImageRender(load_qwen_tokenizer(), null_item=0)
    envs = ScriptedEnvFactory(steps=[(image_message((2, 1)), False)])
    sample = Sample(prompt=PROMPT, index=8)
    with pytest.raises(ImageFeaturesMissingError, match="--mm-processor-cache-gb 0"):
        await rollout(target, sample, envs, turns=3)
    assert image_counts(target) == [0]  # nothing was sent with the null item
    assert envs.last.close_count == 1


# ------------------------------------------------------------------------------------ downstream


async def test_a_recorded_image_observation_run_replays_identically_with_each_image_stored_once(
    fake_images: FakeVLLMServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import orjson

    from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_path_for
    from fsm_rollout.replay import replay
    from fsm_rollout.trace import Tracer

    fake_images.render_features = QwenLikeImageRender(load_qwen_tokenizer())
    fake_images.script([ScriptedTurn(text=f"Move {i}: up.") for i in range(3)])
    trace = tmp_path / "run.jsonl"
    tracer = Tracer(trace.open("ab"), owns_stream=True)
    writer = TapeWriter(tape_path_for(trace))

    def shaded(cell: tuple[int, int]) -> dict[str, Any]:  # a gradient, so its PNG is long enough to be a blob
        image = board(cell, size=128)
        draw = ImageDraw.Draw(image)
        for row in range(0, 128, 2):
            draw.line([(0, row), (127, row)], fill=(row * 2, 255 - row, (row * 7) % 256))
        draw.rectangle([cell[0] * 32, cell[1] * 32, cell[0] * 32 + 31, cell[1] * 32 + 31], fill=(200, 40, 40))
        return {"role": "user", "content": [{"type": "image", "image": image}]}

    first, second = shaded((0, 0)), shaded((0, 1))
    same = [([first, second], False), ([first], False)]  # board (0, 0) twice
    sample = Sample(prompt=PROMPT, index=9)
    config = RolloutConfig(engine_url=fake_images.url, model="fake-model", max_turns=3, image_merge_size=MERGE)
    async with VLLMClient(fake_images.url) as client:
        rollout = recorded_rollout(
            sample,
            config=config,
            sampling_params={**SAMPLING, "max_new_tokens": 1000},
            client=client,
            tokenizer=load_qwen_tokenizer(),
            env_factory=ScriptedEnvFactory(steps=same),
            tracer=tracer,
            tape=writer,
        )
        await rollout.run()
    writer.close()
    tracer.close()
    assert sample.status == Status.TRUNCATED and sample.multimodal_train_inputs["image_grid_thw"].shape[0] == 3
    report = await asyncio.to_thread(replay, trace, tokenizer=load_qwen_tokenizer())
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": 1}
    lines = [orjson.loads(line) for line in tape_path_for(trace).read_bytes().splitlines()]
    blobs = [line["data"] for line in lines if line["kind"] == "blob" and line["data"].startswith("data:image/png")]
    assert len(blobs) == len(set(blobs)) == 2  # two distinct boards, each stored once however often it is sent

    from fsm_rollout.cli import main as cli_main
    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    capsys.readouterr()
    args = ["inspect", str(trace), "--sample", "9", "--tokenizer", str(qwen_tokenizer_dir()), "--color", "never"]
    assert await asyncio.to_thread(cli_main, args) == 0
    out = capsys.readouterr().out
    assert out.count("[image: 64 tokens]") == 3  # image spans marked, not 64 placeholders each
    assert "<|image_pad|>" not in out and "data:image" not in out and "'<image>'" in out


async def test_a_handed_back_image_sample_keeps_its_features_through_json_and_resumes_to_the_same_result(
    fake_images: FakeVLLMServer,
) -> None:
    import json
    from dataclasses import dataclass, field

    from fsm_rollout.testing.envs import ScriptedEnv
    from fsm_rollout.weights.suspension import HandBack, Suspender

    class HandingBack(Suspender):
        async def wait_resumed(self) -> None:
            if self.suspended:
                raise HandBack

    @dataclass
    class SnapshotEnv(ScriptedEnv):
        restored: list[Any] = field(default_factory=list)

        def snapshot(self) -> dict[str, Any]:
            return {"texts": list(self.texts)}

        def restore(self, state: Any) -> None:
            self.restored.append(state)
            self.texts[:] = state["texts"]

    @dataclass
    class SnapshotEnvFactory(ScriptedEnvFactory):
        def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
            env = SnapshotEnv(steps=list(self.steps), default=self.default)
            self.built.append(env)
            return env

    steps = [(image_message((0, 0), (3, 3)), False), (image_message((1, 2)), False)]
    turns = ["Move 0: right.", "Move 1: down and then left.", "Move 2: up."]
    values = {"engine_url": fake_images.url, "model": "fake-model", "max_turns": 3, "image_merge_size": MERGE,
              "router_policy": "consistent_hash", "check_invariants": True}  # fmt: skip
    fake_images.render_features = QwenLikeImageRender(load_qwen_tokenizer())
    async with VLLMClient(fake_images.url) as client:

        def build(sample: Sample, envs: ScriptedEnvFactory, gate: Suspender | None = None) -> Rollout:
            return Rollout(sample, config=RolloutConfig(**values), sampling_params=dict(SAMPLING), client=client,
                           tokenizer=load_qwen_tokenizer(), env_factory=envs, suspender=gate)  # fmt: skip

        fake_images.script([ScriptedTurn(text=text) for text in turns], session="img")
        reference = await build(
            Sample(prompt=PROMPT, index=10, session_id="img"), SnapshotEnvFactory(steps=steps)
        ).run()
        held = ScriptedTurn(text=turns[1], hang=True, held_after=3)  # handed back during the turn after the images
        fake_images.script([ScriptedTurn(text=turns[0]), held, ScriptedTurn(text=turns[2])], session="img")
        gate = HandingBack(lambda: [client])
        envs = SnapshotEnvFactory(steps=steps)
        sample = Sample(prompt=PROMPT, index=10, session_id="img")
        run = asyncio.ensure_future(build(sample, envs, gate).run())
        await fake_images.wait_until_waiting(1)
        await gate.suspend()
        await run
        assert sample.metadata["rollout_reason"] == "handed_back"
        state = sample.metadata["resume_state"]
        features = state["rendered"]["generate_body"]["features"]
        assert len(features["kwargs_data"]["image"]) == 2  # the first observation's images are in the resume state
        shipped = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))  # as Ray would carry it
        await gate.resume()
        resumed = await build(shipped, envs, gate).run()
    assert (resumed.tokens, resumed.loss_mask, resumed.status) == (
        reference.tokens,
        reference.loss_mask,
        reference.status,
    )
    ours, theirs = resumed.multimodal_train_inputs, reference.multimodal_train_inputs
    assert ours is not None and theirs is not None and ours["image_grid_thw"].shape[0] == 3
    assert all(torch.equal(ours[key], theirs[key]) for key in ("pixel_values", "image_grid_thw"))
    again = Sample.from_dict(json.loads(json.dumps(resumed.to_dict())))
    assert torch.equal(again.multimodal_train_inputs["pixel_values"], ours["pixel_values"])


# ------------------------------------------------------------------------------------ an engine that disagrees


class Skewed(QwenLikeImageRender):
    """The fake's image render, altered in one way for observations (renders after the dummy prefix)."""

    def __init__(self, tokenizer: Any, how: str) -> None:
        super().__init__(tokenizer)
        self.how = how

    def __call__(self, messages: list[dict[str, Any]], ids: list[int]) -> tuple[list[int], dict[str, Any] | None]:
        expanded, features = super().__call__(messages, ids)
        if features is None or messages[0].get("content") != "You are a helpful assistant.":
            return expanded, features
        if self.how == "prefix":  # the engine's template renders the dummy prefix differently
            return [expanded[0], *expanded], features
        if self.how == "fewer_pads":  # one placeholder token short of what the grid says
            place = features["mm_placeholders"]["image"][0]
            del expanded[place["offset"]]
            place["length"] -= 1
        if self.how == "no_features":
            return expanded, None
        return expanded, features


@pytest.mark.parametrize(
    ("how", "error", "match"),
    [
        ("prefix", "TemplateNotPrefixStable", "render of the dummy prefix"),
        ("fewer_pads", "ImageTokenMismatchError", "image_tokens=15, expected_image_tokens=16"),
        ("no_features", "ImageObservationFeaturesMissingError", "answered no image features"),
    ],
)
async def test_an_observation_the_engine_encodes_inconsistently_fails_before_it_is_appended(
    fake_images: FakeVLLMServer, how: str, error: str, match: str
) -> None:
    target = Target("fake", fake_images.url, "fake-model", fake_images)
    fake_images.requests.clear()
    fake_images.render_features = Skewed(load_qwen_tokenizer(), how)
    envs = ScriptedEnvFactory(steps=[(image_message((1, 1)), False)])
    sample = Sample(prompt=PROMPT, index=11)
    with pytest.raises(Exception, match=match) as caught:
        await rollout(target, sample, envs, turns=3)
    assert type(caught.value).__name__ == error
    assert sample.status == Status.FAILED and envs.last.close_count == 1
    assert image_counts(target) == [0]  # nothing of the observation reached a generate request
    assert load_qwen_tokenizer().convert_tokens_to_ids("<|image_pad|>") not in sample.tokens
