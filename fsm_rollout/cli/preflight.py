"""What ``fsm-rollout run`` checks before it runs a sample: its options, the engine, and the tokenizer.

Each problem is a :class:`PreflightError` whose message is one line naming the flag that fixes it; the command
prints it and exits 2 with nothing run. The order is the cheap one: options before anything starts, then the
engine (``GET /health``, ``GET /v1/models``), then the tokenizer, which is loaded without the hub's retries.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm_rollout.types import ServedModel

API_KEY_ENV_VAR = "VLLM_API_KEY"
"""Where ``run --api-key`` defaults from, as for vLLM's own clients and ``vllm serve``."""

HUB_CHECK_TIMEOUT_S = 5.0
"""How long the one request asking the hub whether it has a tokenizer may take (there is no retry)."""

_HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")
"""A Hugging Face repository id (``name`` or ``namespace/name``); anything else can only be a local path."""


class PreflightError(Exception):
    """A problem found before any sample ran; the message is one line, printed as is."""


# ---------------------------------------------------------------------------------------------------- options

_NUMERIC_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("limit", lambda value: value >= 0, "must be 0 or more"),
    ("max_turns", lambda value: value >= 1, "must be at least 1"),
    ("n_samples_per_prompt", lambda value: value >= 1, "must be at least 1"),
    ("max_new_tokens", lambda value: value >= 1, "must be at least 1"),
    ("max_context_len", lambda value: value >= 1, "must be at least 1"),
    ("concurrency", lambda value: value >= 1, "must be at least 1"),
    ("target_groups", lambda value: value >= 1, "must be at least 1"),
    ("oversample", lambda value: value >= 0, "must be 0 or more"),
    ("max_staleness", lambda value: value >= 0, "must be 0 or more"),
    ("temperature", lambda value: math.isfinite(value) and value >= 0, "must be a number >= 0"),
    ("top_p", lambda value: 0 < value <= 1, "must be in (0, 1]"),
    ("image_merge_size", lambda value: value >= 1, "must be at least 1"),
    (
        "loop_slice_ms",
        lambda value: math.isfinite(value) and value >= 0,
        "must be a positive number of milliseconds, or 0 to turn pacing off",
    ),
)
"""``run``'s numeric options (their ``dest``), what a valid value is, and how the rule reads."""


def option_problem(args: argparse.Namespace) -> str | None:
    """The first invalid option of ``run`` as ``--flag value: dest rule``, or None when all are valid."""
    for dest, valid, rule in _NUMERIC_RULES:
        value = getattr(args, dest, None)
        if value is not None and not valid(value):
            return f"--{dest.replace('_', '-')} {_shown(value)}: {dest} {rule}"
    for url in getattr(args, "engine_url", None) or ():
        if not url.startswith(("http://", "https://")):
            return f"--engine-url {url}: engine_url must be an http(s) URL such as http://127.0.0.1:8000"
    return None


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$VLLM_API_KEY``; None when neither is set (or both are empty)."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV_VAR) or None


def redacted(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` replaced, for anything printed that a server may have echoed the key into."""
    return text.replace(secret, "***") if secret else text


def one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of ``text``, shortened to ``limit`` characters."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class EngineChoice:
    """What the run uses, from the flags or else from the engine: the served model name, where the tokenizer is
    (and what named it, for messages), the image merge size and the context length the engines serve (the least of
    their model cards' ``max_model_len``; None: unknown)."""

    model: str
    tokenizer: str
    tokenizer_named_by: str
    image_merge_size: int | None
    max_model_len: int | None = None


async def discover_engine(
    urls: Sequence[str],
    *,
    model: str | None,
    tokenizer: str | None,
    image_merge_size: int | None,
    api_key: str | None,
) -> EngineChoice:
    """Probe every URL, then fill in what the flags leave out from the first URL's model list.

    Explicit flags win. The tokenizer defaults to the one the engine names (the embedded engine does), else to
    the model's ``root`` (where vLLM loaded it from), else to the model name.
    """
    listings = await asyncio.gather(*(_probe(url, api_key) for url in urls))
    served = listings[0]
    chosen = _choose_model(model, served, urls[0])
    for url, listing in zip(urls, listings, strict=True):
        names = [item.name for item in listing or ()]
        if listing is not None and chosen not in names:
            flag = "--model" if model else "the model"
            raise PreflightError(f"{flag} {chosen!r}: the engine at {url} serves {_names(names)}, not {chosen!r}")
    card = next((item for item in served or () if item.name == chosen), None)
    if tokenizer:
        location, named_by = tokenizer, "--tokenizer"
    elif card is not None and card.tokenizer:
        location, named_by = card.tokenizer, f"the tokenizer that {urls[0]} names"
    elif card is not None and card.root:
        location, named_by = card.root, f"the model path that {urls[0]} names"
    else:
        location, named_by = chosen, "--model"
    merge = image_merge_size or (card.image_merge_size if card is not None else None)
    lengths = [item.max_model_len for listing in listings for item in listing or () if item.name == chosen]
    context = min((length for length in lengths if length is not None), default=None)
    return EngineChoice(chosen, location, named_by, merge, context)


async def _probe(url: str, key: str | None) -> list[ServedModel] | None:
    from fsm_rollout.engine.probe import probe_engine
    from fsm_rollout.errors import EngineConnectionError, EngineHTTPError, EngineTimeoutError, ModelListError

    try:
        return await probe_engine(url, api_key=key)
    except EngineConnectionError as error:
        raise PreflightError(
            f"no engine answers at {url} ({one_line(str(error))}): start it or check --engine-url"
        ) from error
    except EngineTimeoutError as error:
        raise PreflightError(f"the engine at {url} does not answer ({one_line(str(error))})") from error
    except EngineHTTPError as error:
        message = one_line(str(error))
        if error.status in (401, 403):
            hint = (
                f"the API key was refused: check --api-key (or ${API_KEY_ENV_VAR})"
                if key
                else f"the engine needs an API key: pass --api-key or set ${API_KEY_ENV_VAR}"
            )
            raise PreflightError(f"{message}; {hint}") from error
        raise PreflightError(f"{message}; is {url} a vLLM server, and healthy?") from error
    except ModelListError as error:
        raise PreflightError(f"{url}: {one_line(str(error))}; pass --model") from error


def _choose_model(model: str | None, served: list[ServedModel] | None, url: str) -> str:
    if model:
        return model
    if served is None:
        raise PreflightError(f"{url} does not list its models (no /v1/models): pass --model (the served model name)")
    if len(served) != 1:
        raise PreflightError(
            f"the engine at {url} serves {_names([item.name for item in served])}: choose one with --model"
        )
    return served[0].name


def _names(names: Sequence[str]) -> str:
    return "no model" if not names else ", ".join(repr(name) for name in names)


# ---------------------------------------------------------------------------------------------------- tokenizer


def load_run_tokenizer(location: str, *, named_by: str, trust_remote_code: bool = False) -> Any:
    """Load the tokenizer from a local directory or the Hugging Face cache, or else from the hub when it answers.

    Never waits on the hub's retries: a location that is neither a directory nor cached fails at once when the
    hub is offline (``HF_HUB_OFFLINE``), and after one request of at most :data:`HUB_CHECK_TIMEOUT_S` when it
    cannot be reached or lacks the model. Blocking (file reads, maybe a download): call it in a worker thread.
    ``trust_remote_code`` (``--trust-remote-code``) lets a tokenizer that ships Python code run it.
    """
    path = Path(location).expanduser()
    if path.is_dir():
        return _load(str(path), location, named_by, local_only=True, trust_remote_code=trust_remote_code)
    if path.exists() or not _HUB_ID.fullmatch(location):
        raise PreflightError(f"{named_by} {location!r} is not a tokenizer directory: pass --tokenizer DIR")
    try:
        return _from_pretrained(location, local_only=True, trust_remote_code=trust_remote_code)
    except Exception:  # not in the cache (or unusable there): ask the hub below, whose answer names the problem
        pass
    missing = f"{named_by} {location!r} is neither a local directory nor in the Hugging Face cache"
    if _hub_offline():
        raise PreflightError(f"{missing}, and the hub is offline (HF_HUB_OFFLINE): pass --tokenizer DIR")
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(location, timeout=HUB_CHECK_TIMEOUT_S)
    except Exception as error:  # unreachable, unknown, gated: transformers would retry each for a minute
        raise PreflightError(
            f"{missing}, and the hub cannot provide it ({type(error).__name__}: {one_line(str(error), 160)}): "
            "pass --tokenizer DIR"
        ) from error
    return _load(location, location, named_by, local_only=False, trust_remote_code=trust_remote_code)


def _load(source: str, location: str, named_by: str, *, local_only: bool, trust_remote_code: bool) -> Any:
    try:
        return _from_pretrained(source, local_only=local_only, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise PreflightError(
            f"cannot load {named_by} {location!r} ({type(error).__name__}: {one_line(str(error), 160)}): "
            "pass --tokenizer DIR"
        ) from error


def _from_pretrained(source: str, *, local_only: bool, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=local_only)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    transformers_offline = os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE) or transformers_offline
