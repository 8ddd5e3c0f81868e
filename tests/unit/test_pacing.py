"""LoopPacer: admissions per loop iteration, first come first served, adapting to the slice, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from fsm_rollout.pacing import LoopPacer, pacer_for


async def _iteration_counter(stop: asyncio.Event, counter: list[int]) -> None:
    """Counts loop iterations (one ``sleep(0)`` per iteration) until ``stop`` is set."""
    while not stop.is_set():
        counter[0] += 1
        await asyncio.sleep(0)


async def _worker(pacer: LoopPacer, name: int, log: list[tuple[int, int]], counter: list[int],
                  busy_s: float = 0.0) -> None:
    waiter = pacer.admit()
    if waiter is not None:
        await waiter
    log.append((name, counter[0]))
    if busy_s:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass


async def test_admissions_are_first_come_first_served_and_bounded_per_iteration() -> None:
    pacer = LoopPacer(slice_ms=10_000.0)  # iterations never exceed the slice here: the allowance only grows
    stop, counter, log = asyncio.Event(), [0], []
    ticker = asyncio.create_task(_iteration_counter(stop, counter))
    await asyncio.sleep(0)
    await asyncio.gather(*(_worker(pacer, i, log, counter) for i in range(200)))
    stop.set()
    await ticker
    assert [name for name, _ in log] == list(range(200))
    per_iteration: dict[int, int] = {}
    for _, iteration in log:
        per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
    assert max(per_iteration.values()) < 200  # spread over several iterations
    assert len(per_iteration) > 5
    assert pacer.waited > 0 and pacer.admitted == 200
    assert pacer.limit > 4  # short iterations with the allowance used up: it grew


async def test_the_allowance_shrinks_when_iterations_run_over_the_slice() -> None:
    pacer = LoopPacer(slice_ms=1.0)
    pacer.limit = 32
    stop, counter, log = asyncio.Event(), [0], []
    ticker = asyncio.create_task(_iteration_counter(stop, counter))
    # every admitted worker busy-waits 2 ms, so any iteration with work runs over the 1 ms slice
    await asyncio.gather(*(_worker(pacer, i, log, counter, busy_s=0.002) for i in range(120)))
    stop.set()
    await ticker
    assert pacer.limit < 32
    assert [name for name, _ in log] == list(range(120))


async def test_a_cancelled_waiter_does_not_hold_up_the_others() -> None:
    pacer = LoopPacer()
    pacer.limit = 1
    first = pacer.admit()
    assert first is None
    waiters = [pacer.admit() for _ in range(3)]
    assert all(waiter is not None for waiter in waiters)
    assert waiters[0] is not None and waiters[1] is not None and waiters[2] is not None
    waiters[0].cancel()
    await asyncio.wait_for(asyncio.gather(waiters[1], waiters[2]), timeout=5)


async def test_one_pacer_per_loop_and_the_slice_follows_the_latest_caller() -> None:
    loop = asyncio.get_running_loop()
    pacer = pacer_for(loop, 10.0)
    assert pacer_for(loop, 25.0) is pacer
    assert pacer.slice_s == pytest.approx(0.025)


def test_separate_loops_get_separate_pacers() -> None:
    async def mine() -> LoopPacer:
        return pacer_for(asyncio.get_running_loop())

    assert asyncio.run(mine()) is not asyncio.run(mine())
