"""LoopPacer: admissions per loop iteration, first come first served, adapting to the slice, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from fsm_rollout.runtime.pacing import MIN_LIMIT, LoopPacer, pacer_for


async def _iteration_counter(stop: asyncio.Event, counter: list[int]) -> None:
    """Counts loop iterations (one ``sleep(0)`` per iteration) until ``stop`` is set."""
    while not stop.is_set():
        counter[0] += 1
        await asyncio.sleep(0)


async def _worker(
    pacer: LoopPacer, name: int, log: list[tuple[int, int]], counter: list[int], busy_s: float = 0.0
) -> None:
    waiter = pacer.admit()
    if waiter is not None:
        await waiter
    log.append((name, counter[0]))
    if busy_s:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass


async def test_admissions_are_first_come_first_served_and_bounded_per_iteration() -> None:
    # iterations never exceed the slice here: the allowance only grows
    pacer = LoopPacer(asyncio.get_running_loop(), slice_ms=10_000.0)
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
    pacer = LoopPacer(asyncio.get_running_loop(), slice_ms=1.0)
    pacer.limit = 32
    stop, counter, log = asyncio.Event(), [0], []
    ticker = asyncio.create_task(_iteration_counter(stop, counter))
    # every admitted worker busy-waits 2 ms, so any iteration with work runs over the 1 ms slice
    await asyncio.gather(*(_worker(pacer, i, log, counter, busy_s=0.002) for i in range(120)))
    stop.set()
    await ticker
    assert MIN_LIMIT <= pacer.limit < 32
    assert [name for name, _ in log] == list(range(120))


async def test_a_cancelled_waiter_does_not_hold_up_the_others() -> None:
    pacer = LoopPacer(asyncio.get_running_loop())
    pacer.limit = 1
    first = pacer.admit()
    assert first is None
    waiters = [pacer.admit() for _ in range(3)]
    assert all(waiter is not None for waiter in waiters)
    assert waiters[0] is not None and waiters[1] is not None and waiters[2] is not None
    waiters[0].cancel()
    await asyncio.wait_for(asyncio.gather(waiters[1], waiters[2]), timeout=5)


async def test_rollouts_asking_for_one_slice_share_a_pacer_and_no_caller_changes_anothers_slice() -> None:
    loop = asyncio.get_running_loop()
    pacer = pacer_for(loop, 10.0)
    assert pacer_for(loop, 10.0) is pacer
    other = pacer_for(loop, 25.0)
    assert other is not pacer
    assert pacer.slice_s == pytest.approx(0.010)
    assert other.slice_s == pytest.approx(0.025)


def test_separate_loops_get_separate_pacers() -> None:
    async def mine() -> LoopPacer:
        return pacer_for(asyncio.get_running_loop())

    assert asyncio.run(mine()) is not asyncio.run(mine())


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_other_slow_work_on_the_loop_does_not_starve_the_rollouts() -> None:
    """6 ms of unrelated work in every iteration (over the 5 ms slice) slows the rollouts to the floor of
    admissions per iteration, never below it."""
    pacer = LoopPacer(asyncio.get_running_loop(), slice_ms=5.0)
    pacer.limit = 64
    stop = False

    def busy_neighbour() -> None:
        _burn(0.006)
        if not stop:
            asyncio.get_running_loop().call_soon(busy_neighbour)

    asyncio.get_running_loop().call_soon(busy_neighbour)
    stop_counting, counter, log = asyncio.Event(), [0], []
    ticker = asyncio.create_task(_iteration_counter(stop_counting, counter))
    await asyncio.gather(*(_worker(pacer, i, log, counter, busy_s=0.00005) for i in range(400)))
    stop = True
    stop_counting.set()
    await ticker
    assert pacer.limit == MIN_LIMIT  # every iteration overran: shrunk to the floor, and no further
    assert counter[0] <= 400 // MIN_LIMIT + 20  # at least the floor admitted per iteration


def test_a_loop_dropped_with_rollouts_waiting_is_collected_and_their_cleanup_runs() -> None:
    import gc
    import weakref

    finished: list[int] = []

    async def rollout(pacer: LoopPacer, index: int) -> None:
        try:
            waiter = pacer.admit()
            if waiter is not None:
                await waiter
            await asyncio.sleep(3600)  # in flight when the loop is dropped
        finally:
            finished.append(index)

    async def start() -> None:
        pacer = pacer_for(asyncio.get_running_loop())
        tasks = [asyncio.ensure_future(rollout(pacer, index)) for index in range(50)]
        await asyncio.sleep(0)
        assert pacer.waited > 0 and not any(task.done() for task in tasks)

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda *_: None)  # "Task was destroyed but it is pending!" is expected here
    loop.run_until_complete(start())
    loop.close()
    dropped = weakref.ref(loop)
    del loop
    for _ in range(3):
        gc.collect()
    assert dropped() is None
    assert sorted(finished) == list(range(50))
