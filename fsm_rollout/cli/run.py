"""``fsm-rollout run``: the main job — roll a dataset out against vLLM (or the embedded engine) and write results.

What the command does, its outputs and exit codes are in :data:`EPILOG` (printed by ``--help`` and in the README).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fsm_rollout.cli.common import add_process_settings
from fsm_rollout.cli.engine_options import add_engine_options, add_history_options
from fsm_rollout.cli.group_options import add_group_options
from fsm_rollout.cli.preflight import (
    PreflightError,
    api_key,
    option_problem,
    redacted,
)
from fsm_rollout.cli.report import default_output as report_path_for
from fsm_rollout.cli.run_engine import engine_for
from fsm_rollout.cli.run_report import (
    error_lines,
    groups_line,
    next_lines,
    nothing_generated,
    reward_lines,
    summary,
    write_results,
)
from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import RolloutError
from fsm_rollout.recording import tape_path_for
from fsm_rollout.runtime.runner import MetricsSnapshot, RolloutRunner, group_members
from fsm_rollout.runtime.sampling import SampledBatch
from fsm_rollout.sample import Sample

DEMO_ENV = "fsm_rollout.envs.geo3k"
GEO3K_STOP = ("</tool_call>",)
# the demo's model is right a few percent of the time: groups let a first run show the right-answer path too
DEMO_SAMPLES_PER_PROMPT = 4
EXIT_OK, EXIT_FAILED_SAMPLES, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
With no --engine-url the embedded CPU engine is started in a child process (`fsm-rollout serve` on a free loopback
port, stopped when the run ends; --engine-in-process keeps it in the run's process); with no --data the bundled
demo dataset runs with the built-in Geo3K environment (or, with --env, that environment's own samples: its
demo_samples(), as fsm_rollout.envs.grid has, a verifiers environment's dataset or a gym game's seeded episodes; an
environment without any needs --data), each question as a group of samples (--n-samples-per-prompt); a dataset
of your own (--data) needs the environment that grades it (--env). With --env trl:..., dataset keys other than
prompt, images, label, metadata and tools are the row's columns, which the environment's reset(**row) gets.
--limit N takes the first N prompts. A live progress line shows samples done, per-state occupancy and tokens/s;
the run ends with a summary (status and reason counts, the rewards the environment wrote, turns, tokens,
throughput), the most frequent errors of the failed samples, and the commands that look inside the run (inspect,
diagram, replay) with a sample id it has.

Before a sample runs, the options are checked, then each --engine-url must answer GET /health, and GET /v1/models
fills in what the flags leave out: the served model name when the engine serves one model, and, from
`fsm-rollout serve`, the tokenizer directory and the image merge size (a real vLLM names its model path, used as
the tokenizer, and no merge size). A tokenizer that is neither a local directory nor in the Hugging Face cache is
downloaded only when the hub answers one first request for it; with HF_HUB_OFFLINE set it is an error at once.

Dataset lines are `{"prompt": str | messages, "images": [...], "label": ..., "metadata": {...}, "tools": [...]}`;
a bad line is an error naming its line number (or is skipped and counted with --skip-bad). Results are JSONL,
`Sample.to_dict()` per line in input order, with decoded image features as dtype and shape unless
--include-features (pixel values are megabytes per image); the trace is JSONL too, one line per transition.

Ctrl-C before the samples start (the default model's first build, the engine's start) stops at once, leaves nothing
half-built in the cache, writes nothing and exits 130. Once they run, it aborts the samples in flight, writes what
finished plus the aborted partials (samples that had not started yet are rows with reason not_started), counts
finished, aborted mid-way and never started, and exits 130. The run says which history policy its samples use (and
why, when --history-policy auto chose it).

Exit codes: 0 every sample ended (completed, truncated, or aborted by the server); 1 some sample failed, or not one
token was generated (every sample ended budget_exhausted: the prompts fill the context); 2 nothing was run: bad
input (dataset, options) or no usable engine or tokenizer (nothing answers /health, the API key is missing or
refused, no tokenizer found); 130 interrupted."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout run``."""
    parser.epilog = EPILOG
    data = parser.add_argument_group("data and outputs")
    data.add_argument("--data", type=Path, metavar="FILE", help="JSONL dataset (default: the bundled Geo3K-style demo)")
    data.add_argument("--out", type=Path, default=Path("results.jsonl"), metavar="FILE", help="results JSONL")
    data.add_argument("--trace", type=Path, metavar="FILE", help="write the transition trace (JSONL) here")
    data.add_argument(
        "--record",
        action="store_true",
        help="also record the I/O tape beside the trace (X.jsonl -> X.tape.jsonl) so that "
        "`fsm-rollout replay` can re-execute the run offline (needs --trace)",
    )
    data.add_argument(
        "--report",
        nargs="?",
        const=True,
        type=Path,
        metavar="FILE",
        help="also write the run as one web page (`fsm-rollout report`; FILE default: beside the trace, "
        "X.jsonl -> X.html; needs --trace)",
    )
    data.add_argument(
        "--include-features",
        action="store_true",
        help="write decoded image features in full (default: dtype and shape only)",
    )
    data.add_argument("--skip-bad", action="store_true", help="skip invalid dataset lines (counted) instead of failing")
    data.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="run only the first N prompts of the dataset (each as --n-samples-per-prompt samples)",
    )
    data.add_argument("--quiet", action="store_true", help="no progress line")
    engine = parser.add_argument_group("engine")
    add_engine_options(
        engine,
        several_urls="sticky consistent hashing",
        api_key="sent as `Authorization: Bearer KEY` on every engine request, never printed or recorded",
    )
    engine.add_argument(
        "--engine-in-process",
        action="store_true",
        help="with no --engine-url, run the embedded engine in this process (default: in a child process of its own, "
        "which is faster: the engine and the rollouts do not share one interpreter lock)",
    )
    engine.add_argument(
        "--no-batching",
        action="store_true",
        help="with no --engine-url, the embedded engine decodes one request at a time, each step a batch of one "
        "(slower; to compare with decoding before batching)",
    )
    engine.add_argument("--router-policy", choices=["consistent_hash"], help="send x-session-id on every request")
    engine.add_argument(
        "--image-merge-size",
        type=int,
        metavar="N",
        help="vision merge size for the image-token check (Qwen-VL: 2; default: the engine's, when it says)",
    )
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument(
        "--env",
        metavar="MODULE|FILE",
        help=f"environment module or .py file, or one through an adapter (verifiers:NAME, skyrl:NAME, gym:ID, "
        f"trl:MODULE:CLASS); required with --data, and needs --data unless it brings samples of its own (default with "
        f"the demo: {DEMO_ENV})",
    )
    rollout.add_argument(
        "--env-args",
        type=_env_args,
        metavar="JSON",
        help="a JSON object for the environment: a skyrl:NAME environment's env_config, a verifiers:NAME "
        "environment's load_environment arguments (vf-eval's -a), a gym:ID environment's make arguments",
    )
    rollout.add_argument("--max-turns", type=int, default=3, metavar="N", help="turns per sample at most")
    rollout.add_argument(
        "--n-samples-per-prompt",
        type=int,
        metavar="N",
        help=f"samples per prompt, rolled out as one group each as GRPO wants them (default: "
        f"{DEMO_SAMPLES_PER_PROMPT} with the demo, else 1)",
    )
    # tight enough that the demo's longer samples run out of it: the first run shows that ending too
    rollout.add_argument("--max-new-tokens", type=int, default=176, metavar="N", help="response budget over all turns")
    rollout.add_argument("--max-context-len", type=int, metavar="N", help="context limit (prompt + response)")
    rollout.add_argument("--concurrency", type=int, default=16, metavar="N", help="samples in flight at once")
    rollout.add_argument(
        "--admission",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="fixed: --concurrency samples in flight; adaptive: generate requests admitted from the engine's load "
        "(GET /metrics), a sample stepping its environment holding no slot",
    )
    add_group_options(rollout)
    rollout.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature")
    rollout.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: top-p")
    rollout.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="S",
        help=f"stop string (repeatable; default with {DEMO_ENV}: {' '.join(GEO3K_STOP)})",
    )
    rollout.add_argument("--seed", type=int, metavar="N", help="sampling seed sent with every request")
    add_history_options(rollout)
    add_process_settings(parser.add_argument_group("process-wide settings"))


def _env_args(text: str) -> dict[str, Any]:
    """``--env-args``: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def _env_factory(args: argparse.Namespace) -> Any:
    """The environment ``--env`` (and ``--env-args``) name, resolved before anything starts: a wrong one is an error
    in a second, not one per sample once the engine runs."""
    from fsm_rollout.envs.adapters.spec import ENV_ARGS_FORMS, factory_from_spec, is_adapter_spec
    from fsm_rollout.envs.protocol import load_env_factory, load_env_module

    target = args.env or DEMO_ENV
    if args.env_args is None:
        return load_env_factory(target)
    if not is_adapter_spec(target):
        raise PreflightError(f"--env-args is for {ENV_ARGS_FORMS}; --env {target} takes none")
    return factory_from_spec(target, load_module=load_env_module, env_args=args.env_args)


def _load_samples(args: argparse.Namespace, env_factory: Any = None) -> tuple[list[Sample], int]:
    from fsm_rollout.envs.adapters.spec import is_adapter_spec, samples_from_spec
    from fsm_rollout.runtime.dataset import load_jsonl

    if args.data is None and args.env is not None and is_adapter_spec(args.env):  # the environment's own dataset
        return samples_from_spec(args.env, env_factory, limit=args.limit), 0
    if args.data is None:
        from fsm_rollout.data.demo import demo_samples
        from fsm_rollout.envs.protocol import load_env_module

        # an environment that brings its own demo prompts (fsm_rollout.envs.grid) runs them; the demo's runs the
        # Geo3K questions; any other needs --data (the Geo3K questions would be graded by the wrong environment)
        own = getattr(load_env_module(args.env), "demo_samples", None) if args.env else None
        if args.env not in (None, DEMO_ENV) and not callable(own):
            raise PreflightError(
                f"--env {args.env} brings no dataset (no demo_samples()): give one with --data FILE (JSONL: prompt, "
                f"label, metadata); the demo questions run with --env {DEMO_ENV}"
            )
        samples, skipped = (own() if callable(own) else demo_samples()), 0
    else:
        # a TRL dataset's own columns ({"prompt": ..., "start": 3}) are the row its environment's reset(**row) gets
        trl = args.env is not None and args.env.startswith("trl:")
        dataset = load_jsonl(args.data, skip_bad=args.skip_bad, columns_to_row=trl)
        samples, skipped = dataset.samples, len(dataset.skipped)
        for bad in dataset.skipped:
            print(f"skipped: {bad}", file=sys.stderr)
    if args.limit is not None:
        samples = samples[: args.limit]
    return samples, skipped


def _groups(samples: Sequence[Sample], args: argparse.Namespace) -> tuple[list[Sample], list[str | None],
                                                                          list[int | None]]:  # fmt: skip
    """Each prompt's group members in order, their trace names and, with ``--seed S``, member ``m``'s seed
    ``S + m`` (a group is reproducible and its members still differ); one sample a prompt stays as it was."""
    from fsm_rollout.envs.adapters.spec import is_adapter_spec

    demo = args.data is None and not (args.env is not None and is_adapter_spec(args.env))
    n = args.n_samples_per_prompt or (DEMO_SAMPLES_PER_PROMPT if demo else 1)
    if n == 1:
        return list(samples), [], []
    members: list[Sample] = []
    names: list[str | None] = []
    for sample in samples:
        copies, ids = group_members(sample, n)
        members += copies
        names += ids
    seeds: list[int | None] = [] if args.seed is None else [args.seed + member for _ in samples for member in range(n)]
    return members, names, seeds


def _progress_line(snapshot: MetricsSnapshot, total: int) -> str:
    states = " ".join(f"{state}={count}" for state, count in sorted(snapshot.occupancy.items()))
    if snapshot.queued:  # waiting for a concurrency slot: not in any state yet
        states = f"{states} queued={snapshot.queued}".strip()
    return (
        f"[{snapshot.samples_done}/{total}] {states or 'idle'} | {snapshot.turns} turns, "
        f"{snapshot.tokens_per_s:.0f} tok/s, {snapshot.elapsed_s:.1f}s"
    )


async def _show_progress(runner: RolloutRunner, total: int, stream: TextIO) -> None:
    interactive = stream.isatty()
    last_print = 0.0
    while True:
        await asyncio.sleep(0.25)
        line = _progress_line(runner.metrics(), total)
        if interactive:
            stream.write("\r\033[K" + line)
            stream.flush()
        elif time.monotonic() - last_print >= 5.0:
            print(line, file=stream, flush=True)
            last_print = time.monotonic()


def build_config(
    args: argparse.Namespace,
    url: str,
    model: str,
    tokenizer_path: str | None,
    merge_size: int | None,
    *,
    api_key: str | None = None,
) -> RolloutConfig:
    """The rollouts' configuration from the options and the engine.

    Pacing and the collector tuning are process-wide, so the library leaves them off by default; the command turns
    both on unless ``--loop-slice-ms 0`` / ``--no-tune-gc`` say otherwise, and passes them explicitly so that its
    behaviour does not follow the library's defaults.
    """
    return RolloutConfig(
        engine_url=url,
        model=model,
        tokenizer_path=tokenizer_path,
        max_turns=args.max_turns,
        rollout_max_context_len=args.max_context_len,
        router_policy=args.router_policy,
        image_merge_size=merge_size,
        env_path=args.env or DEMO_ENV,
        trace=args.trace,
        record=args.record,
        loop_slice_ms=args.loop_slice_ms or None,
        tune_gc=not args.no_tune_gc,
        api_key=api_key,
        trust_remote_code=args.trust_remote_code,
        history_policy=args.history_policy,
        apply_chat_template_kwargs=args.chat_template_kwargs,
        admission=args.admission,
        max_staleness=args.max_staleness,
    )


async def _run(args: argparse.Namespace) -> int:
    env_factory = _env_factory(args)  # a bad --env fails before any engine starts
    prompts, skipped = _load_samples(args, env_factory)
    samples, sample_ids, seeds = _groups(prompts, args)
    key = api_key(args)
    sampling: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "no_stop_trim": True,
    }
    if args.stop:
        sampling["stop"] = list(args.stop)
    elif (args.env or DEMO_ENV) == DEMO_ENV:  # the tool call ends the turn; the masked EOS closes it
        sampling["stop"] = list(GEO3K_STOP)
    interrupted = asyncio.Event()
    rolling = False
    starting = asyncio.current_task()

    def on_signal() -> None:
        interrupted.set()
        if not rolling and starting is not None:  # the model build or the engine start: stop them, run nothing
            starting.cancel()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    if not samples:  # --limit 0, or an environment whose own dataset is empty: no engine for nothing
        print("error: no prompt to run (--limit 0 or an empty dataset): nothing was started", file=sys.stderr)
        return EXIT_BAD_INPUT
    async with engine_for(
        args, in_process=args.engine_in_process, batched=not args.no_batching, interrupted=interrupted
    ) as (
        urls,
        choice,
        tokenizer,
    ):
        config = build_config(args, urls[0], choice.model, choice.tokenizer, choice.image_merge_size, api_key=key)
        if args.seed is not None:
            sampling["seed"] = args.seed
        async with RolloutRunner(
            config, sampling_params=sampling, engine_urls=urls, tokenizer=tokenizer, env_factory=env_factory
        ) as runner:
            print(_policy_line(args.history_policy, runner.history_policy, tokenizer, args.chat_template_kwargs),
                  file=sys.stderr)  # fmt: skip
            rolling = True  # from here a Ctrl-C aborts the samples and writes what they have
            progress = None if args.quiet else asyncio.ensure_future(_show_progress(runner, len(samples), sys.stderr))
            batch = asyncio.ensure_future(
                runner.run_batch(samples, concurrency=args.concurrency, sample_ids=sample_ids, seeds=seeds,
                                 target_groups=args.target_groups, oversample=args.oversample)
            )  # fmt: skip
            stop_waiter = asyncio.ensure_future(interrupted.wait())
            await asyncio.wait({batch, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
            if interrupted.is_set() and not batch.done():
                print("\ninterrupted: aborting samples in flight ...", file=sys.stderr)
                await runner.abort("cancelled")
            done = await batch
            stop_waiter.cancel()
            if progress is not None:
                progress.cancel()
                print(file=sys.stderr)
            snapshot = runner.metrics()
    if isinstance(done, SampledBatch):  # --target-groups: the groups never started are not results
        ran = {id(sample) for sample in done}
        kept = [position for position, sample in enumerate(samples) if id(sample) in ran]
        samples = [samples[position] for position in kept]
        sample_ids = [sample_ids[position] for position in kept if position < len(sample_ids)]
    write_results(samples, args.out, include_features=args.include_features)
    errors = [redacted(line, key) for line in error_lines(samples)]
    print(
        summary(
            snapshot,
            total=len(samples),
            skipped=skipped,
            out=args.out,
            trace=args.trace,
            rewards=reward_lines(samples),
            errors=errors,
        )
    )
    if isinstance(done, SampledBatch):
        print(groups_line(done, args.target_groups))
    print(f"history: {snapshot.forks} fork(s), {snapshot.sequences} training sequence(s) from "
          f"{snapshot.samples_done} sample(s)")  # fmt: skip
    if args.record:
        print(f"tape: {tape_path_for(args.trace)}")
    page = await _write_report(args, tokenizer) if args.report is not None else None
    print(
        "\n".join(next_lines(samples, sample_ids, trace=args.trace, record=args.record, results=args.out, report=page))
    )
    if interrupted.is_set():
        return EXIT_INTERRUPTED
    nothing = nothing_generated(samples, max_context_len=args.max_context_len)
    if nothing is not None:
        print(f"error: {nothing}", file=sys.stderr)
        return EXIT_FAILED_SAMPLES
    return EXIT_FAILED_SAMPLES if snapshot.statuses.get("failed") else EXIT_OK


async def _write_report(args: argparse.Namespace, tokenizer: Any) -> Path | None:
    """``--report``: the run's web page, from its trace (and tape) and results; None when it cannot be built."""
    from fsm_rollout.report import build_report, write_report

    output = report_path_for(args.trace) if args.report is True else args.report
    try:
        data = await asyncio.to_thread(build_report, args.trace, results=args.out, tokenizer=tokenizer)
        page = await asyncio.to_thread(write_report, data, output)
    except (RolloutError, OSError) as error:
        print(f"error: the report could not be written: {error}", file=sys.stderr)
        return None
    print(f"report: {page}")
    return page


def _policy_line(requested: str, chosen: str | None, tokenizer: Any, template_kwargs: Any) -> str:
    """The history policy the samples without tools run under, and, when ``auto`` chose it, why."""
    if requested != "auto":
        return f"history policy: {chosen}"
    if chosen == "append":
        why = "the chat template writes history as the rollout holds it and cuts each observation's boundary"
    else:
        from fsm_rollout.tokens.template_probe import probe_template

        why = probe_template(tokenizer, None, template_kwargs, roles=("user",)).describe(("user",))
    return f"history policy: auto chose {chosen} ({why}; samples with tools are probed with their tools)"


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout run``."""
    from fsm_rollout.runtime.dataset import DatasetError

    problem = option_problem(args)
    if problem is None and args.record and args.trace is None:
        problem = "--record needs --trace (the tape is written beside the trace)"
    if problem is None and args.report is not None and args.trace is None:
        problem = "--report needs --trace (the page is built from the trace)"
    if problem is None and args.data is not None and args.env is None:
        # the demo's Geo3K grading would silently score another dataset
        problem = (
            f"--data needs --env: the environment that runs and grades your dataset (the demo's is --env {DEMO_ENV})"
        )
    if problem is None and args.oversample and args.target_groups is None:
        problem = "--oversample needs --target-groups (the number of complete groups wanted)"
    if problem is None:
        try:  # what the library's config checks, before anything starts rather than once the engine runs
            build_config(
                args, (args.engine_url or ["http://127.0.0.1:0"])[0], args.model or "-", None, args.image_merge_size
            )
        except RolloutError as error:
            problem = str(error)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from fsm_rollout.cli.interruptible import run_interruptibly

    try:
        return run_interruptibly(_run(args))
    except (asyncio.CancelledError, KeyboardInterrupt):  # a Ctrl-C before any sample ran (see _run)
        end = "\n" if sys.stderr.isatty() else ""  # a progress line may be half drawn
        print(f"{end}interrupted: stopped before any sample ran; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (DatasetError, RolloutError, PreflightError) as error:
        print(f"error: {redacted(str(error), api_key(args))}", file=sys.stderr)
        return EXIT_BAD_INPUT
