"""Internal: the blocking half of starting a runner, done before the event loop runs (``RolloutRunner.prepare``).

Building a fast tokenizer (``tokenizers.Tokenizer.from_file`` and the BPE model under it) is one native call that
holds the GIL for its whole run: no ``tokenizers`` constructor lets it go, from a file, a string or pre-parsed
parts, so a worker thread does not keep the loop running, and a subprocess cannot hand back anything cheaper to
rebuild. The way left is to do it where no loop waits: here, synchronously, before the caller starts its loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fsm_rollout.config import RolloutConfig
from fsm_rollout.errors import RolloutError
from fsm_rollout.tokens.tokenizers import TokenizerSource, tokenizer_source


def refuse_on_running_loop(what: str) -> None:
    """Raise :class:`RolloutError` when this thread's event loop is running: blocking there stalls it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RolloutError(
        f"{what} blocks (it loads the tokenizer): call it before the event loop starts, not from a coroutine"
    )


def tokenizer_source_now(config: RolloutConfig, engine_urls: Sequence[str]) -> TokenizerSource:
    """Where the runner's tokenizer is (:func:`~fsm_rollout.tokens.tokenizers.tokenizer_source`), asking the first
    engine on a loop of this call's own, which is closed again (the thread's current loop is left as it was)."""
    if config.tokenizer_path:
        return TokenizerSource((config.tokenizer_path,), local_only=False)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(tokenizer_source(config, engine_urls[0]))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


_T = TypeVar("_T")


async def in_own_thread(work: Callable[[], _T]) -> _T:
    """``work()`` in a thread of its own that ends with it (the loop's default executor would keep its thread)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsm-rollout-runner-start")
    try:
        result = await asyncio.get_running_loop().run_in_executor(executor, work)
    except BaseException:
        executor.shutdown(wait=False)  # cancelled: the thread ends when the work does
        raise
    executor.shutdown(wait=True)  # the work is done: this only joins the idle thread
    return result


__all__ = ["in_own_thread", "refuse_on_running_loop", "tokenizer_source_now"]
