"""at_loop_shutdown: the callback runs in its loop when the loop shuts down, and nothing is kept after."""

from __future__ import annotations

import asyncio

from fsm_rollout.runtime import loop_shutdown


def test_the_callback_runs_in_its_loop_when_asyncio_run_ends() -> None:
    ran: list[asyncio.AbstractEventLoop] = []

    async def callback() -> None:
        await asyncio.sleep(0)  # it may await: it runs inside the loop
        ran.append(asyncio.get_running_loop())

    async def main() -> asyncio.AbstractEventLoop:
        loop_shutdown.at_loop_shutdown(callback)
        loop_shutdown.at_loop_shutdown(callback)
        await asyncio.sleep(0)
        assert ran == []  # not before the shutdown
        return asyncio.get_running_loop()

    loop = asyncio.run(main())
    assert ran == [loop, loop]
    assert loop not in loop_shutdown._PENDING


def test_a_loop_closed_by_hand_is_forgotten() -> None:
    loop = asyncio.new_event_loop()

    async def nothing() -> None:
        return None

    async def register() -> None:
        loop_shutdown.at_loop_shutdown(nothing)  # never run for the loop closed by hand: it skips the shutdown

    loop.run_until_complete(register())
    loop.close()
    assert loop in loop_shutdown._PENDING
    asyncio.run(register())  # the next registration drops loops that were closed meanwhile
    assert loop not in loop_shutdown._PENDING
