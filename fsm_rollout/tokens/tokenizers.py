"""Internal: where a runner's tokenizer comes from: ``RolloutConfig.tokenizer_path``, else what the engine names.

Without ``tokenizer_path`` the engine is asked (``GET /v1/models``): the tokenizer directory it names (the embedded
engine does), else the path it loaded the model from (vLLM's ``root``), else the served model name. Those are
loaded from local files only, a directory or the Hugging Face cache: they name the engine's files, and a hub that
does not answer would otherwise be retried for a minute before transformers raises an error that names no option.
When none loads, :class:`~fsm_rollout.errors.TokenizerNotFoundError` names ``tokenizer_path`` and every place
tried.

``trust_remote_code`` is passed through as the config says (off unless asked for): a tokenizer that ships Python
code runs it only when the user chose to.

A tokenizer loaded from a local directory is kept for the process, keyed by the directory and the names, sizes and
modification times of its files: a second runner on the same files gets the same object at no cost (building a
fast tokenizer holds the GIL for its whole load, so every thread, the event loop's included, waits for it). The
object is shared, so treat it as read-only. The most recently loaded one is held; the others as long as something
else holds them.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import RolloutError, TokenizerNotFoundError
from fsm_rollout.types import ServedModel


def load_tokenizer(path: str, *, trust_remote_code: bool = False, local_files_only: bool = False) -> Any:
    """Load a Hugging Face tokenizer from a local directory or model name (imports transformers lazily).

    Blocking (file reads, maybe a download unless ``local_files_only``): call it in a worker thread.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=local_files_only)


_loaded: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()
_latest: list[Any] = []
"""The tokenizer loaded last, held so that runners made one after another (one per trainer step) share it."""
_loading = threading.Lock()


def shared_tokenizer(path: str, *, trust_remote_code: bool = False, local_files_only: bool = False) -> Any:
    """:func:`load_tokenizer`, or the tokenizer already loaded from the same unchanged files (see the module
    docstring); a path that is not a local directory is loaded each time. Blocking, as :func:`load_tokenizer`."""
    key = _files_key(path, trust_remote_code)
    if key is None:
        return load_tokenizer(path, trust_remote_code=trust_remote_code, local_files_only=local_files_only)
    with _loading:  # two runners starting together load once
        tokenizer = _loaded.get(key)
        if tokenizer is None:
            tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, local_files_only=local_files_only)
            try:
                _loaded[key] = tokenizer
            except TypeError:  # an object that takes no weak reference is not shared
                return tokenizer
        _latest[:] = [tokenizer]
        return tokenizer


def forget_tokenizers() -> None:
    """Let go of every tokenizer :func:`shared_tokenizer` keeps (the next load reads the files again)."""
    with _loading:
        _loaded.clear()
        _latest.clear()


def _files_key(path: str, trust_remote_code: bool) -> tuple[Any, ...] | None:
    """What identifies a local tokenizer directory's contents; None for anything else (a hub name)."""
    try:
        real = os.path.realpath(path)
        with os.scandir(real) as entries:
            files = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                           for entry in entries if entry.is_file())  # fmt: skip
    except OSError:
        return None
    return (real, trust_remote_code, tuple(files))


@dataclass(frozen=True)
class TokenizerSource:
    """Where to load a runner's tokenizer from, in order, and why there (for the error message)."""

    candidates: tuple[str, ...]
    local_only: bool
    note: str = ""
    """What the engine said or why it said nothing, when the candidates came from asking it."""

    def load(self, *, model: str, trust_remote_code: bool) -> Any:
        """The first candidate that loads; blocking (call it in a worker thread)."""
        if not self.local_only:
            return shared_tokenizer(self.candidates[0], trust_remote_code=trust_remote_code)
        failures = []
        for candidate in self.candidates:
            try:
                return shared_tokenizer(candidate, trust_remote_code=trust_remote_code, local_files_only=True)
            except Exception as error:  # transformers raises OSError, ValueError, ... for a place without one
                failures.append(f"{candidate!r} ({type(error).__name__}: {_first_line(str(error))})")
        raise TokenizerNotFoundError(
            f"no local tokenizer found for model {model!r}: tried {'; '.join(failures)}{self.note}. Set "
            "RolloutConfig.tokenizer_path to a tokenizer directory (the Hugging Face hub is not asked without it)"
        )


async def tokenizer_source(config: RolloutConfig, engine_url: str) -> TokenizerSource:
    """Where the runner's tokenizer is: ``config.tokenizer_path``, else what ``engine_url`` names for
    ``config.model`` (see the module docstring)."""
    if config.tokenizer_path:
        return TokenizerSource((config.tokenizer_path,), local_only=False)
    from fsm_rollout.engine.probe import probe_engine

    try:
        served = await probe_engine(engine_url, api_key=config.api_key, timeout_s=config.connect_timeout_s)
    except RolloutError as error:  # down, refusing, or an odd list: the model name may still be a local path
        return listed_tokenizer_source(config, engine_url, error)
    return listed_tokenizer_source(config, engine_url, served)


def listed_tokenizer_source(
    config: RolloutConfig, engine_url: str, served: Sequence[ServedModel] | RolloutError | None
) -> TokenizerSource:
    """:func:`tokenizer_source` from what ``engine_url`` answered already: its model list, None when it has no
    models endpoint, or the error its probe raised."""
    if config.tokenizer_path:
        return TokenizerSource((config.tokenizer_path,), local_only=False)
    if isinstance(served, RolloutError):
        why = f" (the engine at {engine_url} did not list its models: {_first_line(str(served))})"
        return TokenizerSource((config.model,), local_only=True, note=why)
    card = next((item for item in served or () if item.name == config.model), None)
    if card is None:
        listed = "lists no models endpoint" if served is None else f"does not list {config.model!r}"
        return TokenizerSource((config.model,), local_only=True, note=f" (the engine at {engine_url} {listed})")
    return TokenizerSource(_unique([card.tokenizer, card.root, config.model]), local_only=True,
                           note=f" (from the engine at {engine_url})")  # fmt: skip


def _unique(values: Sequence[str | None]) -> tuple[str, ...]:
    seen: list[str] = []
    for value in values:
        if value and value not in seen:
            seen.append(value)
    return tuple(seen)


def _first_line(text: str, limit: int = 160) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


__all__ = [
    "TokenizerSource",
    "forget_tokenizers",
    "listed_tokenizer_source",
    "load_tokenizer",
    "shared_tokenizer",
    "tokenizer_source",
]
