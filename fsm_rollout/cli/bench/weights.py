"""The ``weight-update`` workload: a weight update with every sample's generate request in flight, done today's
way (``runner.abort``) and with suspend/resume, side by side against the canned server's hold mode.

Each run is one batch through a :class:`~fsm_rollout.runtime.runner.RolloutRunner`: the server holds every first-turn
request, having produced the first ``partial`` tokens of the canned answer, and the bench acts once it holds them
all. With suspend/resume the server holds the continuation requests too until all have arrived (the engine is still
producing the rest when the bench measures), then finishes them. Tokens thrown away are the tokens the server
produced that the final samples do not hold as produced: its count, minus the generated tokens of the samples whose
every generated token, logprob and weight version is what the server sent.

Beside them, interleaved with the suspend/resume runs, the bare engine client does the same exchanges without
rollouts (``samples`` generate calls held, one abort call, then ``samples`` continuation calls at once): what the
HTTP exchanges alone cost the client, under the same load.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fsm_rollout.cli.bench.params import PROMPT, SAMPLING, SCALE_TURNS, Settings
from fsm_rollout.cli.bench.server import HOLD_PATH, STATS_PATH, WAIT_PATH
from fsm_rollout.hooks import RolloutHooks

T = TypeVar("T")

OLD_VERSION, NEW_VERSION = "1", "2"
"""The weight versions before and after the update."""
WAIT_LIMIT_S = 120.0
"""How long the bench waits for the server to hold or see the requests it expects before it gives up."""
TIMINGS = (
    "suspend_ms",
    "suspend_cpu_ms",
    "suspend_server_cpu_ms",
    "all_suspended_ms",
    "resume_returned_ms",
    "resume_to_first_resent_ms",
    "resume_to_all_resent_ms",
    "resume_cpu_ms",
    "resume_server_cpu_ms",
)
"""The suspend/resume figures that vary from run to run: each is the median over the runs."""
SPREAD = ("suspend_ms", "resume_to_all_resent_ms")
"""The timings with goals, whose least and greatest over the runs are given beside them."""


class _Control:
    """The bench's side of the server's control paths, on a session of its own (not the runner's pool)."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self._url = url
        self._session = aiohttp.ClientSession()

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._session.post(self._url + path, json=body) as response:
            response.raise_for_status()
            answer: dict[str, Any] = await response.json()
        return answer

    async def close(self) -> None:
        await self._session.close()


class _Suspensions(RolloutHooks):
    """Counts the rollouts that reached ``suspended``; :meth:`wait` returns once ``count`` of them have."""

    def __init__(self) -> None:
        self.count = 0
        self._target = 0
        self._reached = asyncio.Event()

    def transition(self, rollout: Any, trigger: str, src: str, dwell_ms: float, fields: Any) -> None:
        if trigger == "suspend":
            self.count += 1
            if self.count == self._target:
                self._reached.set()

    async def wait(self, count: int) -> None:
        self._target = count
        if self.count < count:
            await self._reached.wait()


async def _unless_ended(call: Awaitable[T], batch: asyncio.Future[Any], what: str) -> T:
    """``call``'s result; an error instead when the batch ends first or nothing comes within the limit (the
    server would otherwise be waited on forever)."""
    waiting = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({waiting, batch}, timeout=WAIT_LIMIT_S, return_when=asyncio.FIRST_COMPLETED)
    if waiting not in done:
        waiting.cancel()
        ended = "the batch ended" if batch in done else f"nothing came in {WAIT_LIMIT_S:g} s"
        raise RuntimeError(f"bench: waiting for {what}, {ended}")
    return waiting.result()


def _generated(sample: Any) -> tuple[list[int], list[float]]:
    """The sample's generated tokens (loss mask 1) and their logprobs, in order."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    kept = [index for index, mask in enumerate(sample.loss_mask or []) if mask]
    return [response[i] for i in kept], [sample.rollout_log_probs[i] for i in kept]


def _as_produced(sample: Any, hold: dict[str, Any]) -> bool:
    """Whether a sample holds exactly what the server produced for it: every turn the canned answer with its
    logprobs, the first turn's first ``partial`` tokens made with the old weights and the rest with the new."""
    answer, logprobs, partial = hold["answer_token_ids"], hold["answer_logprobs"], hold["partial_tokens"]
    tokens, token_logprobs = _generated(sample)
    if tokens != answer * SCALE_TURNS or token_logprobs != logprobs * SCALE_TURNS:
        return False
    spans = sample.metadata.get("weight_version_spans") or []
    return (
        len(spans) >= 2
        and spans[0] == {"version": OLD_VERSION, "start": 0, "end": partial}
        and spans[1]["start"] == partial
        and all(span["version"] == NEW_VERSION for span in spans[1:])
    )


def bench_weight_update(
    url: str, tokenizer: Any, settings: Settings, samples: int = 1_000, *, repeats: int = 3, partial: int = 13
) -> dict[str, float]:
    """A weight update with ``samples`` first-turn requests in flight, each having produced ``partial`` tokens:
    ``runner.abort`` (today) once, then ``suspend()``/``resume()`` ``repeats`` times, one batch each, against the
    canned server at ``url``."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.runtime.runner import RolloutRunner
    from fsm_rollout.sample import Sample, Status
    from fsm_rollout.testing.envs import CONTINUE, ScriptedEnvFactory

    # the last turn's step says done, so a sample that runs to its end is completed (not truncated by max_turns)
    steps = [CONTINUE] * (SCALE_TURNS - 1) + [(CONTINUE[0], True)]
    config = RolloutConfig(
        engine_url=url,
        model="fake-model",
        max_turns=SCALE_TURNS,
        loop_slice_ms=settings.loop_slice_ms,
        tune_gc=settings.tune_gc,
    )

    async def suspend_and_resume(
        runner: RolloutRunner,
        control: _Control,
        batch: asyncio.Future[Any],
        suspensions: _Suspensions,
        figures: dict[str, float],
    ) -> None:
        server_cpu = (await control.post(STATS_PATH, {}))["cpu_s"]
        started, cpu = time.perf_counter(), time.process_time()
        await runner.suspend()
        figures["suspend_ms"] = (time.perf_counter() - started) * 1000.0
        figures["suspend_cpu_ms"] = (time.process_time() - cpu) * 1000.0
        figures["in_flight_after_suspend"] = float(runner.suspender.requests_in_flight)
        server = await control.post(STATS_PATH, {})
        figures["suspend_server_cpu_ms"] = (server["cpu_s"] - server_cpu) * 1000.0
        figures["abort_calls"] = float(server["abort_calls"])
        # Rollouts may still be filing their abort answers as partial turns when nothing is in flight any more: a
        # weight push would overlap that. The resume is timed once all are suspended, so it holds none of it.
        await _unless_ended(suspensions.wait(samples), batch, f"{samples} suspended rollouts")
        figures["all_suspended_ms"] = (time.perf_counter() - started) * 1000.0
        figures["abort_calls_client"] = float(runner.last_suspension.abort_calls)
        figures["requests_in_flight_at_suspend"] = float(runner.last_suspension.requests_in_flight)
        await runner.suspender.set_weight_version(NEW_VERSION)  # the trainer's weight push would come before this
        server_cpu = (await control.post(STATS_PATH, {}))["cpu_s"]
        started, cpu = time.monotonic(), time.process_time()  # monotonic: the server's clock (see its Hold)
        await runner.resume()
        figures["resume_returned_ms"] = (time.monotonic() - started) * 1000.0
        resent = await _unless_ended(
            control.post(WAIT_PATH, {"continued": samples}), batch, f"{samples} continuation requests"
        )
        figures["resume_cpu_ms"] = (time.process_time() - cpu) * 1000.0
        figures["resume_to_first_resent_ms"] = (resent["continued_first_at"] - started) * 1000.0
        figures["resume_to_all_resent_ms"] = (resent["continued_last_at"] - started) * 1000.0
        figures["resume_server_cpu_ms"] = (resent["cpu_s"] - server_cpu) * 1000.0

    async def held_batch(control: _Control, way: str) -> dict[str, float]:
        hold = await control.post(HOLD_PATH, {"mode": "hold", "partial_tokens": partial, "weight_version": OLD_VERSION})
        records = [Sample(prompt=PROMPT, index=i) for i in range(samples)]
        figures: dict[str, float] = {}
        suspensions = _Suspensions()
        async with RolloutRunner(
            config,
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(steps=steps),
            hooks=suspensions,
        ) as runner:
            batch = asyncio.ensure_future(runner.run_batch(records, concurrency=samples))
            held = await _unless_ended(control.post(WAIT_PATH, {"held": samples}), batch, f"{samples} held requests")
            if way == "abort":
                started = time.perf_counter()
                await runner.abort("weight_update")
                figures["abort_ms"] = (time.perf_counter() - started) * 1000.0
                figures["abort_calls"] = float((await control.post(STATS_PATH, {}))["abort_calls"])
            else:
                await suspend_and_resume(runner, control, batch, suspensions, figures)
            await control.post(HOLD_PATH, {"mode": "release"})  # the engine finishes what it still holds
            finished = await batch
        produced = (await control.post(HOLD_PATH, {"mode": "off"}))["tokens_produced"]
        kept = sum(len(_generated(sample)[0]) for sample in finished if _as_produced(sample, hold))
        completed = sum(sample.status == Status.COMPLETED for sample in finished)
        figures.update(
            held_requests=float(held["held"]),
            tokens_produced=float(produced),
            tokens_kept=float(kept),
            tokens_thrown_away=float(produced - kept),
            samples_completed=float(completed),
            samples_lost=float(samples - completed),
        )
        if way != "abort":  # today's samples all end aborted, holding none of what was produced for them
            figures["samples_not_as_produced"] = float(sum(not _as_produced(sample, hold) for sample in finished))
        return figures

    async def bare_client(control: _Control) -> dict[str, float]:
        """The same exchanges without rollouts: the engine client alone, all ``samples`` calls at once."""
        from fsm_rollout.engine.client import VLLMClient

        hold = await control.post(HOLD_PATH, {"mode": "hold", "partial_tokens": partial, "weight_version": OLD_VERSION})
        prompt, answer = hold["prompt_token_ids"], hold["answer_token_ids"]
        client = VLLMClient.from_config(config)

        def generate(token_ids: list[int], request_id: str) -> asyncio.Future[Any]:
            body = {
                "model": config.model,
                "token_ids": token_ids,
                "request_id": request_id,
                "sampling_params": {"max_tokens": 64, "logprobs": 0},
            }
            return asyncio.ensure_future(client.generate(body, request_id=request_id))

        try:
            ids = [f"bare-{i}" for i in range(samples)]
            first = asyncio.gather(*(generate(prompt, request_id) for request_id in ids))
            await _unless_ended(control.post(WAIT_PATH, {"held": samples}), first, f"{samples} held requests")
            started, cpu = time.perf_counter(), time.process_time()
            await client.abort(ids)
            await first
            figures = {
                "abort_to_all_answered_ms": (time.perf_counter() - started) * 1000.0,
                "abort_to_all_answered_cpu_ms": (time.process_time() - cpu) * 1000.0,
            }
            started, cpu = time.monotonic(), time.process_time()
            again = asyncio.gather(*(generate(prompt + answer[:partial], f"{request_id}-part1") for request_id in ids))
            resent = await _unless_ended(
                control.post(WAIT_PATH, {"continued": samples}), again, f"{samples} continuation requests"
            )
            figures["send_to_all_arrived_ms"] = (resent["continued_last_at"] - started) * 1000.0
            figures["send_to_all_arrived_cpu_ms"] = (time.process_time() - cpu) * 1000.0
            await control.post(HOLD_PATH, {"mode": "off"})
            await again
        finally:
            await client.close()
        return figures

    async def main() -> tuple[dict[str, float], list[dict[str, float]], list[dict[str, float]]]:
        control = _Control(url)
        try:
            today = await held_batch(control, "abort")
            runs, bare = [], []
            for _ in range(repeats):  # interleaved: both see the same load on the machine
                runs.append(await held_batch(control, "suspend"))
                bare.append(await bare_client(control))
        finally:
            await control.close()
        return today, runs, bare

    today, runs, bare = asyncio.run(main())
    reference = {name: statistics.median(run[name] for run in bare) for name in bare[0]}
    suspended: dict[str, float] = {}
    for name in runs[0]:
        values = [run[name] for run in runs]
        if name in TIMINGS:
            suspended[name] = statistics.median(values)
            if name in SPREAD:
                suspended[f"{name}_least"], suspended[f"{name}_greatest"] = min(values), max(values)
        else:  # counts: the worst run's (the fewest completed samples, the most of anything else)
            suspended[name] = min(values) if name == "samples_completed" else max(values)
    return {
        "samples": float(samples),
        "partial_tokens_per_request": float(partial),
        "suspend_resume_runs": float(repeats),
        **{f"today_{name}": value for name, value in today.items()},
        **{f"suspend_resume_{name}": value for name, value in suspended.items()},
        **{f"bare_client_{name}": value for name, value in reference.items()},
    }
