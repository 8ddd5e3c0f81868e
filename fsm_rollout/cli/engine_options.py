"""The engine, tokenizer and history options ``fsm-rollout run`` and ``fsm-rollout gateway`` share.

Both commands talk to the same engines with the same tokenizers and meet chat templates the same way, so the
options are defined once here; each command passes the few words of help that differ (what several URLs mean,
what the API key also guards).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fsm_rollout.cli.preflight import API_KEY_ENV_VAR
from fsm_rollout.config import HISTORY_POLICIES

__all__ = [
    "CHAT_TEMPLATE_HELP",
    "HARNESS_MODEL_HELP",
    "add_chat_template_option",
    "add_engine_options",
    "add_history_options",
    "json_object",
]

CHAT_TEMPLATE_HELP = (
    "serve the default model retrained for this shipped thinking chat template: it reasons in <think>...</think>, "
    "then answers (trained once on first use, then cached, as the default model is)"
)

HARNESS_MODEL_HELP = (
    "serve the harness model: the tiny model trained on Codex CLI's and Claude Code's real prompts to run a shell "
    'command that creates a file ("create a file named NAME containing TEXT") and then answer (trained once on '
    "first use, then cached)"
)


def add_engine_options(group: argparse._ActionsContainer, *, several_urls: str, api_key: str) -> None:
    """``--engine-url`` (repeatable), ``--model``, ``--tokenizer``, ``--trust-remote-code`` and ``--api-key``.

    ``several_urls`` says what repeating ``--engine-url`` does; ``api_key`` what the key is, up to its default."""
    group.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help=f"vLLM server or router URL; repeat for several servers ({several_urls}) "
        "(default: start the embedded CPU engine)",
    )
    group.add_argument(
        "--model", metavar="NAME", help="served model name (default: the engine's, when it serves one model)"
    )
    group.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer directory or Hugging Face id (default: the one the engine names, else its "
        "model path, else --model)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a tokenizer that ships its own Python code run it (off: a path or hub id you "
        "type should not run code from that repository)",
    )
    group.add_argument("--api-key", metavar="KEY", help=f"{api_key} (default: ${API_KEY_ENV_VAR})")
    add_chat_template_option(group, help=CHAT_TEMPLATE_HELP + "; embedded engine only")
    group.add_argument("--harness-model", action="store_true", help=HARNESS_MODEL_HELP + "; embedded engine only")


def add_chat_template_option(group: argparse._ActionsContainer, *, help: str) -> None:
    """``--chat-template NAME``: the embedded engine's thinking model for a shipped template."""
    from fsm_rollout.engine.local.thinking_model import THINKING_TEMPLATES

    group.add_argument("--chat-template", choices=THINKING_TEMPLATES, metavar="NAME", default=None,
                       help=f"{help} (choices: {', '.join(THINKING_TEMPLATES)})")  # fmt: skip


def json_object(text: str) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def add_history_options(group: argparse._ActionsContainer) -> None:
    """``--history-policy`` and ``--chat-template-kwargs``."""
    group.add_argument(
        "--history-policy",
        choices=HISTORY_POLICIES,
        default="auto",
        help="how history reaches the next turn: append boundary tokens, fork where the template rewrites it, one "
        "training row per model call, or auto (chosen once at start-up from the template probe)",
    )
    group.add_argument(
        "--chat-template-kwargs",
        type=json_object,
        metavar="JSON",
        help="chat template switches, e.g. '{\"enable_thinking\": false}': the template probe, the observation "
        "boundaries and the engine's render all get them",
    )
