"""Internal: what the inbound adapters share: importing a foreign package (or naming the extra that installs
it), running a synchronous foreign call in the environment worker pool, and the chat-message and metadata
helpers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from fsm_rollout.envs.pool import env_thread_pool
from fsm_rollout.errors import AdapterProtocolError, MissingExtraError

DEFAULT_WORKERS = 16
"""Worker threads for synchronous foreign calls when the build arguments carry no ``env_max_workers``."""

ENV_STOP_KEY = "env_stop"
"""``sample.metadata[ENV_STOP_KEY]``: why the foreign environment ended the episode, in its own words (a verifiers
stop condition's name, ``terminated`` or ``truncated`` for Gymnasium/GEM, ``done`` for skyrl-gym,
``no_tool_calls`` for a TRL environment); the rollout's own reason stays ``env_done``, except for a
Gymnasium/GEM ``truncated`` episode (``env_truncated``)."""


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Put the root logger's handlers and level back as they were: some packages configure logging when imported
    (GEM calls ``logging.basicConfig``), and the host process's logging is not theirs to change."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [handler for handler in root.handlers if handler not in handlers]:
            root.removeHandler(handler)
        for handler in [handler for handler in handlers if handler not in root.handlers]:
            root.addHandler(handler)
        root.setLevel(level)


def import_extra(module: str, *, adapter: str, package: str, extra: str) -> ModuleType:
    """``module``, imported with the host's root logging kept as it was; a
    :class:`~fsm_rollout.errors.MissingExtraError` naming the extra when the package is not installed (an import
    error inside an installed package is left as it is)."""
    try:
        with root_logging_kept():
            return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is not None and (error.name == top or module.startswith(f"{error.name}.")):
            raise MissingExtraError(adapter=adapter, package=package, extra=extra) from None
        raise


async def run_sync(args: Any, function: Callable[..., Any], *call_args: Any, **kwargs: Any) -> Any:
    """``function(*call_args, **kwargs)`` in the environment worker pool (``args.env_max_workers`` threads), so a
    slow or stuck foreign call neither blocks the event loop nor outlives the rollout's step timeout (the awaiting
    is cut short; the thread finishes on its own)."""
    workers = getattr(args, "env_max_workers", None)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        workers = DEFAULT_WORKERS
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(env_thread_pool(workers), functools.partial(function, *call_args, **kwargs))


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A sample's prompt as a list of chat messages (a string is one user message; an empty one is none)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt else []
    if isinstance(prompt, list):
        return [dict(message) for message in prompt]
    raise TypeError(f"a sample's prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def jsonable_items(values: Any) -> dict[str, Any]:
    """The entries of a mapping whose values JSON can hold, as they are (the others are left out): what of a foreign
    state goes into ``sample.metadata``, which results files and tapes write as JSON."""
    kept: dict[str, Any] = {}
    if not hasattr(values, "items"):
        return kept
    for key, value in values.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        kept[str(key)] = value
    return kept


def reward_value(adapter: str, call: str, value: Any) -> float:
    """A foreign reward as a float; an :class:`~fsm_rollout.errors.AdapterProtocolError` when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            return float(value)  # numpy scalars and the like
        except (TypeError, ValueError):
            raise AdapterProtocolError(adapter, call, f"returned the reward {value!r}, not a number") from None
    return float(value)


def describe(value: Any) -> str:
    """A short description of a wrong value for an error message: its type, and its length for a tuple."""
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__


def max_turns_of(args: Any) -> int | None:
    """The rollout's turn limit from the build arguments (the config), when it has one."""
    value = getattr(args, "max_turns", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# One end-of-turn token a chat template's model writes last and the engine keeps in the text (no_stop_trim):
# ChatML's <|im_end|>, Llama 3's <|eot_id|>, <|endoftext|>, DeepSeek's (with fullwidth bars), Gemma's
# <end_of_turn>, </s>, <eos>.
_END_TOKEN = re.compile("(?:<\\|[^|<>\\s]+\\|>|<\uff5c[^\uff5c<>\\s]+\uff5c>|<end_of_turn>|</s>|<eos>)\\s*\\Z")


def action_text(text: str) -> str:
    """A turn's text as a foreign environment takes it: without the end-of-turn token the model wrote last (a move
    parser would read ``'\\boxed{2}.<|im_end|>'`` otherwise)."""
    return _END_TOKEN.sub("", text, count=1)
