"""``fsm-rollout serve``: run the embedded engine (vLLM's token-in/token-out endpoints on a CPU model) until stopped.

What the command prints is in :data:`EPILOG` (printed by ``--help`` and in the README); the engine is
:class:`fsm_rollout.engine.local.LocalEngine`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

API_KEY_ENV_VAR = "VLLM_API_KEY"
"""Where ``--api-key`` defaults from, as for ``vllm serve``."""

EPILOG = """\
Prints the base URL alone on stdout once the engine answers requests (details go to stderr), then serves until
SIGINT or SIGTERM. /v1/models also names the tokenizer directory and the image merge size, so `fsm-rollout run
--engine-url URL` needs no --model, --tokenizer or --image-merge-size. With an API key every request but
GET /health must send `Authorization: Bearer KEY` and is answered 401 otherwise. A signal before the engine
answers (the default model's build, the model's load) stops it at once with exit 130; once serving, exit 0. It is
a development and test engine; production is vLLM."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    parser.epilog = EPILOG
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a local Hugging Face causal-LM directory (default: the tiny random Qwen2, built on first use)",
    )
    from fsm_rollout.cli.engine_options import CHAT_TEMPLATE_HELP, add_chat_template_option

    add_chat_template_option(parser, help=CHAT_TEMPLATE_HELP + "; not with --model")
    parser.add_argument("--served-model-name", metavar="NAME", default=None, help="the model name requests must use")
    parser.add_argument(
        "--max-model-len", type=int, metavar="N", default=None, help="context length (default: the model config's)"
    )
    parser.add_argument("--max-num-seqs", type=int, metavar="N", default=16, help="generations decoded at once")
    parser.add_argument(
        "--torch-threads",
        type=int,
        metavar="N",
        default=1,
        help="torch intra-op threads of the worker; 0 keeps torch's default (default: 1, fastest on 2 cores)",
    )
    parser.add_argument(
        "--no-batching",
        action="store_true",
        help="decode one request at a time, each step a batch of one (slower; for comparison, as the engine decoded "
        "before batching)",
    )
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="also stop when stdin closes (for a parent process that starts the engine: it stops with the parent)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help=f"require this key as `Authorization: Bearer KEY` on every request but /health "
        f"(default: ${API_KEY_ENV_VAR}, else no key)",
    )


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit code."""
    from fsm_rollout.cli.interruptible import EXIT_INTERRUPTED, run_interruptibly

    try:
        return run_interruptibly(_serve(args))
    except (asyncio.CancelledError, KeyboardInterrupt):  # stopped before the engine served (see _serve)
        print("fsm-rollout serve: interrupted before the engine served", file=sys.stderr)
        return EXIT_INTERRUPTED


async def _serve(args: argparse.Namespace) -> int:
    from fsm_rollout.cli.run_engine import build_embedded_model
    from fsm_rollout.engine.local import LocalEngine, LocalEngineError

    stop = asyncio.Event()
    starting = asyncio.current_task()

    def on_signal() -> None:
        stop.set()
        if starting is not None and not serving:  # the model's build or load: stop them, serve nothing
            starting.cancel()

    serving = False
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    started = time.perf_counter()
    try:
        model, served = args.model, args.served_model_name
        if model is not None and args.chat_template is not None:
            raise ValueError(
                f"--chat-template {args.chat_template} serves the default model's thinking variant; --model DIR "
                "serves the directory's own template"
            )
        if model is None:  # built here so that a first start shows the training's progress line
            from fsm_rollout.cli.build_progress import BuildProgressLine
            from fsm_rollout.engine.local.default_model import DEFAULT_MODEL_NAME, default_model_dir
            from fsm_rollout.engine.local.thinking_model import thinking_model_dir, thinking_model_name

            say, line = (lambda text: print(text, file=sys.stderr, flush=True)), BuildProgressLine(sys.stderr)
            if args.chat_template is None:
                model = await build_embedded_model(lambda stop: default_model_dir(log=say, progress=line, stop=stop))
                served = served or DEFAULT_MODEL_NAME
            else:
                template = args.chat_template
                model = await build_embedded_model(
                    lambda stop: thinking_model_dir(template, log=say, progress=line, stop=stop)
                )
                served = served or thinking_model_name(template)
        engine = LocalEngine(
            model,
            served_model_name=served,
            max_model_len=args.max_model_len,
            host=args.host,
            port=args.port,
            max_num_seqs=args.max_num_seqs,
            torch_threads=args.torch_threads or None,
            api_key=args.api_key or os.environ.get(API_KEY_ENV_VAR) or None,
            batched=not args.no_batching,
        )
        await engine.start()
    except (LocalEngineError, ValueError, OSError) as error:
        print(f"fsm-rollout serve: {error}", file=sys.stderr)
        return 1
    serving = True  # from here a signal stops the engine the usual way: the requests in flight end "abort"
    try:
        print(
            f"fsm-rollout serve: model {engine.served_model_name!r} from {engine.model_dir} "
            f"(max_model_len {engine.max_model_len}{', API key required' if engine.requires_api_key else ''}) "
            f"ready in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        print(engine.url, flush=True)
        watcher = asyncio.ensure_future(_stop_on_stdin_eof(stop)) if args.stop_on_stdin_eof else None
        await stop.wait()
        if watcher is not None:
            watcher.cancel()
    finally:
        await engine.stop()
    return 0


async def _stop_on_stdin_eof(stop: asyncio.Event) -> None:
    """Set ``stop`` once stdin reaches its end (the parent holding its other end has closed it, or died)."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(1 << 16):
        pass
    stop.set()
