"""Internal: run a coroutine when an event loop shuts down, for resources that belong to one loop (aiohttp
sessions).

:func:`at_loop_shutdown` arranges for ``await callback()`` inside the running loop when that loop shuts down its
async generators, which ``asyncio.run``, ``asyncio.Runner`` and pytest-asyncio do before closing it. A loop that
is still open when the interpreter exits (a trainer's loop thread, a loop never closed) runs its callbacks then.
A loop closed by hand without ``loop.shutdown_asyncgens()`` runs nothing: close its resources before closing it.

Nothing is installed at import: the exit handler is registered the first time :func:`at_loop_shutdown` is used,
and the shutdown hook is an ordinary async generator of the loop (the mechanism asyncio offers for cleanup at
shutdown), not a process-wide asyncgen or loop hook.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable

_LOGGER = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 5.0
"""How long interpreter exit waits for a loop running in another thread to run its callbacks."""

_LOCK = threading.Lock()
_PENDING: dict[asyncio.AbstractEventLoop, dict[object, AsyncGenerator[None, None]]] = {}
"""Per loop, the started shutdown generators by key; they keep their loop alive, so each is dropped once run."""
_exit_handler_registered = False


def at_loop_shutdown(callback: Callable[[], Awaitable[None]]) -> None:
    """Await ``callback()`` in the running loop when it shuts down (or at interpreter exit if it never does)."""
    global _exit_handler_registered
    loop = asyncio.get_running_loop()
    key = object()
    hook = _await_at_shutdown(loop, key, callback)
    with _LOCK:
        for closed in [other for other in _PENDING if other.is_closed()]:  # closed by hand: nothing left to run
            del _PENDING[closed]
        _PENDING.setdefault(loop, {})[key] = hook
        if not _exit_handler_registered:
            atexit.register(_run_pending_at_exit)
            _exit_handler_registered = True
    # The first step registers the generator with the running loop (its firstiter hook) and stops at the yield.
    with contextlib.suppress(StopIteration):
        hook.asend(None).send(None)


async def _await_at_shutdown(
    loop: asyncio.AbstractEventLoop, key: object, callback: Callable[[], Awaitable[None]]
) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        try:
            await callback()
        finally:
            _forget(loop, key)


def _forget(loop: asyncio.AbstractEventLoop, key: object) -> None:
    with _LOCK:
        hooks = _PENDING.get(loop)
        if hooks is not None:
            hooks.pop(key, None)
            if not hooks:
                del _PENDING[loop]


def _run_pending_at_exit() -> None:
    with _LOCK:
        pending = [(loop, dict(hooks)) for loop, hooks in _PENDING.items()]
    for loop, hooks in pending:
        if loop.is_closed():
            continue
        for hook in hooks.values():
            try:
                if loop.is_running():  # in another thread: run the callback there
                    asyncio.run_coroutine_threadsafe(hook.aclose(), loop).result(EXIT_TIMEOUT_S)
                else:
                    loop.run_until_complete(hook.aclose())
            except Exception as error:  # exit goes on; say what was left open
                _LOGGER.warning("could not run an event loop's shutdown callback at exit: %r", error)
