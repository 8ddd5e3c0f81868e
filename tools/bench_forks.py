"""The history policies' costs: ``python -m tools.bench_forks [--samples N] [--repeats N]``
(from a checkout).

Prints three figures of each policy:

* renders per observation (append never re-renders; fork renders the conversation once per observation) and client
  CPU per turn, for three-turn rollouts all in flight at once against the canned loopback server (a child process,
  so its CPU is not the client's; it renders the fork policy's conversations through the chat template);
* forks per rollout on a chat template that strips the thinking of earlier turns, against the fake vLLM server
  (its ``/render`` applies the template it serves) with turns that think: one per user observation under fork,
  none with a template that keeps the thinking, and none under append (whose probe refuses the stripping one).

CPU figures are the median of ``--repeats`` runs of each policy, interleaved; they vary from run to run on a shared
machine, and nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from fsm_rollout.cli.bench.params import PROMPT, SAMPLING, SCALE_TURNS

EOS = "<|im_end|>"
THINKING_TURN = f"<think>\nThe angles of a triangle add up to 180.\n</think>\n\nx = 70.{EOS}"


def canned_run(url: str, tokenizer: Any, policy: str, samples: int) -> dict[str, float]:
    """``samples`` three-turn rollouts under ``policy`` against the canned server: renders and CPU per turn."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample
    from fsm_rollout.testing.envs import ScriptedEnvFactory

    config = RolloutConfig(engine_url=url, model="fake-model", max_turns=SCALE_TURNS, history_policy=policy)

    async def main() -> dict[str, float]:
        client = VLLMClient.from_config(config)
        renders = 0
        render_once = client.render

        async def counted(payload: dict[str, Any], **kwargs: Any) -> Any:
            nonlocal renders
            renders += 1
            return await render_once(payload, **kwargs)

        client.render = counted  # type: ignore[method-assign, assignment]
        factory = ScriptedEnvFactory()
        rollouts = [
            Rollout(
                Sample(prompt=PROMPT, index=index),
                config=config,
                sampling_params=SAMPLING,
                client=client,
                tokenizer=tokenizer,
                env_factory=factory,
            )
            for index in range(samples)
        ]
        cpu = time.process_time()
        await asyncio.gather(*(rollout.run() for rollout in rollouts))
        cpu = time.process_time() - cpu
        await client.close()
        turns = sum(rollout.turn_index + 1 for rollout in rollouts)
        observations = sum(rollout.turn_index for rollout in rollouts)
        forks = sum(len(rollout.sample.branches) for rollout in rollouts)
        return {
            "renders_per_observation": (renders - samples) / max(observations, 1),
            "cpu_us_per_turn": cpu / turns * 1e6,
            "forks_per_rollout": forks / samples,
        }

    return asyncio.run(main())


def stripping_run(chat_template: str, policy: str, samples: int) -> float:
    """Forks per rollout of ``samples`` three-turn rollouts whose every turn thinks, under ``chat_template``."""
    from fsm_rollout.config import RolloutConfig
    from fsm_rollout.engine.client import VLLMClient
    from fsm_rollout.rollout import Rollout
    from fsm_rollout.sample import Sample
    from fsm_rollout.testing.envs import ScriptedEnvFactory
    from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
    from fsm_rollout.testing.templates import qwen_tokenizer_with_template

    tokenizer = qwen_tokenizer_with_template(chat_template)

    async def main() -> float:
        async with FakeVLLMServer(tokenizer) as server, VLLMClient(server.url) as client:
            server.script([ScriptedTurn(text=THINKING_TURN)] * (SCALE_TURNS * samples))
            config = RolloutConfig(
                engine_url=server.url, model=server.model, max_turns=SCALE_TURNS, history_policy=policy
            )
            forks = 0
            for index in range(samples):
                rollout = Rollout(
                    Sample(prompt=PROMPT, index=index),
                    config=config,
                    sampling_params=SAMPLING,
                    client=client,
                    tokenizer=tokenizer,
                    env_factory=ScriptedEnvFactory(),
                )
                forks += len((await rollout.run()).branches)
            return forks / samples

    return asyncio.run(main())


def run(samples: int, repeats: int) -> dict[str, dict[str, float]]:
    """Every figure, by policy."""
    from fsm_rollout.cli.bench.server import Server
    from fsm_rollout.testing.templates import MINIMAL_CHATML_TEMPLATE, THINK_STRIPPING_CHAT_TEMPLATE
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    server = Server(0.0)
    try:
        url = server.url()
        runs: dict[str, list[dict[str, float]]] = {"append": [], "fork": []}
        for _ in range(repeats):
            for policy, results in runs.items():
                results.append(canned_run(url, tokenizer, policy, samples))
    finally:
        server.stop()
    figures: dict[str, dict[str, float]] = {}
    for policy, results in runs.items():
        figures[policy] = {
            "renders_per_observation": results[0]["renders_per_observation"],
            "cpu_us_per_turn": statistics.median(result["cpu_us_per_turn"] for result in results),
            "forks_per_rollout_canned": results[0]["forks_per_rollout"],
        }
    figures["fork"]["forks_per_rollout_stripping"] = stripping_run(THINK_STRIPPING_CHAT_TEMPLATE, "fork", 8)
    figures["fork"]["forks_per_rollout_keeping"] = stripping_run(MINIMAL_CHATML_TEMPLATE, "fork", 8)
    figures["append"]["forks_per_rollout_keeping"] = stripping_run(MINIMAL_CHATML_TEMPLATE, "append", 8)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_forks", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200, metavar="N", help="rollouts in flight per run")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="runs of each policy (median CPU)")
    args = parser.parse_args(argv)
    figures = run(args.samples, args.repeats)
    names = sorted({name for values in figures.values() for name in values})
    print(f"{'figure':<32}" + "".join(f"{policy:>14}" for policy in figures))
    for name in names:
        cells = "".join(
            f"{figures[policy][name]:>14.2f}" if name in figures[policy] else f"{'-':>14}" for policy in figures
        )
        print(f"{name:<32}{cells}")
    fork, append = figures["fork"]["cpu_us_per_turn"], figures["append"]["cpu_us_per_turn"]
    print(f"client CPU per turn, fork over append: {fork / append:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
