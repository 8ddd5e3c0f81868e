"""``fsm-rollout run``: the main job — roll a dataset out against vLLM (or the embedded engine) and write results.

What the command does, its outputs and exit codes are in :data:`EPILOG` (printed by ``--help`` and in the README).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from fsm_rollout.cli.common import add_process_settings
from fsm_rollout.cli.preflight import (
    API_KEY_ENV_VAR,
    EngineChoice,
    PreflightError,
    api_key,
    discover_engine,
    load_run_tokenizer,
    one_line,
    option_problem,
    redacted,
)
from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import RolloutError
from fsm_rollout.recording import tape_path_for
from fsm_rollout.runner import NOT_STARTED, MetricsSnapshot, RolloutRunner, group_members
from fsm_rollout.sample import Sample, Status

DEMO_ENV = "fsm_rollout.envs.geo3k"
GEO3K_STOP = ("</tool_call>",)
# the demo's model is right a few percent of the time: groups let a first run show the right-answer path too
DEMO_SAMPLES_PER_PROMPT = 4
EXIT_OK, EXIT_FAILED_SAMPLES, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
With no --engine-url the embedded CPU engine is started in-process; with no --data the bundled demo dataset runs
with the built-in Geo3K environment, each question as a group of samples (--n-samples-per-prompt); a dataset of
your own (--data) needs the environment that grades it (--env). --limit N takes the first N prompts. A live progress
line shows samples done, per-state occupancy and tokens/s; the run ends with a summary (status and reason counts,
the rewards the environment wrote, turns, tokens, throughput), the most frequent errors of the failed samples, and
the commands that look inside the run (inspect, diagram, replay) with a sample id it has.

Before a sample runs, the options are checked, then each --engine-url must answer GET /health, and GET /v1/models
fills in what the flags leave out: the served model name when the engine serves one model, and, from
`fsm-rollout serve`, the tokenizer directory and the image merge size (a real vLLM names its model path, used as
the tokenizer, and no merge size). A tokenizer that is neither a local directory nor in the Hugging Face cache is
downloaded only when the hub answers one first request for it; with HF_HUB_OFFLINE set it is an error at once.

Dataset lines are `{"prompt": str | messages, "images": [...], "label": ..., "metadata": {...}, "tools": [...]}`;
a bad line is an error naming its line number (or is skipped and counted with --skip-bad). Results are JSONL,
`Sample.to_dict()` per line in input order, with decoded image features as dtype and shape unless
--include-features (pixel values are megabytes per image); the trace is JSONL too, one line per transition.

Ctrl-C aborts the samples in flight, writes what finished plus the aborted partials (samples that had not started
yet are rows with reason not_started), counts finished, aborted mid-way and never started, and exits 130.

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
    engine.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="vLLM server or router URL; repeat for several servers (sticky consistent hashing) "
        "(default: start the embedded CPU engine)",
    )
    engine.add_argument(
        "--model", metavar="NAME", help="served model name (default: the engine's, when it serves one model)"
    )
    engine.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer directory or Hugging Face id (default: the one the engine names, else its "
        "model path, else --model)",
    )
    engine.add_argument("--router-policy", choices=["consistent_hash"], help="send x-session-id on every request")
    engine.add_argument(
        "--image-merge-size",
        type=int,
        metavar="N",
        help="vision merge size for the image-token check (Qwen-VL: 2; default: the engine's, when it says)",
    )
    engine.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a tokenizer that ships its own Python code run it (off: a path or hub id you "
        "type should not run code from that repository)",
    )
    engine.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"sent as `Authorization: Bearer KEY` on every engine request, never printed or "
        f"recorded (default: ${API_KEY_ENV_VAR})",
    )
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument(
        "--env",
        metavar="MODULE|FILE",
        help=f"environment module or .py file that grades the samples; required with --data "
        f"(default with the demo: {DEMO_ENV})",
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
    add_process_settings(parser.add_argument_group("process-wide settings"))


def _load_samples(args: argparse.Namespace) -> tuple[list[Sample], int]:
    from fsm_rollout.dataset import load_jsonl

    if args.data is None:
        from fsm_rollout.data.demo import demo_samples

        samples, skipped = demo_samples(), 0
    else:
        dataset = load_jsonl(args.data, skip_bad=args.skip_bad)
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
    n = args.n_samples_per_prompt or (DEMO_SAMPLES_PER_PROMPT if args.data is None else 1)
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


@contextlib.asynccontextmanager
async def _engine(args: argparse.Namespace) -> AsyncIterator[tuple[list[str], EngineChoice]]:
    """Yield the engine URLs and what the run uses from them (flags first, then what the engine says).

    Probes the given URLs (see :func:`~fsm_rollout.cli.preflight.discover_engine`), or starts the embedded engine,
    which needs no API key, when no URL is given.
    """
    if args.engine_url:
        urls = list(args.engine_url)
        yield (
            urls,
            await discover_engine(
                urls,
                model=args.model,
                tokenizer=args.tokenizer,
                image_merge_size=args.image_merge_size,
                api_key=api_key(args),
            ),
        )
        return
    from fsm_rollout.cli.build_progress import BuildProgressLine
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    print("starting the embedded CPU engine ...", file=sys.stderr)
    # built here, not inside the engine, so that a first run's training shows its progress line
    progress = None if args.quiet else BuildProgressLine(sys.stderr)
    model_dir = await asyncio.to_thread(default_model_dir, log=say, progress=progress)
    async with LocalEngine(model_dir, served_model_name=DEFAULT_MODEL_NAME, log=say) as engine:
        if args.model and args.model != engine.served_model_name:
            raise PreflightError(f"--model {args.model!r}: the embedded engine serves {engine.served_model_name!r}")
        tokenizer, named_by = (
            (args.tokenizer, "--tokenizer")
            if args.tokenizer
            else (str(engine.model_dir), "the embedded engine's model directory")
        )
        merge_size = args.image_merge_size or engine.image_merge_size
        yield [engine.url], EngineChoice(engine.served_model_name, tokenizer, named_by, merge_size)


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


def _json_default(value: Any) -> Any:
    if hasattr(value, "save") and hasattr(value, "mode"):  # PIL images in multimodal_inputs
        from fsm_rollout.multimodal import encode_pil_image

        return encode_pil_image(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _feature_summary(encoded: Any) -> Any:
    if isinstance(encoded, dict) and ("__tensor__" in encoded or "__ndarray__" in encoded):
        return {"dtype": encoded.get("dtype"), "shape": encoded.get("shape")}
    return encoded


def write_results(samples: Sequence[Sample], path: Path, *, include_features: bool = False) -> None:
    """Write ``Sample.to_dict()`` per line (images as data URLs).

    The decoded image features (``multimodal_train_inputs``: pixel values, megabytes per image) are written as
    ``{"dtype", "shape"}`` summaries unless ``include_features`` is set.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as stream:
        for sample in samples:
            row = sample.to_dict()
            features = row.get("multimodal_train_inputs")
            if features and not include_features:
                row["multimodal_train_inputs"] = {key: _feature_summary(value) for key, value in features.items()}
            stream.write(orjson.dumps(row, default=_json_default) + b"\n")


def summary(
    snapshot: MetricsSnapshot,
    *,
    total: int,
    skipped: int,
    out: Path,
    trace: Path | None,
    rewards: Sequence[str] = (),
    errors: Sequence[str] = (),
) -> str:
    """The end-of-run table, with ``rewards`` (see :func:`reward_lines`) and ``errors`` (see :func:`error_lines`)
    under the counts."""
    # an interrupt aborts the samples in flight ("cancelled") and those still queued ("not_started"): neither ran
    # to its end, so the first count is of the samples that did
    never_started = snapshot.reasons.get(NOT_STARTED, 0)
    cut_off = snapshot.reasons.get("cancelled", 0)
    lines = [
        f"{snapshot.samples_done - cut_off - never_started}/{total} samples finished in {snapshot.elapsed_s:.1f}s "
        f"({snapshot.samples_per_s:.2f} samples/s, {snapshot.turns} turns, "
        f"{snapshot.tokens_generated} tokens generated, {snapshot.tokens_per_s:.0f} tok/s)",
    ]
    if cut_off or never_started:
        lines.append(f"{cut_off} aborted mid-way, {never_started} never started")
    if skipped:
        lines.append(f"{skipped} bad dataset line(s) skipped")
    lines.append(f"{'status':<34}{'count':>6}")
    lines.extend(f"  {status:<32}{count:>6}" for status, count in sorted(snapshot.statuses.items()))
    lines.append(f"{'reason':<34}{'count':>6}")
    lines.extend(f"  {reason:<32}{count:>6}" for reason, count in sorted(snapshot.reasons.items()))
    lines.extend(rewards)
    lines.extend(errors)
    lines.append(f"results: {out}" + (f"   trace: {trace}" if trace else ""))
    return "\n".join(lines)


def reward_lines(samples: Sequence[Sample]) -> list[str]:
    """The rewards the environment wrote, in one line: their mean and how many samples earned 1, and of those
    how many completed; nothing when no sample has a numeric reward."""
    rewards = [(float(sample.reward), sample.status) for sample in samples
               if isinstance(sample.reward, int | float) and not isinstance(sample.reward, bool)]  # fmt: skip
    if not rewards:
        return []
    mean = sum(reward for reward, _ in rewards) / len(rewards)
    ones = [status for reward, status in rewards if reward == 1.0]
    completed = sum(1 for status in ones if status == Status.COMPLETED)
    return [f"reward mean {mean:.3f} over {len(rewards)} samples; {len(ones)} at 1.0 ({completed} completed)"]


def error_lines(samples: Sequence[Sample], *, limit: int = 5) -> list[str]:
    """The failed samples' distinct errors (class, message, count), most frequent first, at most ``limit``.

    Messages are shortened to one line; the full ones are in the results' ``metadata["rollout_error"]``.
    """
    counts: Counter[tuple[str, str]] = Counter()
    for sample in samples:
        if sample.status != Status.FAILED:
            continue
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        error = metadata.get("rollout_error")
        if isinstance(error, dict):
            counts[(str(error.get("type")), one_line(str(error.get("message")), 200))] += 1
        else:
            counts[("?", f"no error recorded (reason {metadata.get('rollout_reason', '?')})")] += 1
    if not counts:
        return []
    lines = [f"errors ({sum(counts.values())} failed sample(s), {len(counts)} distinct)"]
    lines.extend(f"  {count:>4} x {kind}: {message}" for (kind, message), count in counts.most_common(limit))
    if len(counts) > limit:
        lines.append(f"  ... {len(counts) - limit} more distinct error(s), see metadata.rollout_error in the results")
    return lines


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
    )


async def _run(args: argparse.Namespace) -> int:
    from fsm_rollout.env import load_env_factory

    prompts, skipped = _load_samples(args)
    samples, sample_ids, seeds = _groups(prompts, args)
    env_factory = load_env_factory(args.env or DEMO_ENV)  # a bad --env fails before any engine starts
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
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted.set)
    async with _engine(args) as (urls, choice):
        tokenizer = await asyncio.to_thread(
            load_run_tokenizer,
            choice.tokenizer,
            named_by=choice.tokenizer_named_by,
            trust_remote_code=args.trust_remote_code,
        )
        config = build_config(args, urls[0], choice.model, choice.tokenizer, choice.image_merge_size, api_key=key)
        if args.seed is not None:
            sampling["seed"] = args.seed
        async with RolloutRunner(
            config, sampling_params=sampling, engine_urls=urls, tokenizer=tokenizer, env_factory=env_factory
        ) as runner:
            progress = None if args.quiet else asyncio.ensure_future(_show_progress(runner, len(samples), sys.stderr))
            batch = asyncio.ensure_future(
                runner.run_batch(samples, concurrency=args.concurrency, sample_ids=sample_ids, seeds=seeds)
            )
            stop_waiter = asyncio.ensure_future(interrupted.wait())
            await asyncio.wait({batch, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
            if interrupted.is_set() and not batch.done():
                print("\ninterrupted: aborting samples in flight ...", file=sys.stderr)
                await runner.abort("cancelled")
            await batch
            stop_waiter.cancel()
            if progress is not None:
                progress.cancel()
                print(file=sys.stderr)
            snapshot = runner.metrics()
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
    if args.record:
        print(f"tape: {tape_path_for(args.trace)}")
    print("\n".join(next_lines(samples, sample_ids, trace=args.trace, record=args.record)))
    if interrupted.is_set():
        return EXIT_INTERRUPTED
    nothing = nothing_generated(samples, max_context_len=args.max_context_len)
    if nothing is not None:
        print(f"error: {nothing}", file=sys.stderr)
        return EXIT_FAILED_SAMPLES
    return EXIT_FAILED_SAMPLES if snapshot.statuses.get("failed") else EXIT_OK


def example_sample_id(samples: Sequence[Sample], sample_ids: Sequence[str | None]) -> str | None:
    """The id of a sample worth a look: the first that completed with reward 1, else the first completed one, else
    the first (``sample_ids``: the names the run gave by position; a sample without one is named by its index)."""

    def name(position: int) -> str | None:
        given = sample_ids[position] if position < len(sample_ids) else None
        index = samples[position].index
        return given if given is not None else None if index is None else str(index)

    completed = [position for position, sample in enumerate(samples) if sample.status == Status.COMPLETED]
    rewarded = [position for position in completed if samples[position].reward == 1.0]
    for position in (*rewarded, *completed, *range(len(samples))):
        found = name(position)
        if found is not None:
            return found
    return None


def next_lines(
    samples: Sequence[Sample], sample_ids: Sequence[str | None], *, trace: Path | None, record: bool
) -> list[str]:
    """The commands that look inside this run, with a sample id it has."""
    if trace is None:
        return [
            "next: run with --trace trace.jsonl --record to look inside each sample "
            "(`fsm-rollout inspect`, `replay`, `diagram --trace`)"
        ]
    example = example_sample_id(samples, sample_ids)
    lines = ["next:", f"  fsm-rollout inspect {trace}"]
    if example is not None:
        text = "" if record else "   (its turns' text needs a tape: run with --record)"
        lines.append(f"  fsm-rollout inspect {trace} --sample {example}{text}")
    overlay = trace.with_suffix(".mmd") if trace.suffix != ".mmd" else trace.with_suffix(".overlay.mmd")
    lines.append(
        f"  fsm-rollout diagram --trace {trace} -o {overlay}" + (f" --sample {example}" if example is not None else "")
    )
    if record:
        lines.append(f"  fsm-rollout replay {trace}")
    return lines


def nothing_generated(samples: Sequence[Sample], *, max_context_len: int | None) -> str | None:
    """Why the run failed when every sample ended ``budget_exhausted`` with nothing generated, else None.

    Each such sample is ``truncated``, a legal ending, but a run with not one generated token has nothing to train
    on: the prompts left no room for a response.
    """
    if not samples or any(sample.metadata.get("rollout_reason") != "budget_exhausted" or sample.response_length
                          for sample in samples):  # fmt: skip
        return None
    lengths = sorted(len(sample.tokens) for sample in samples)
    prompts = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    limit = f" under --max-context-len {max_context_len}" if max_context_len is not None else ""
    return (
        f"nothing was generated: all {len(samples)} sample(s) ended truncated/budget_exhausted before their first "
        f"turn; the prompts ({prompts} tokens) leave no room for a response{limit}"
    )


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout run``."""
    from fsm_rollout.dataset import DatasetError

    problem = option_problem(args)
    if problem is None and args.record and args.trace is None:
        problem = "--record needs --trace (the tape is written beside the trace)"
    if problem is None and args.data is not None and args.env is None:
        # the demo's Geo3K grading would silently score another dataset
        problem = (
            f"--data needs --env: the environment that runs and grades your dataset (the demo's is --env {DEMO_ENV})"
        )
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
    try:
        return asyncio.run(_run(args))
    except (DatasetError, RolloutError, PreflightError) as error:
        print(f"error: {redacted(str(error), api_key(args))}", file=sys.stderr)
        return EXIT_BAD_INPUT
