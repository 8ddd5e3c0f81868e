"""The HTTP workloads: rollouts against the loopback server (scale, tracing), the seed-style baseline loop, the
client's JSON work, and replay of a recorded batch."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orjson import dumps as orjson_dumps
from orjson import loads as orjson_loads

from fsm_rollout.cli.bench.params import PROMPT, SAMPLING, SCALE_TURNS, Settings
from fsm_rollout.runtime import gc_policy


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class LoopMonitor:
    """Samples event-loop lag (how late a short sleep wakes up) and the process RSS while a workload runs."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self.peak_rss = _rss_bytes()
        self._task: asyncio.Task[None] | None = None
        self._gc_started = 0.0
        self.gc2_count = 0
        self.gc2_total_s = 0.0
        self.gc2_max_s = 0.0

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - start - self.interval))
            self.peak_rss = max(self.peak_rss, _rss_bytes())

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif info.get("generation") == 2:
            pause = time.perf_counter() - self._gc_started
            self.gc2_count += 1
            self.gc2_total_s += pause
            self.gc2_max_s = max(self.gc2_max_s, pause)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        gc.callbacks.remove(self._on_gc)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.peak_rss = max(self.peak_rss, _rss_bytes())

    def lag_p99_ms(self) -> float:
        if not self.lags:
            return 0.0
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000.0


def _token_data_bytes(samples: list[Any]) -> int:
    """Bytes held by the samples' token data: the id, mask and logprob lists and the number objects in them."""
    total = 0
    seen: set[int] = set()
    for sample in samples:
        for values in (sample.tokens, sample.loss_mask, sample.rollout_log_probs):
            total += sys.getsizeof(values)
            for value in values:
                if id(value) not in seen:
                    seen.add(id(value))
                    total += sys.getsizeof(value)
    return total


def run_rollouts(
    url: str, tokenizer: Any, samples: int, settings: Settings, *, trace: str | None = None, record: bool = False
) -> dict[str, float]:
    """``samples`` rollouts of three turns each, all in flight at once, against the server at ``url``."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.recording import recorded_rollout
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample
    from fsm_rollout.testing.envs import ScriptedEnvFactory

    config = RolloutConfig(
        engine_url=url,
        model="fake-model",
        max_turns=SCALE_TURNS,
        trace=trace,
        record=record,
        loop_slice_ms=settings.loop_slice_ms,
        tune_gc=settings.tune_gc,
    )
    build = recorded_rollout if record else Rollout

    async def main() -> dict[str, float]:
        client = VLLMClient.from_config(config)
        monitor = LoopMonitor()
        gc.collect()
        rss_before = _rss_bytes()
        factory = ScriptedEnvFactory()
        # The collector is tuned from before the rollouts and their tasks are made, as RolloutRunner.run_batch
        # does: tasks made before the first rollout starts would otherwise set off a full collection at 10k.
        with gc_policy.rollouts_in_flight() if config.tune_gc else contextlib.nullcontext():
            records = [Sample(prompt=PROMPT, index=i) for i in range(samples)]
            rollouts = [
                build(
                    sample,
                    config=config,
                    sampling_params=SAMPLING,
                    client=client,
                    tokenizer=tokenizer,
                    env_factory=factory,
                )
                for sample in records
            ]
            monitor.start()
            wall, cpu = time.perf_counter(), time.process_time()
            results = await asyncio.gather(*(rollout.run() for rollout in rollouts), return_exceptions=True)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await monitor.stop()
        await client.close()
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise RuntimeError(f"bench: {len(errors)} rollout(s) failed, first: {errors[0]!r}")
        turns = sum(rollout.turn_index + 1 for rollout in rollouts)
        token_bytes = _token_data_bytes(records)
        return {
            "samples": float(samples),
            "turns": float(turns),
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_us_per_turn": cpu / turns * 1e6,
            "peak_rss_mib": monitor.peak_rss / 2**20,
            "kib_per_sample_beyond_tokens": max(0.0, monitor.peak_rss - rss_before - token_bytes) / samples / 1024,
            "token_data_kib_per_sample": token_bytes / samples / 1024,
            "loop_lag_p99_ms": monitor.lag_p99_ms(),
            "loop_lag_max_ms": max(monitor.lags, default=0.0) * 1000.0,
            "full_gc_count": float(monitor.gc2_count),
            "full_gc_total_s": monitor.gc2_total_s,
            "full_gc_max_ms": monitor.gc2_max_s * 1000.0,
        }

    return asyncio.run(main())


def baseline_rollouts(url: str, tokenizer: Any, samples: int) -> dict[str, float]:
    """The seed's way, as a plain imperative loop: same HTTP session and tokenizer, stdlib json, and two
    chat-template renders per observation (the dummy conversation with and without the observation)."""
    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH
    from fsm_rollout.engine.transport import AiohttpTransport
    from fsm_rollout.testing.envs import ScriptedEnv
    from fsm_rollout.tokens.chat import DUMMY_MESSAGES

    headers = {"Content-Type": "application/json"}
    dummy = list(DUMMY_MESSAGES)

    async def one(session: Any, index: int) -> int:
        async with session.post(
            url + RENDER_PATH,
            data=json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}]}),
            headers=headers,
        ) as r:
            rendered = json.loads(await r.read())
        tokens = list(rendered["token_ids"])
        prompt_length = len(tokens)
        loss_mask: list[int] = []
        logprobs: list[float] = []
        env = ScriptedEnv()
        env.reset()
        turns = 0
        for turn in range(SCALE_TURNS):
            params = dict(rendered["sampling_params"] or {})
            params.update(
                max_tokens=SAMPLING["max_new_tokens"] - len(loss_mask),
                temperature=1.0,
                top_p=1.0,
                logprobs=0,
                skip_special_tokens=False,
            )
            body = {**rendered, "token_ids": tokens, "sampling_params": params, "request_id": f"b{index}-{turn}"}
            async with session.post(url + GENERATE_PATH, data=json.dumps(body), headers=headers) as r:
                answer = json.loads(await r.read())
            choice = answer["choices"][0]
            ids = choice["token_ids"]
            tokens += ids
            loss_mask += [1] * len(ids)
            logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
            turns += 1
            observation, done, _ = env.step(tokenizer.decode(ids, skip_special_tokens=False))
            if done or turn + 1 == SCALE_TURNS:
                break
            message = env.format_observation(observation)
            with_obs = tokenizer.apply_chat_template(
                [*dummy, message], tokenize=True, add_generation_prompt=True, return_dict=False
            )
            without = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
            boundary = list(with_obs[len(without) :])
            tokens += boundary
            loss_mask += [0] * len(boundary)
            logprobs += [0.0] * len(boundary)
        tokenizer.decode(tokens[prompt_length:], skip_special_tokens=False)
        env.close()
        return turns

    async def main() -> dict[str, float]:
        client = AiohttpTransport(url)
        session = client.session()  # the same pooled aiohttp session the library uses
        wall, cpu = time.perf_counter(), time.process_time()
        turns = sum(await asyncio.gather(*(one(session, i) for i in range(samples))))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await client.close()
        return {
            "samples": float(samples),
            "turns": float(turns),
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_us_per_turn": cpu / turns * 1e6,
        }

    return asyncio.run(main())


def measure_json_costs(url: str, repeats: int = 2_000) -> dict[str, float]:
    """CPU of one turn's JSON work, done the client's way: encode a generate request, decode and parse its answer
    (the render's share is one encode/decode per sample, a third of a turn's here)."""
    import aiohttp

    from fsm_rollout.config import build_inference_sampling_params
    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH, parse_generate_response, parse_render_response

    render_payload = {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}]}

    async def fetch() -> tuple[bytes, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + RENDER_PATH, json=render_payload) as response:
                render = await response.read()
            generate_payload = {
                "model": "fake-model",
                "token_ids": orjson_loads(render)["token_ids"],
                "request_id": "bench",
                "sampling_params": {"max_tokens": 256, "logprobs": 1},
            }
            async with session.post(url + GENERATE_PATH, json=generate_payload) as response:
                generate = await response.read()
        return render, generate

    raw_render, raw_generate = asyncio.run(fetch())
    rendered = parse_render_response(orjson_loads(raw_render), "fake-model")
    answer = parse_generate_response(orjson_loads(raw_generate), "bench").token_ids
    tokens = [*rendered.token_ids, *answer, *answer[:12]]  # the middle turn's context: prompt, a turn, an observation
    body = {
        **rendered.generate_body,
        "token_ids": tokens,
        "sampling_params": build_inference_sampling_params(SAMPLING),
        "request_id": "bench-turn1",
    }
    start = time.process_time()
    for _ in range(repeats):
        orjson_dumps(body)
    encode_us = (time.process_time() - start) / repeats * 1e6
    start = time.process_time()
    for _ in range(repeats):
        parse_generate_response(orjson_loads(raw_generate), "bench-turn1")
    decode_us = (time.process_time() - start) / repeats * 1e6
    start = time.process_time()
    for _ in range(repeats):
        orjson_dumps(render_payload)
        parse_render_response(orjson_loads(raw_render), "fake-model")
    render_us = (time.process_time() - start) / repeats * 1e6
    return {
        "encode_us": encode_us,
        "decode_and_parse_us": decode_us,
        "per_turn_us": encode_us + decode_us + render_us / SCALE_TURNS,
    }


def replay_rate(url: str, tokenizer: Any, samples: int, settings: Settings) -> dict[str, float]:
    """Record ``samples`` rollouts (trace and tape), then re-execute them offline with :func:`replay`."""
    from fsm_rollout.recording import get_tape_writer, tape_path_for
    from fsm_rollout.replay import replay
    from fsm_rollout.trace import get_tracer

    with tempfile.TemporaryDirectory() as tmp:
        trace = str(Path(tmp) / "run.jsonl")
        run_rollouts(url, tokenizer, samples, settings, trace=trace, record=True)
        get_tracer(trace).close()
        get_tape_writer(tape_path_for(trace)).close()

        report = replay(trace, tokenizer=tokenizer)
    if not report.identical or report.turns_executed == 0:
        raise RuntimeError(f"bench: replay of the recorded batch did not reproduce it: {report.counts()}")
    return {
        "samples": float(len(report.samples)),
        "turns_executed": float(report.turns_executed),
        "seconds": report.seconds,
        "turns_per_s": report.turns_executed / report.seconds,
    }
