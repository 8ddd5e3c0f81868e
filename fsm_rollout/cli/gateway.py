"""``fsm-rollout gateway``: serve OpenAI-compatible agent sessions, each a traced rollout trained token-exact.

What the command does is in :data:`EPILOG` (printed by ``--help`` and in the README).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

from fsm_rollout.cli.common import add_process_settings
from fsm_rollout.cli.engine_options import add_engine_options, add_history_options
from fsm_rollout.cli.preflight import PreflightError, api_key, redacted
from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import RolloutError

EXIT_OK, EXIT_BAD_INPUT = 0, 2

EPILOG = """\
With no --engine-url the embedded CPU engine is started in-process, as `fsm-rollout run` does. The gateway listens
on 127.0.0.1 unless --host says otherwise, and prints its URL. A trainer opens a session with POST /sessions
(optional {"metadata": {...}, "label": ...}) and gives the agent the answer's base_url as its OpenAI base URL; the
agent's chat calls are the session's turns; POST /sessions/<id>/reward sets the reward, and POST
/sessions/<id>/close ends the session and answers {"samples": [...]}: its training sequences, token-exact, more than
one when the agent rewrote its history; a repeated close answers the same samples for --closed-session-ttl seconds,
and a chat call on a closed session answers 409. GET /sessions/<id> shows the session's state, GET /sessions lists the
open ones. Agents speak Chat Completions (<base_url>/chat/completions) or Responses (<base_url>/responses, as Codex
does). With --auto-sessions a harness needs no set-up call: its requests to the root paths (/v1/chat/completions,
/v1/responses, /v1/models) open a session on first sight, keyed by its own session header (x-session-id, or the
session_id in Codex's x-codex-turn-metadata), and reuse it after; close them as any session.

--api-key is sent to the engine, as `run` sends it, and the gateway's control endpoints (opening, rewarding, closing
and reading sessions) then need it as `Authorization: Bearer KEY`; --agent-api-key makes the agent endpoints
(chat completions, models) need a key too. A session idle past --session-idle-timeout ends truncated with reason
agent_timeout. A chat call that repeats the call in flight or the last one (same body, or same Idempotency-Key) gets
that call's answer, so a client's retry after a timeout generates nothing twice; a call whose client went away and
is not retried within --disconnect-grace ends the session aborted (agent_disconnected). --trace writes every
session's transitions; --record (with --trace) records the tape, so that
`fsm-rollout replay` re-executes a session offline and `fsm-rollout inspect` shows it.

Ctrl-C or SIGTERM stops the gateway: sessions still open end aborted (reason shutdown). Before it listens (the
embedded model's build or load) it stops at once. Exit codes: 0 stopped; 2 bad options, or no usable engine or
tokenizer; 130 interrupted before it listened."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout gateway``."""
    parser.epilog = EPILOG
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=8300, help="port to listen on; 0 picks a free one (default: %(default)s)"
    )
    serve.add_argument(
        "--agent-api-key", metavar="KEY", help="make the agent endpoints need `Authorization: Bearer KEY` too"
    )
    serve.add_argument(
        "--session-idle-timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="end a session truncated (reason agent_timeout) when its agent sends nothing for S seconds "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--disconnect-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="how long the answer of a call whose client went away waits for its retry before the session is "
        "aborted (reason agent_disconnected) (default: %(default)s)",
    )
    serve.add_argument(
        "--closed-session-ttl",
        type=float,
        default=600.0,
        metavar="S",
        help="answer a repeated close of a session with the same samples for S seconds (default: %(default)s)",
    )
    serve.add_argument(
        "--auto-sessions",
        action="store_true",
        help="open a session on a root path's first request with a new client session key (x-session-id, Codex's "
        "session id) and reuse it for that key",
    )
    serve.add_argument("--trace", metavar="FILE", help="write the sessions' transition trace (JSONL) here")
    serve.add_argument(
        "--record", action="store_true", help="also record the I/O tape beside the trace, for `fsm-rollout replay`"
    )
    serve.add_argument("--quiet", action="store_true", help="no engine start-up progress")
    add_engine_options(
        parser.add_argument_group("engine"),
        several_urls="each session kept on one",
        api_key="the engine's key, also required on the gateway's control endpoints",
    )
    rollout = parser.add_argument_group("sessions")
    add_history_options(rollout)  # a rewritten history forks under every policy
    rollout.add_argument("--max-turns", type=int, default=1000, metavar="N", help="calls per session at most")
    rollout.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="response budget of a session, over all its training sequences (default: unbounded)",
    )
    rollout.add_argument(
        "--max-call-tokens",
        type=int,
        metavar="N",
        help="answer tokens of one call at most: min(the client's max_tokens / max_output_tokens, N) "
        "(default: the client's, or the session's budget)",
    )
    rollout.add_argument(
        "--max-context-len",
        type=int,
        metavar="N",
        help="context limit (prompt + response; default: the engine's max_model_len)",
    )
    rollout.add_argument("--temperature", type=float, default=1.0, metavar="T", help="default sampling temperature")
    rollout.add_argument("--top-p", type=float, default=1.0, metavar="P", help="default top-p")
    add_process_settings(parser.add_argument_group("process-wide settings"))
    parser.set_defaults(image_merge_size=None)


def build_config(
    args: argparse.Namespace, url: str, model: str, tokenizer_path: str | None, *, served_context: int | None = None
) -> RolloutConfig:
    """The sessions' rollout configuration from the options. Without ``--max-context-len`` the context is the one the
    engine serves (``served_context``), so a client's ``max_tokens`` larger than the room left (Claude Code asks for
    128,000) is cut to that room, not refused by the engine's generate with a 400 the harness retries, then quits."""
    values: dict[str, Any] = {
        "engine_url": url,
        "model": model,
        "tokenizer_path": tokenizer_path,
        "max_turns": args.max_turns,
        "rollout_max_context_len": args.max_context_len if args.max_context_len is not None else served_context,
        "router_policy": "consistent_hash",
        "trace": args.trace,
        "record": args.record,
        "loop_slice_ms": args.loop_slice_ms or None,
        "tune_gc": not args.no_tune_gc,
        "api_key": api_key(args),
        "trust_remote_code": args.trust_remote_code,
    }
    values["history_policy"] = args.history_policy
    values["apply_chat_template_kwargs"] = args.chat_template_kwargs
    return RolloutConfig(**values)


async def serve(args: argparse.Namespace, *, ready: Callable[[str], None] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM; ``ready(url)`` is called once it listens."""
    from fsm_rollout.cli.run_engine import engine_for
    from fsm_rollout.gateway import AgentGateway
    from fsm_rollout.runtime.runner import RolloutRunner

    stop = asyncio.Event()
    starting = asyncio.current_task()
    listening = False

    def on_signal() -> None:
        stop.set()
        if starting is not None and not listening:  # the engine's build or start: stop them, serve nothing
            starting.cancel()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        async with engine_for(args, in_process=True) as (urls, choice, tokenizer):
            config = build_config(args, urls[0], choice.model, choice.tokenizer, served_context=choice.max_model_len)
            sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
            runner = RolloutRunner(config, sampling_params=sampling, engine_urls=urls, tokenizer=tokenizer)
            async with AgentGateway(
                runner,
                host=args.host,
                port=args.port,
                api_key=api_key(args),
                agent_api_key=args.agent_api_key,
                session_idle_timeout_s=args.session_idle_timeout,
                closed_session_ttl_s=args.closed_session_ttl,
                disconnect_grace_s=args.disconnect_grace,
                auto_sessions=args.auto_sessions,
                max_call_tokens=args.max_call_tokens,
            ) as gateway:
                listening = True
                print(f"gateway listening on {gateway.url} (model {choice.model})", flush=True)
                print(f"open a session: curl -X POST {gateway.url}/sessions", flush=True)
                if ready is not None:
                    ready(gateway.url)
                await stop.wait()
                print(f"stopping: {gateway.sessions} session(s) still open end aborted", file=sys.stderr, flush=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return EXIT_OK


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout gateway``."""
    for url in args.engine_url:
        if not url.startswith(("http://", "https://")):
            print(f"error: --engine-url {url}: must be an http(s) URL", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.record and not args.trace:
        print("error: --record needs --trace (the tape is written beside the trace)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.session_idle_timeout is not None and args.session_idle_timeout <= 0:
        print("error: --session-idle-timeout must be positive", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.max_call_tokens is not None and args.max_call_tokens < 1:
        print("error: --max-call-tokens must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.closed_session_ttl < 0 or args.disconnect_grace < 0:
        print("error: --closed-session-ttl and --disconnect-grace must be >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    from fsm_rollout.cli.interruptible import EXIT_INTERRUPTED, run_interruptibly

    try:
        return run_interruptibly(serve(args))
    except (asyncio.CancelledError, KeyboardInterrupt):  # stopped before it listened (see serve)
        print("gateway: interrupted before it listened", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RolloutError, PreflightError, OSError) as error:
        print(f"error: {redacted(str(error), api_key(args))}", file=sys.stderr)
        return EXIT_BAD_INPUT
