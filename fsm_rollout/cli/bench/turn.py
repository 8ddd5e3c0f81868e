"""The ``turn`` workload: client CPU per turn of whole rollouts against an in-process zero-latency engine."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from fsm_rollout.cli.bench.params import Settings


def bench_turn(settings: Settings, samples: int = 300, turns: int = 3) -> dict[str, float]:
    """Client CPU per turn of whole rollouts against an in-process zero-latency engine (microseconds)."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample
    from fsm_rollout.testing.envs import ScriptedEnvFactory
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer
    from fsm_rollout.trace import get_tracer
    from fsm_rollout.types import GeneratedTurn, RenderedPrompt, TurnMeta

    tokenizer = load_qwen_tokenizer()
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Find x in the triangle."}], add_generation_prompt=True, return_dict=False
        )
    )
    answer = tokenizer.encode("Let me compute the angle: x = 180 - 50 - 60 = 70.", add_special_tokens=False)

    class ZeroLatencyClient:
        async def render(self, payload: Any, *, headers: Any = None) -> RenderedPrompt:
            return RenderedPrompt(token_ids=list(prompt), generate_body={"token_ids": list(prompt), "model": "m"})

        async def generate(self, body: Any, *, request_id: str, headers: Any = None) -> GeneratedTurn:
            return GeneratedTurn(
                request_id=request_id,
                finish="stop",
                token_ids=list(answer),
                logprobs=[-0.5] * len(answer),
                meta=TurnMeta(finish_reason="stop", prompt_tokens=len(body["token_ids"])),
            )

        async def abort(self, request_ids: Any, *, headers: Any = None) -> None:
            return None

    sampling = {"max_new_tokens": 4096, "temperature": 1.0, "top_p": 1.0}

    def run(trace: str | None) -> float:
        config = RolloutConfig(
            engine_url="http://127.0.0.1:1",
            model="m",
            max_turns=turns,
            trace=trace,
            loop_slice_ms=settings.loop_slice_ms,
            tune_gc=settings.tune_gc,
        )

        async def main() -> float:
            rollouts = [
                Rollout(
                    Sample(prompt="q", index=i),
                    config=config,
                    sampling_params=sampling,
                    client=ZeroLatencyClient(),  # type: ignore[arg-type]
                    tokenizer=tokenizer,
                    env_factory=ScriptedEnvFactory(),
                )
                for i in range(samples)
            ]
            start = time.process_time()
            await asyncio.gather(*(rollout.run() for rollout in rollouts))
            return (time.process_time() - start) / (samples * turns) * 1e6

        return asyncio.run(main())

    with tempfile.TemporaryDirectory() as tmp:
        trace_path = str(Path(tmp) / "trace.jsonl")
        run(None)  # warm the observation-prefix cache and imports
        # CPU-only work: interference only adds, so the least of five interleaved runs is the figure (as timeit)
        offs, ons = [], []
        for _ in range(5):
            offs.append(run(None))
            ons.append(run(trace_path))
        off, on = min(offs), min(ons)
        get_tracer(trace_path).close()

    encoder_message = {"role": "user", "content": "Continue the reasoning."}
    from fsm_rollout.tokens.chat import ObservationEncoder

    encoder = ObservationEncoder(tokenizer)
    encoder.encode(encoder_message, ends_with_eos=True)
    start = time.process_time()
    for _ in range(200):
        encoder.encode(encoder_message, ends_with_eos=True)
    template_us = (time.process_time() - start) / 200 * 1e6
    start = time.process_time()
    for _ in range(200):
        tokenizer.decode(answer, skip_special_tokens=False)
    decode_us = (time.process_time() - start) / 200 * 1e6
    return {
        "turn_cpu_us_trace_off": off,
        "turn_cpu_us_trace_file": on,
        "of_which_observation_template_us": template_us,
        "of_which_decode_us": decode_us,
    }
