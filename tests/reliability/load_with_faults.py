"""Load with faults: N three-turn samples through RolloutRunner against the fake vLLM server, with ~5 % transient
server faults (502/503/429 answers and dropped connections, each within the retry policy) and ~1 % environment
exceptions. Prints: every sample terminal, none lost, every completed sample identical (tokens, loss mask,
logprobs) to the fault-free run of the same scenario, and the wall time.

    python tests/reliability/load_with_faults.py [--samples 10000] [--concurrency 64] [--seed 0]

The scenarios: sample ``i`` uses variant ``i % VARIANTS`` (its prompt and three scripted answers); the
environment answers twice with an observation and is done at the third step (``completed``, ``env_done``). The
fault-free reference of each variant is run first, on a fresh server, with the same runner settings.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import HookedEnvFactory

from fsm_rollout import RetryPolicy, RolloutConfig, Sample
from fsm_rollout.machine import lifecycle
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.envs import ScriptedEnv
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn

VARIANTS = 8
TURNS = 3
SERVER_FAULT_RATE = 0.05
ENV_FAULT_RATE = 0.01
SAMPLING = {"max_new_tokens": 96, "temperature": 1.0, "top_p": 1.0}
RETRY = RetryPolicy(max_attempts=6, base_delay_s=0.001, max_delay_s=0.005)
ENV_STEPS = [("Not yet, continue.", False), ("Closer. One more try.", False), ("correct", True)]


def prompt(variant: int) -> str:
    return f"Question {variant}: what is {variant} * 7?"


def answers(variant: int) -> list[str]:
    return [f"Let me think about {variant} times seven.", f"It is {variant * 7 - 1}?", f"No: {variant * 7}."]


class EnvFault(RuntimeError):
    """The injected environment exception."""


@dataclass
class Injector:
    """Decides, per sample and request, which faults to inject (deterministic for a seed)."""

    server: FakeVLLMServer | None
    seed: int
    server_faults: Counter[str] = field(default_factory=Counter)
    env_faults: int = 0

    def factory(self) -> HookedEnvFactory:
        return HookedEnvFactory(steps=ENV_STEPS, hook=self.hook if self.server is not None else None)

    def _server_fault(self, rng: random.Random, path: str) -> None:
        assert self.server is not None
        if rng.random() >= SERVER_FAULT_RATE:
            return
        kind = rng.choice(["502", "503", "429", "reset"])
        if kind == "reset":
            self.server.fail_next(path, reset=True)
        else:
            self.server.fail_next(path, status=int(kind))
        self.server_faults[f"{kind}@{path.rsplit('/', 1)[-1]}"] += 1

    def hook(self, method: str, env: ScriptedEnv) -> None:
        index = getattr(env, "sample_index", None)
        if index is None:
            return
        rng = random.Random(f"{self.seed}:{index}:{method}")
        name, _, count = method.partition(":")
        if name == "reset":
            self._server_fault(rng, RENDER_PATH)
            self._server_fault(rng, GENERATE_PATH)
            if random.Random(f"{self.seed}:{index}:env").random() < ENV_FAULT_RATE:
                env.raise_in = {**env.raise_in, "step": EnvFault(f"sample {index}: the checker crashed")}
                self.env_faults += 1
        elif name == "step" and int(count) < TURNS:
            self._server_fault(rng, GENERATE_PATH)


class IndexedFactory:
    """Tags each environment with its sample's index (so the injector's choices depend on the sample only)."""

    def __init__(self, inner: HookedEnvFactory) -> None:
        self.inner = inner

    def __call__(self, *, sample: Any, args: Any) -> ScriptedEnv:
        env = self.inner(sample=sample, args=args)
        env.sample_index = sample.index  # type: ignore[attr-defined]
        return env


def training_arrays(sample: Sample) -> tuple[list[int], list[int], list[float]]:
    return list(sample.tokens), list(sample.loss_mask or []), list(sample.rollout_log_probs or [])


async def run_samples(
    tokenizer: Any, count: int, *, faults: bool, seed: int, concurrency: int, indices: list[int] | None = None
) -> tuple[list[Sample], Injector, float]:
    async with FakeVLLMServer(tokenizer, model="fake-model") as server:
        chosen = indices if indices is not None else list(range(count))
        for i in chosen:
            server.script([ScriptedTurn(text=text) for text in answers(i % VARIANTS)], session=f"s{i}")
        injector = Injector(server if faults else None, seed)
        config = RolloutConfig(
            engine_url=server.url,
            model="fake-model",
            max_turns=TURNS,
            retry=RETRY,
            router_policy="consistent_hash",
            check_invariants=True,
        )
        samples = [Sample(prompt=prompt(i % VARIANTS), index=i, session_id=f"s{i}") for i in chosen]
        started = time.perf_counter()
        async with RolloutRunner(
            config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=IndexedFactory(injector.factory())
        ) as runner:
            done = await runner.run_batch(samples, concurrency=concurrency)
        return done, injector, time.perf_counter() - started


@dataclass
class Report:
    samples: int
    terminal: int
    lost: int
    statuses: dict[str, int]
    reasons: dict[str, int]
    completed: int
    identical: int
    mismatched: list[int]
    failed_unexpected: list[int]
    server_faults: dict[str, int]
    env_faults: int
    wall_s: float
    reference_wall_s: float

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.terminal == self.samples
            and self.identical == self.completed
            and not self.mismatched
            and not self.failed_unexpected
            and self.completed + self.env_faults == self.samples
        )

    def lines(self) -> list[str]:
        faulted = sum(self.server_faults.values())
        return [
            f"samples                 {self.samples}",
            f"terminal                {self.terminal}  (lost: {self.lost})",
            f"statuses                {self.statuses}",
            f"reasons                 {self.reasons}",
            f"server faults injected  {faulted} ({faulted / max(1, self.samples * (TURNS + 1)):.1%} of requests): "
            f"{dict(sorted(self.server_faults.items()))}",
            f"env exceptions injected {self.env_faults} ({self.env_faults / max(1, self.samples):.1%} of samples)",
            f"completed               {self.completed}; identical to the fault-free run: {self.identical}",
            f"mismatched              {self.mismatched[:10]}",
            f"failed, not by an injected env exception: {self.failed_unexpected[:10]}",
            f"wall time               {self.wall_s:.2f} s ({self.samples / self.wall_s:.0f} samples/s); "
            f"fault-free references {self.reference_wall_s:.2f} s",
            f"RESULT                  {'OK' if self.ok else 'FAILED'}",
        ]


async def measure(tokenizer: Any, count: int, *, seed: int = 0, concurrency: int = 64) -> Report:
    references, _, reference_wall = await run_samples(
        tokenizer, VARIANTS, faults=False, seed=seed, concurrency=concurrency, indices=list(range(VARIANTS))
    )
    expected = {sample.index % VARIANTS: training_arrays(sample) for sample in references}
    assert all(sample.status.value == "completed" for sample in references), [s.status for s in references]
    done, injector, wall = await run_samples(tokenizer, count, faults=True, seed=seed, concurrency=concurrency)
    seen = Counter(sample.index for sample in done)
    lost = count - sum(1 for i in range(count) if seen[i] == 1)
    terminal = sum(1 for sample in done if sample.status.value in lifecycle.TERMINAL)
    completed = [sample for sample in done if sample.status.value == "completed"]
    mismatched = [s.index for s in completed if training_arrays(s) != expected[s.index % VARIANTS]]
    failed_unexpected = [
        s.index
        for s in done
        if s.status.value != "completed" and (s.metadata.get("rollout_error") or {}).get("type") != "EnvFault"
    ]
    return Report(
        samples=count,
        terminal=terminal,
        lost=lost,
        statuses=dict(Counter(sample.status.value for sample in done)),
        reasons=dict(Counter(sample.metadata.get("rollout_reason") for sample in done)),
        completed=len(completed),
        identical=len(completed) - len(mismatched),
        mismatched=mismatched,
        failed_unexpected=failed_unexpected,
        server_faults=dict(injector.server_faults),
        env_faults=injector.env_faults,
        wall_s=wall,
        reference_wall_s=reference_wall,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    report = asyncio.run(measure(load_qwen_tokenizer(), args.samples, seed=args.seed, concurrency=args.concurrency))
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
