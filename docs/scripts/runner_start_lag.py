"""How long ``RolloutRunner.__aenter__`` keeps the event loop from running other tasks.

A ticker task asks to wake every 5 ms while the runner enters (the engine is the fake vLLM server, in this process,
whose model list names the real Qwen2 tokenizer directory, as the embedded engine's does); each wake-up's lateness
is recorded and printed as p50 / p99 / max. Run it in a fresh process (the first tokenizer load is the measured
one)::

    PYTHONPATH=. python docs/scripts/runner_start_lag.py [--runs N]

``--profile`` also lists the calls into C that held the loop's thread longest (the tokenizer's Rust load, JSON
parses, ...), to find what to move out of the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

PERIOD_S = 0.005


async def enter_once() -> list[float]:
    """The lateness (seconds) of every tick of a 5 ms ticker while a runner enters (and nothing else runs)."""
    from fsm_rollout import RolloutConfig
    from fsm_rollout.runtime.runner import RolloutRunner
    from fsm_rollout.testing.envs import ScriptedEnvFactory
    from fsm_rollout.testing.fake_vllm import FakeVLLMServer
    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        due = time.perf_counter() + PERIOD_S
        while not stop.is_set():
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            now = time.perf_counter()
            lateness.append(now - due)
            due = max(due, now) + PERIOD_S

    async with FakeVLLMServer(None, model="served-name") as server:
        server.model_root = str(qwen_tokenizer_dir())
        config = RolloutConfig(engine_url=server.url, model="served-name", max_turns=1)
        runner = RolloutRunner(
            config, sampling_params={"max_new_tokens": 8, "temperature": 1.0}, env_factory=ScriptedEnvFactory()
        )
        beating = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        lateness.clear()
        await runner.__aenter__()
        stop.set()
        await beating
        await runner.__aexit__(None, None, None)
    return lateness


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="fresh processes to measure (default 1)")
    parser.add_argument("--profile", action="store_true", help="list the longest C calls of the start's threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.profile:
            install_profiler()
        lateness = asyncio.run(enter_once())
        ms = [value * 1000 for value in lateness]
        print(f"ticks {len(ms):4d}  p50 {statistics.median(ms):7.1f} ms  p99 {percentile(ms, 0.99):7.1f} ms  "
              f"max {max(ms):7.1f} ms  load {os.getloadavg()[0]:.1f}")  # fmt: skip
        if args.profile:
            report_profile()
        return 0
    import subprocess

    for _ in range(args.runs):
        command = [sys.executable, __file__, "--child", *(["--profile"] if args.profile else [])]
        subprocess.run(command, check=True)
    return 0


_LONG: list[tuple[float, str, str]] = []


def install_profiler() -> None:
    """Note every call into C that ran no Python code inside and took over 20 ms: those hold the GIL (or block)."""
    import threading

    started: dict[tuple[int, int], tuple[float, int]] = {}
    events: dict[int, int] = {}

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        thread = threading.get_ident()
        events[thread] = events.get(thread, 0) + 1
        if event == "c_call":
            started[id(arg), id(frame)] = (time.perf_counter(), events[thread])
        elif event in ("c_return", "c_exception"):
            begun = started.pop((id(arg), id(frame)), None)
            if begun is not None and begun[1] == events[thread] - 1 and time.perf_counter() - begun[0] > 0.02:
                where = f"{frame.f_code.co_filename.split('site-packages/')[-1]}:{frame.f_lineno}"
                _LONG.append((time.perf_counter() - begun[0], getattr(arg, "__qualname__", repr(arg)), where))

    sys.setprofile(profile)
    threading.setprofile(profile)


def report_profile() -> None:
    for seconds, name, where in sorted(_LONG, reverse=True)[:15]:
        print(f"  {seconds * 1000:7.1f} ms  {name}  {where}")


if __name__ == "__main__":
    raise SystemExit(main())
