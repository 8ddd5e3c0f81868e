"""The loop-lag instruments the runner-start tests rely on: what each counts, checked with work of known shape (CPU
time, not wall time, is asserted on, so the machine's load cannot move the result)."""

from __future__ import annotations

import asyncio
import threading
import time

from fsm_rollout.testing.loop_lag import TICK_S, LoopTicker, NativeCallWatch


def burn_python(cpu_s: float) -> None:
    """Python bytecode for ``cpu_s`` of this thread's CPU time."""
    until = time.thread_time() + cpu_s
    while time.thread_time() < until:
        pass


def burn_native(cpu_s: float) -> int:
    """One native call (``sum`` over a range: no Python frame inside) that runs at least ``cpu_s`` of CPU."""
    size = 1_000_000
    while True:
        started = time.thread_time()
        total = sum(range(size))
        if time.thread_time() - started >= cpu_s:
            return total
        size *= 2


async def test_the_ticker_counts_the_loop_threads_own_work_in_a_gap_and_the_gap_is_at_least_that_long() -> None:
    async with LoopTicker() as ticker:
        burn_python(0.15)  # on the loop: no tick can happen meanwhile
    lag = ticker.summary()
    assert lag.loop_cpu_max_ms >= 150
    assert lag.max + TICK_S * 1000 >= lag.loop_cpu_max_ms  # a thread's CPU time never exceeds the wall time
    assert lag.ticks >= 1


def test_the_watch_names_a_long_native_call_on_a_thread_started_inside_it_with_its_exclusive_time() -> None:
    with NativeCallWatch(bound_ms=50) as watch:
        worker = threading.Thread(target=burn_native, args=(0.08,), name="burner")
        worker.start()
        worker.join()
    assert watch.calls and {(call.name, call.thread) for call in watch.calls} == {("builtins.sum", "burner")}
    assert watch.calls[-1].cpu_ms >= 80  # the last sum ran long enough


def test_the_watch_does_not_count_the_python_a_native_call_calls_back() -> None:
    def slow(item: int) -> int:
        burn_python(0.002)
        return item

    with NativeCallWatch(bound_ms=50) as watch:
        started = time.thread_time()
        assert list(map(slow, range(60))) == list(range(60))  # list() runs 120 ms of Python through map
        spent = time.thread_time() - started
    assert spent >= 0.12
    assert watch.calls == [] and watch.native_calls > 60


def test_the_watch_puts_back_the_profile_functions_it_found() -> None:
    import sys

    before = (sys.getprofile(), threading.getprofile())
    with NativeCallWatch() as watch:
        assert sys.getprofile() is not None
    assert (sys.getprofile(), threading.getprofile()) == before
    assert watch.native_calls > 0


async def test_the_ticker_ends_its_task() -> None:
    async with LoopTicker() as ticker:
        await asyncio.sleep(0)
    assert ticker.summary().ticks >= 1
    assert not [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
