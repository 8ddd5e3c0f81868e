"""The embedded engine's front end: one thread that renders prompts and checks generate requests' image features,
beside the worker thread that runs the model.

Rendering (chat template, tokenization, image preprocessing) and the check of a generate request's ``features``
(decoding megabytes of base64) need no model. On the worker they would run between two decode steps and hold every
running request up; on a thread of their own they run while the worker decodes, on another core, as vLLM's API server
renders while its engine core steps. They never wait for a decode step either, nor for a pause or a weight load.

One thread: :class:`~fsm_rollout.engine.local.images.ImageSupport` and its caches are used by this thread alone. The
tokenizer is shared with the worker, which only decodes with it; a fast tokenizer's encode and decode take no
exclusive hold of it and can run at the same time. The thread starts with the first call and ends at :meth:`stop`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fsm_rollout.engine.local.errors import LocalEngineError

__all__ = ["Frontend"]

_T = TypeVar("_T")


class Frontend:
    """Runs render and feature-check calls one at a time on the engine's front-end thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fsm-rollout-engine-frontend"
        )

    async def run(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` on the front-end thread (after the calls submitted before it) and return its result."""
        executor = self._executor
        if executor is None:
            raise LocalEngineError("the embedded engine is stopped")
        try:
            future = executor.submit(call)
        except RuntimeError as error:  # shut down between the check and the submit
            raise LocalEngineError("the embedded engine is stopped") from error
        return await asyncio.wrap_future(future)

    def stop(self) -> None:
        """Refuse new calls, let the ones submitted finish (renders and checks are short), end the thread. Blocks:
        call it off the event loop."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
