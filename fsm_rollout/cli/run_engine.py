"""The engine a run talks to: the given URLs probed, or the embedded engine started (in a child process, or in
this one), with the run's tokenizer loaded meanwhile; a Ctrl-C during the default model's first build stops it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fsm_rollout.cli.preflight import EngineChoice, PreflightError, api_key, discover_engine, load_run_tokenizer

BUILD_STOP_WAIT_S = 1.5
"""How long a Ctrl-C waits for the model build to kill its child and remove what it staged."""


@contextlib.asynccontextmanager
async def engine_for(
    args: argparse.Namespace, *, in_process: bool, batched: bool = True, interrupted: asyncio.Event | None = None
) -> AsyncIterator[tuple[list[str], EngineChoice, Any]]:
    """Yield the engine URLs, what the run uses from them (flags first, then what the engine says), and the tokenizer.

    Probes the given URLs (see :func:`~fsm_rollout.cli.preflight.discover_engine`), or starts the embedded engine,
    which needs no API key, when no URL is given: ``in_process`` or in a child process, which starts while this
    process loads the tokenizer; ``batched`` False decodes one request at a time. Once ``interrupted`` is set, the
    engine's child is killed on exit without a grace period.
    """
    template = getattr(args, "chat_template", None)
    harness = bool(getattr(args, "harness_model", False))
    if harness and template is not None:
        raise PreflightError(f"--harness-model and --chat-template {template} pick two different embedded models")
    if args.engine_url:
        if harness:
            raise PreflightError(
                "--harness-model picks the embedded engine's harness model; a vLLM server serves its own model"
            )
        if template is not None:
            raise PreflightError(
                f"--chat-template {template} picks the embedded engine's thinking model; a vLLM server renders with "
                "its own template (vllm serve --chat-template)"
            )
        urls = list(args.engine_url)
        choice = await discover_engine(
            urls,
            model=args.model,
            tokenizer=args.tokenizer,
            image_merge_size=args.image_merge_size,
            api_key=api_key(args),
        )
        yield urls, choice, await load_tokenizer(args, choice.tokenizer, choice.tokenizer_named_by)
        return
    from fsm_rollout.cli.build_progress import BuildProgressLine
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir
    from fsm_rollout.engine.local.harness_model import HARNESS_MODEL_NAME, harness_model_dir
    from fsm_rollout.engine.local.thinking_model import thinking_model_dir, thinking_model_name

    served = DEFAULT_MODEL_NAME if template is None else thinking_model_name(template)
    served = HARNESS_MODEL_NAME if harness else served

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    print("starting the embedded CPU engine ...", file=sys.stderr)
    # built here, not inside the engine, so that a first run's training shows its progress line
    progress = None if args.quiet else BuildProgressLine(sys.stderr)
    model_dir = await build_embedded_model(
        (lambda stop: harness_model_dir(log=say, progress=progress, stop=stop))
        if harness
        else (lambda stop: default_model_dir(log=say, progress=progress, stop=stop))
        if template is None
        else lambda stop: thinking_model_dir(template, log=say, progress=progress, stop=stop)
    )
    if not in_process:
        if args.model and args.model != served:
            raise PreflightError(f"--model {args.model!r}: the embedded engine serves {served!r}")
        from fsm_rollout.cli.engine_process import engine_process
        from fsm_rollout.engine.local.images import IMAGE_MERGE_SIZE

        tokenizer, named_by = (
            (args.tokenizer, "--tokenizer")
            if args.tokenizer
            else (str(model_dir), "the embedded engine's model directory")
        )
        loading = asyncio.ensure_future(load_tokenizer(args, tokenizer, named_by))
        try:
            options = [] if batched else ["--no-batching"]
            async with engine_process(model_dir, served, *options, interrupted=interrupted) as url:
                merge_size = args.image_merge_size or IMAGE_MERGE_SIZE
                yield [url], EngineChoice(served, tokenizer, named_by, merge_size), await loading
        finally:
            loading.cancel()
        return
    async with LocalEngine(model_dir, served_model_name=served, log=say, batched=batched) as engine:
        if args.model and args.model != engine.served_model_name:
            raise PreflightError(f"--model {args.model!r}: the embedded engine serves {engine.served_model_name!r}")
        tokenizer, named_by = (
            (args.tokenizer, "--tokenizer")
            if args.tokenizer
            else (str(engine.model_dir), "the embedded engine's model directory")
        )
        merge_size = args.image_merge_size or engine.image_merge_size
        choice = EngineChoice(engine.served_model_name, tokenizer, named_by, merge_size, engine.max_model_len)
        yield [engine.url], choice, await load_tokenizer(args, tokenizer, named_by)


async def build_embedded_model(build: Callable[[threading.Event], Path]) -> Path:
    """``build(stop)``, a model build (it returns the cached directory, training it first if needed), on the loop's
    executor (daemon threads under :func:`~fsm_rollout.cli.interruptible.run_interruptibly`); a cancellation
    (Ctrl-C) sets ``stop``, which kills the build's child, and gives the build a moment to remove what it staged
    before the cancellation goes on."""
    stop = threading.Event()
    building = asyncio.ensure_future(asyncio.to_thread(build, stop))
    try:
        return await asyncio.shield(building)
    except asyncio.CancelledError:
        stop.set()
        building.add_done_callback(lambda done: done.cancelled() or done.exception())  # BuildInterrupted: expected
        await asyncio.wait({building}, timeout=BUILD_STOP_WAIT_S)
        raise


async def load_tokenizer(args: argparse.Namespace, location: str, named_by: str) -> Any:
    return await asyncio.to_thread(
        load_run_tokenizer, location, named_by=named_by, trust_remote_code=args.trust_remote_code
    )
