"""gc_policy: the collector tuned while rollouts run (small young passes, full ones deferred), restored after."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from fsm_rollout.runtime import gc_policy


@pytest.fixture(autouse=True)
def clean_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_tuned_while_in_flight_and_restored_after() -> None:
    gc.set_threshold(700, 10, 10)
    assert not gc_policy.tuning()
    with gc_policy.rollouts_in_flight():
        assert gc_policy.tuning()
        young, middle, old = gc.get_threshold()
        assert (young, middle) == (gc_policy.YOUNG_THRESHOLD, gc_policy.MIDDLE_THRESHOLD) == (300, 1)
        assert old == 10_324  # 301 * (3 * 10_325 + 1) >= 100 * 701 * (12 * 11 + 1) net allocations per full pass
    assert not gc_policy.tuning()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize(
    "saved", [(700, 10, 10), (2000, 10, 10), (500, 5, 7), (1000, 20, 30), (300, 1, 10), (2000, 0, 3), (1, 0, 0)]
)
def test_a_full_pass_needs_the_factor_times_the_allocations(saved: tuple[int, int, int]) -> None:
    tuned = gc_policy.tuned_thresholds(saved)
    needed = gc_policy.full_pass_allocations(saved) * gc_policy.FULL_GC_THRESHOLD_FACTOR
    one_middle_period = (tuned[0] + 1) * (tuned[1] + 2)
    assert needed <= gc_policy.full_pass_allocations(tuned) < needed + one_middle_period


PERIOD = """
import gc, sys
gc.collect()
gc.set_threshold(*map(int, sys.argv[1:4]))
starts, allocated, keep = [], 0, []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and starts.append(allocated))
while len(starts) < 3:
    keep.append([])
    allocated += 1
print(starts[2] - starts[1], starts[1] - starts[0])
"""


@pytest.mark.skipif(not gc_policy._GENERATIONAL, reason="CPython's generational collector (3.11-3.13) only")
@pytest.mark.parametrize("thresholds", [(300, 1, 20), (700, 10, 10), (2000, 0, 3), (50, 2, 40)])
def test_the_full_pass_period_is_what_this_cpython_does(thresholds: tuple[int, int, int]) -> None:
    """The arithmetic checked against the running interpreter: the net allocations between full passes, counted
    in a fresh one (its small heap keeps the promoted-quarter condition from deferring them)."""
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PERIOD, *map(str, thresholds)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = gc_policy.full_pass_allocations(thresholds)
    for period in map(int, run.stdout.split()):
        assert expected - 2 <= period <= expected  # the callbacks' own argument tuples count too


def test_odd_thresholds_are_left_alone() -> None:
    gc.set_threshold(700, -1, 10)
    with gc_policy.rollouts_in_flight():
        assert gc.get_threshold() == (700, -1, 10)
        assert not gc_policy.tuning()
    assert gc.get_threshold() == (700, -1, 10)


def test_huge_thresholds_of_the_process_stay_within_what_the_collector_takes() -> None:
    gc.set_threshold(1_000_000, 1000, 1000)
    with gc_policy.rollouts_in_flight():
        assert gc.get_threshold() == (300, 1, 2**31 - 1)
    assert gc.get_threshold() == (1_000_000, 1000, 1000)


def test_lower_young_thresholds_of_the_process_are_kept() -> None:
    assert gc_policy.tuned_thresholds((100, 0, 10))[:2] == (100, 0)
    assert gc_policy.tuned_thresholds((200, 5, 10))[:2] == (200, 1)


def test_collection_turned_off_by_a_zero_threshold_stays_off() -> None:
    gc.set_threshold(0, 10, 10)
    with gc_policy.rollouts_in_flight():
        assert gc.get_threshold() == (0, 10, 10)
    assert gc.get_threshold() == (0, 10, 10)


def test_the_incremental_collector_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_policy, "_GENERATIONAL", False)
    gc.set_threshold(700, 10, 10)
    with gc_policy.rollouts_in_flight():
        assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_nested_rollouts_restore_only_when_the_last_one_ends() -> None:
    gc.set_threshold(500, 5, 7)
    gc_policy.rollout_started()
    gc_policy.rollout_started()
    gc_policy.rollout_ended()
    assert gc.get_threshold() == gc_policy.tuned_thresholds((500, 5, 7))
    gc_policy.rollout_ended()
    assert gc.get_threshold() == (500, 5, 7)


def test_restored_when_the_block_raises() -> None:
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), gc_policy.rollouts_in_flight():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_process_freeze_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # the policy never unfreezes (the frozen count itself may drop in a long run: a frozen object freed by another
    # test's leftover thread leaves the permanent generation, so it is no measure of the policy)
    unfrozen: list[bool] = []
    monkeypatch.setattr(gc, "unfreeze", lambda: unfrozen.append(True))
    gc.freeze()
    with gc_policy.rollouts_in_flight():
        assert gc.get_freeze_count() > 0
    assert unfrozen == [] and gc.get_freeze_count() > 0


def test_rollouts_on_several_threads_share_one_count() -> None:
    gc.set_threshold(700, 10, 10)
    inside = threading.Barrier(4)
    leave = threading.Event()

    def rollout() -> None:
        with gc_policy.rollouts_in_flight():
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=rollout) for _ in range(3)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert gc.get_threshold() == gc_policy.tuned_thresholds((700, 10, 10))
    leave.set()
    for thread in threads:
        thread.join()
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_set_while_rollouts_run_are_kept() -> None:
    gc.set_threshold(700, 10, 10)
    with gc_policy.rollouts_in_flight():
        gc.set_threshold(1000, 20, 30)  # the process's own choice, made meanwhile
    assert gc.get_threshold() == (1000, 20, 30)
    with gc_policy.rollouts_in_flight():
        assert gc.get_threshold() == gc_policy.tuned_thresholds((1000, 20, 30))
    assert gc.get_threshold() == (1000, 20, 30)


def test_an_end_without_a_start_is_ignored() -> None:
    gc.set_threshold(700, 10, 10)
    gc_policy.rollout_ended()
    with gc_policy.rollouts_in_flight():
        assert gc_policy.tuning()
    assert gc.get_threshold() == (700, 10, 10)
    assert not gc_policy.tuning()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_while_rollouts_run_gets_the_collector_back() -> None:
    gc.set_threshold(700, 10, 10)
    read, write = os.pipe()
    with gc_policy.rollouts_in_flight():
        pid = os.fork()
        if pid == 0:  # the child: report what it sees, then leave without running the parent's cleanup
            os.write(write, repr((gc.get_threshold(), gc_policy.tuning())).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            seen = pipe.read()
        os.waitpid(pid, 0)
        assert gc_policy.tuning()  # the parent's rollouts are still running
    assert seen == repr(((700, 10, 10), False))
    assert gc.get_threshold() == (700, 10, 10)
