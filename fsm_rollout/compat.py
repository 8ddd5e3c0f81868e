"""``generate(args, sample, sampling_params)``: a drop-in custom generate function for slime/vime.

Point slime/vime's ``--custom-generate-function-path`` at ``fsm_rollout.compat.generate``. It reads the same
``args`` attributes as the seed rollout, accepts an ``fsm_rollout.Sample`` or the trainer's own ``Sample`` (any
object with the same fields; its status is set to the member of its own enum with the same value), and runs the
sample through the lifecycle machine.

Shared per process: the tokenizer and processor (loaded once per ``hf_checkpoint``, like vime's
``GenerateState``) and one HTTP client per event loop and engine URL.

Weight updates: ``await compat.suspend()`` before the trainer pushes new weights and ``await compat.resume()``
after (or ``async with compat.weight_update(version="7"):``) suspend every ``generate`` call of the event loop
without losing a token. With ``args.partial_rollout=True`` a suspended sample comes back to the trainer at once,
status ``aborted`` with reason ``handed_back`` (the lifecycle's ``hand_back`` edge), its data so far and
``metadata["resume_state"]``; passing it to ``generate`` again (after the resume) continues it where it stopped.
Its environment is closed at hand-back and rebuilt from its ``snapshot()`` on resume, in this process or another
(an environment without ``snapshot()``/``restore(state)`` cannot be resumed); nothing is held for a sample the
trainer drops. Without ``partial_rollout``, ``generate`` simply waits for the resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.errors import ResumeError as ResumeError  # re-exported: what resuming a handed-back sample raises
from fsm_rollout.errors import SamplingParamsError
from fsm_rollout.multimodal import load_image_processor
from fsm_rollout.rollout import Rollout
from fsm_rollout.runtime.loop_shutdown import at_loop_shutdown
from fsm_rollout.sample import PrefixCacheInfo, Sample, SpecInfo, Status
from fsm_rollout.weights.resume_state import discard_suspended as discard_suspended  # re-exported for trainers
from fsm_rollout.weights.suspension import HandBack, Suspender

_LOCK = threading.Lock()
_TOKENIZERS: dict[str, tuple[Any, Any]] = {}
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, VLLMClient]] = weakref.WeakKeyDictionary()
"""One client per event loop and engine URL: an aiohttp session belongs to the loop that created it."""
_SUSPENDERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Suspender]] = weakref.WeakKeyDictionary()
"""Per event loop, the gate of its ``generate`` calls, by weight-update strategy."""
_SAMPLE_FIELDS = tuple(field.name for field in dataclasses.fields(Sample))


def _load_tokenizer_and_processor(path: str) -> tuple[Any, Any]:
    with _LOCK:
        cached = _TOKENIZERS.get(path)
        if cached is None:
            from transformers import AutoProcessor, AutoTokenizer

            # Remote code stays trusted here, unlike in the rest of the library: this is the drop-in for the seed,
            # whose trainer (slime/vime's GenerateState) loads ``hf_checkpoint``'s tokenizer and processor with
            # trust_remote_code=True, and runs that checkpoint's own code to load the model it trains. Loading the
            # same checkpoint the same way gives the same tokenizer and adds no code the trainer does not run.
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
            try:
                processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)  # type: ignore[no-untyped-call]
            except (OSError, ValueError, ImportError):
                # e.g. Qwen2-VL's processor needs torchvision; the image processor alone gives the merge size
                processor = load_image_processor(path, trust_remote_code=True)  # None for text-only checkpoints
            cached = (tokenizer, processor)
            _TOKENIZERS[path] = cached
    return cached


def register_tokenizer(path: str, tokenizer: Any, processor: Any = None) -> None:
    """Use an already-loaded tokenizer (and processor) for ``hf_checkpoint == path`` instead of loading one."""
    with _LOCK:
        _TOKENIZERS[path] = (tokenizer, processor)


def _client_for(config: RolloutConfig) -> VLLMClient:
    loop = asyncio.get_running_loop()
    clients = _CLIENTS.get(loop)
    if clients is None:
        clients = _CLIENTS[loop] = {}
        at_loop_shutdown(_close_at_shutdown)  # trainers seldom call close_clients(): close them with their loop
    client = clients.get(config.engine_url)
    if client is None:
        client = VLLMClient.from_config(config)
        clients[config.engine_url] = client
    return client


def _loop_clients() -> list[VLLMClient]:
    return list(_CLIENTS.get(asyncio.get_running_loop(), {}).values())


def _suspenders() -> dict[str, Suspender]:
    loop = asyncio.get_running_loop()
    suspenders = _SUSPENDERS.get(loop)
    if suspenders is None:
        suspenders = _SUSPENDERS[loop] = {}
    return suspenders


async def suspend(reason: str = "weight_update", *, strategy: str = "abort") -> None:
    """Suspend every ``generate`` call of this event loop (see the module docstring); returns once no generate
    request of theirs is in flight (``abort``) or every engine froze them (``keep``)."""
    await _suspender_for_strategy(strategy).suspend(reason)


async def resume(*, strategy: str = "abort") -> None:
    """Let the suspended ``generate`` calls (and samples handed back, when passed again) go on."""
    await _suspender_for_strategy(strategy).resume()


@asynccontextmanager
async def weight_update(version: str | None = None, *, strategy: str = "abort") -> AsyncIterator[None]:
    """Suspend, run the body (push the weights), set the engines' weight version when given, resume."""
    async with _suspender_for_strategy(strategy).weight_update(version):
        yield


def _suspender_for_strategy(strategy: str) -> Suspender:
    suspenders = _suspenders()
    suspender = suspenders.get(strategy)
    if suspender is None:
        suspender = suspenders[strategy] = Suspender(_loop_clients, strategy=strategy)
    return suspender


async def close_clients() -> None:
    """Close the HTTP clients ``generate`` opened in the running event loop.

    Optional: they are also closed when the loop shuts down (``asyncio.run`` and ``asyncio.Runner`` do that) or at
    interpreter exit if it is still open (see :mod:`fsm_rollout.runtime.loop_shutdown`). Call it before closing a loop
    by hand without ``loop.shutdown_asyncgens()``.
    """
    # The loop keeps its (now empty) entry: its shutdown hook is registered once, however often this is called.
    clients = _CLIENTS.get(asyncio.get_running_loop(), {})
    opened = list(clients.values())
    clients.clear()
    for client in opened:
        await client.close()


async def _close_at_shutdown() -> None:
    """The loop is shutting down: close its clients and forget it."""
    await close_clients()
    _CLIENTS.pop(asyncio.get_running_loop(), None)


def _to_library_sample(foreign: Any) -> Sample:
    values = {name: getattr(foreign, name) for name in _SAMPLE_FIELDS if hasattr(foreign, name)}
    status = values.get("status")
    values["status"] = Status(getattr(status, "value", status)) if status is not None else Status.PENDING
    for name, kind in (("spec_info", SpecInfo), ("prefix_cache_info", PrefixCacheInfo)):
        nested = values.get(name)
        if nested is not None and not isinstance(nested, kind):
            values[name] = kind(
                **{f.name: getattr(nested, f.name) for f in dataclasses.fields(kind) if hasattr(nested, f.name)}
            )
    return Sample(**values)


def _write_back(sample: Sample, foreign: Any) -> None:
    for name in _SAMPLE_FIELDS:
        if not hasattr(foreign, name):
            continue
        value = getattr(sample, name)
        if name == "status":
            own_enum = type(getattr(foreign, name))
            if issubclass(own_enum, enum.Enum):
                value = own_enum(sample.status.value)
        elif name in ("spec_info", "prefix_cache_info"):
            target = getattr(foreign, name)
            if target is not None and target is not value:
                for field in dataclasses.fields(value):
                    if hasattr(target, field.name):
                        setattr(target, field.name, getattr(value, field.name))
                continue
        setattr(foreign, name, value)


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Run one multi-turn rollout the way the seed's ``generate`` does, through the lifecycle machine.

    The sample is mutated in place and returned; a rollout that forked (``args.fsm_rollout_history_policy``
    ``"fork"`` or ``"per_turn"``; the seed's append is the default) returns its training sequences as a list, the
    earlier ones first and the sample last, except when it is handed back (``aborted``): then the sample alone,
    its earlier sequences in ``sample.branches``. Errors are raised after the sample reached ``failed`` (its data
    so far kept and written back); a cancelled task ends the sample ``aborted`` and re-raises the cancellation.
    """
    config = RolloutConfig.from_args(
        args,
        trace=getattr(args, "fsm_rollout_trace", None),
        history_policy=getattr(args, "fsm_rollout_history_policy", "append"),  # the seed's method unless asked
    )
    if "top_p" not in sampling_params:  # the seed reads it unconditionally; slime/vime callers get its KeyError
        raise SamplingParamsError("sampling_params lacks required keys ['top_p']")
    tokenizer, processor = _load_tokenizer_and_processor(config.tokenizer_path or config.model)
    library_sample = sample if isinstance(sample, Sample) else _to_library_sample(sample)
    suspender = _suspender_for_strategy(config.weight_update_strategy)
    rollout = Rollout(
        library_sample,
        config=config,
        sampling_params=sampling_params,
        client=_client_for(config),
        tokenizer=tokenizer,
        processor=processor,
        env_args=args,
        suspender=_HandingBack(suspender) if config.partial_rollout else suspender,
    )
    try:
        await rollout.run()
    finally:
        if library_sample is not sample:
            _write_back(library_sample, sample)
    # A rollout that forked and finished: its training sequences, oldest first, as slime accepts. One handed back
    # (aborted, to be resumed) stays a single sample, as slime's abort path reads ``.response`` off each one it
    # gets; its earlier sequences travel in ``sample.branches`` and come back when the resumed rollout finishes.
    if library_sample.branches and library_sample.status is not Status.ABORTED:
        return [*(_as_callers(branch, sample) for branch in library_sample.branches), sample]
    return sample


def _as_callers(branch: Sample, sample: Any) -> Any:
    """A branch as a sample of the caller's own class (the library's ``Sample`` stays as it is)."""
    if isinstance(sample, Sample):
        return branch
    foreign = type(sample)()
    _write_back(branch, foreign)
    return foreign


class _HandingBack:
    """The loop's gate, except that a suspended rollout goes back to the trainer instead of waiting."""

    def __init__(self, suspender: Suspender) -> None:
        self._suspender = suspender

    def __getattr__(self, name: str) -> Any:
        return getattr(self._suspender, name)

    async def wait_resumed(self) -> None:
        if self._suspender.suspended:
            raise HandBack
