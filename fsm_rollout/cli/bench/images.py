"""The ``images`` workload: what an image observation costs the client, engine excluded.

An environment returns a 448x448 image each turn. The engine's answers are computed once, before anything is timed,
by the embedded engine's own image processing (:class:`fsm_rollout.engine.local.images.ImageSupport`, Qwen2-VL's
processor: 256 placeholder tokens and 1,024 patch rows per image), and serialised as vLLM's render answer. Then the
client's whole part of each observation is timed in this process: the image checked against the limits and encoded
as a PNG data URL, the render request serialised, the answer's JSON parsed, the boundary cut out, the features
placed, the image-token check, and the append that merges them into the sample's features. Figures:

* ``client_cpu_ms_per_image_observation``: the median over observations of that CPU time (``time.process_time``)
  in a run after a warm-up run, with the median of each part beside it (``encode_ms``: limits, PNG and data URL;
  ``answer_parse_ms``: the answer's JSON; the rest of the observation as ``place_and_check_ms``). No timed run is
  under ``tracemalloc``, which traces every allocation: the memory figure has a run of its own;
* ``before_*`` and ``speedup_x``: the same observations with the parts done the previous way, timed in the same
  run on the same inputs (PIL's default PNG encoder; the whole answer through ``orjson.loads``, which walks the
  features' base64), and the median ratio of the totals;
* ``render_calls_per_image_observation``: render requests per image observation in a rollout of four image
  observations against the fake server over HTTP (its prompt's render not counted);
* ``kib_per_sample_with_four_images``: memory a sample holds once four images are in its features, measured with
  ``tracemalloc`` over several samples kept alive (the features are base64 text: what every later generate request
  carries).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import tracemalloc
from typing import Any

import orjson

from fsm_rollout.tokens.parity import template_token_ids

IMAGE_SIDE = 448
OBSERVATIONS = 4
"""Image observations per sample."""


def _image(seed: int) -> Any:
    """A 448x448 board-like image with some texture, different for each seed."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    for row in range(0, IMAGE_SIDE, 4):
        draw.line([(0, row), (IMAGE_SIDE, row)], fill=((row * 3 + seed * 40) % 256, (row + seed * 7) % 256, 120))
    draw.ellipse([seed * 20, seed * 20, seed * 20 + 100, seed * 20 + 100], fill=(200, 30, 30))
    return image


def _observation(image: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": "The board now:"}, {"type": "image", "image": image}]}
    ]


def _engine_answers(tokenizer: Any, encoder: Any, images: list[Any]) -> list[bytes]:
    """The embedded engine's render answer (JSON bytes) for each observation after the dummy prefix."""
    from fsm_rollout.engine.local.images import ImageSupport
    from fsm_rollout.engine.serving import RenderRequest, render_answer
    from fsm_rollout.multimodal import prepare_render_messages

    support = ImageSupport(tokenizer)
    answers = []
    for image in images:
        messages = _observation(image)
        dummy, _, _ = encoder.image_render_prefix(messages)
        prepared = prepare_render_messages([*dummy, *messages]).messages
        ids = template_token_ids(
            tokenizer.apply_chat_template(prepared, tokenize=True, add_generation_prompt=True), what="bench render"
        )
        url = prepared[-1]["content"][1]["image_url"]["url"]
        rendered = support.render(ids, [url], with_tensors=True)
        request = RenderRequest(
            messages=prepared,
            tools=None,
            template_kwargs={},
            add_generation_prompt=True,
            continue_final_message=False,
            sampling_params={},
            mm_payload="tensors",
            body={},
        )
        answer = render_answer(request, rendered.token_ids, rendered.features, model="bench", max_model_len=32768)
        answers.append(orjson.dumps(answer))
    return answers


def _context(tokenizer: Any, encoder: Any) -> Any:
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.rollout.context import Deps, RolloutContext
    from fsm_rollout.rollout.gating import GatePoint
    from fsm_rollout.sample import Sample
    from fsm_rollout.types import RenderedPrompt

    config = RolloutConfig(engine_url="http://bench.invalid", model="bench", max_turns=8, image_merge_size=2)
    deps = Deps(config=config, params={"max_tokens": None}, encoder=encoder, tokenizer=tokenizer, processor=None,
                gate=GatePoint(None))  # fmt: skip
    sample = Sample(prompt="Walk the maze.", index=0)
    prompt = template_token_ids(
        tokenizer.apply_chat_template([{"role": "user", "content": "Walk the maze."}], tokenize=True,
                                      add_generation_prompt=True), what="bench prompt")  # fmt: skip
    ctx = RolloutContext(sample=sample, deps=deps, sample_id="0")
    ctx.rendered = RenderedPrompt(token_ids=prompt, generate_body={"model": "bench", "features": None})
    sample.tokens = list(prompt)
    return ctx


async def _observe(ctx: Any, image: Any, answer: bytes, timings: dict[str, list[float]]) -> None:
    """One image observation of ``ctx``'s sample, its client work timed by part; then the model's next turn (a few
    canned tokens) so the next observation follows a turn.

    The previous way of each changed part (PIL's default PNG, the whole answer through ``orjson.loads``) is timed
    beside it on the same input, and the total before is the total now with those parts swapped back."""
    from fsm_rollout.engine.schema.answers import parse_render_response
    from fsm_rollout.engine.schema.large_answers import loads_answer
    from fsm_rollout.multimodal import ImageLimits, check_image_limits, prepare_render_messages
    from fsm_rollout.rollout.observation_images import encode_image_observation
    from fsm_rollout.rollout.steps import append_observation

    parse_cpu = parse_before = 0.0

    async def render(payload: dict[str, Any]) -> Any:
        nonlocal parse_cpu, parse_before
        orjson.dumps(payload)  # the request body, as the transport serialises it
        started = time.process_time()
        parse_render_response(orjson.loads(answer), "bench")
        parse_before = time.process_time() - started
        started = time.process_time()
        parsed = parse_render_response(loads_answer(answer), "bench")  # as the transport parses it
        parse_cpu = time.process_time() - started
        return parsed

    messages = _observation(image)
    encode: dict[bool, float] = {}
    for fast in (False, True):  # measured alone for the breakdown; the encode below repeats the fast one
        started = time.process_time()
        check_image_limits(messages, ImageLimits())
        prepare_render_messages(messages, fast=fast)
        encode[fast] = time.process_time() - started
    started = time.process_time()
    await encode_image_observation(ctx, messages, render)
    append_observation(ctx)
    total = time.process_time() - started - parse_before  # the old parse ran inside, for the breakdown only
    timings["total"].append(total * 1000)
    timings["encode"].append(encode[True] * 1000)
    timings["parse"].append(parse_cpu * 1000)
    timings["rest"].append(max(0.0, total - encode[True] - parse_cpu) * 1000)
    timings["total_before"].append((total - encode[True] - parse_cpu + encode[False] + parse_before) * 1000)
    timings["encode_before"].append(encode[False] * 1000)
    timings["parse_before"].append(parse_before * 1000)
    eos = ctx.deps.encoder.eos_token_id
    turn = [*ctx.deps.tokenizer.encode("right", add_special_tokens=False), eos]
    ctx.sample.append_response_tokens(turn, [0.0] * len(turn), trainable=True)


def bench_image_observations(quick: bool) -> dict[str, float]:
    """The ``images`` figures (see the module docstring)."""
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer
    from fsm_rollout.tokens.chat import ObservationEncoder

    tokenizer = load_qwen_tokenizer()
    encoder = ObservationEncoder(tokenizer)
    images = [_image(seed) for seed in range(OBSERVATIONS)]
    answers = _engine_answers(tokenizer, encoder, images)
    names = ("total", "encode", "parse", "rest", "total_before", "encode_before", "parse_before")
    samples = 2 if quick else 6

    async def run(timings: dict[str, list[float]]) -> list[Any]:
        kept = []
        for _ in range(samples):
            ctx = _context(tokenizer, encoder)
            for image, answer in zip(images, answers, strict=True):
                await _observe(ctx, image, answer, timings)
            kept.append(ctx)
        return kept

    asyncio.run(run({name: [] for name in names}))  # warm-up
    timings: dict[str, list[float]] = {name: [] for name in names}
    asyncio.run(run(timings))
    # Memory in a run of its own: tracemalloc traces every allocation, which would double the CPU timed above.
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = asyncio.run(run({name: [] for name in names}))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    for ctx in kept:
        inputs = ctx.rendered.generate_body["features"]["kwargs_data"]["image"]
        assert len(inputs) == OBSERVATIONS  # every image is in the sample's features
    return {
        "image_side_px": float(IMAGE_SIDE),
        "client_cpu_ms_per_image_observation": statistics.median(timings["total"]),
        "encode_ms": statistics.median(timings["encode"]),
        "answer_parse_ms": statistics.median(timings["parse"]),
        "place_and_check_ms": statistics.median(timings["rest"]),
        "before_client_cpu_ms": statistics.median(timings["total_before"]),
        "before_encode_ms": statistics.median(timings["encode_before"]),
        "before_answer_parse_ms": statistics.median(timings["parse_before"]),
        "speedup_x": statistics.median(
            before / now for before, now in zip(timings["total_before"], timings["total"], strict=True)
        ),
        "render_calls_per_image_observation": _render_calls_per_observation(),
        "kib_per_sample_with_four_images": held / len(kept) / 1024,
    }


def _render_calls_per_observation() -> float:
    """Render requests per image observation in one rollout of four against the fake server over HTTP."""
    from fsm_rollout import Rollout, RolloutConfig, Sample, VLLMClient
    from fsm_rollout.testing.envs import ScriptedEnvFactory
    from fsm_rollout.testing.fake_vllm import RENDER_PATH, FakeVLLMServer, QwenLikeImageRender, ScriptedTurn
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    steps = [(_observation(_image(seed).resize((64, 64)))[0], False) for seed in range(OBSERVATIONS)]

    async def run() -> float:
        async with FakeVLLMServer(tokenizer, model="bench", render_features=QwenLikeImageRender(tokenizer)) as fake:
            fake.script([ScriptedTurn(text="right")] * (OBSERVATIONS + 1))
            config = RolloutConfig(engine_url=fake.url, model="bench", max_turns=OBSERVATIONS + 1, image_merge_size=2)
            async with VLLMClient(fake.url) as client:
                sample = Sample(prompt="Walk the maze.", index=0)
                sampling = {"max_new_tokens": 2000, "temperature": 1.0, "top_p": 1.0}
                await Rollout(sample, config=config, sampling_params=sampling, client=client, tokenizer=tokenizer,
                              env_factory=ScriptedEnvFactory(steps=steps)).run()  # fmt: skip
            return (len(fake.requests_to(RENDER_PATH)) - 1) / OBSERVATIONS

    return asyncio.run(run())


__all__ = ["IMAGE_SIDE", "OBSERVATIONS", "bench_image_observations"]
