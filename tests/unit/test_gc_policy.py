"""gc_policy: full collections deferred while rollouts run, restored after the last one, freezes untouched."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from fsm_rollout import gc_policy


@pytest.fixture(autouse=True)
def clean_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_deferred_while_in_flight_and_restored_after() -> None:
    gc.set_threshold(700, 10, 10)
    assert not gc_policy.deferring()
    with gc_policy.rollouts_in_flight():
        assert gc_policy.deferring()
        assert gc.get_threshold() == (700, 10, 10 * gc_policy.FULL_GC_THRESHOLD_FACTOR)
    assert not gc_policy.deferring()
    assert gc.get_threshold() == (700, 10, 10)


def test_nested_rollouts_restore_only_when_the_last_one_ends() -> None:
    gc.set_threshold(500, 5, 7)
    gc_policy.rollout_started()
    gc_policy.rollout_started()
    gc_policy.rollout_ended()
    assert gc.get_threshold() == (500, 5, 7 * gc_policy.FULL_GC_THRESHOLD_FACTOR)
    gc_policy.rollout_ended()
    assert gc.get_threshold() == (500, 5, 7)


def test_restored_when_the_block_raises() -> None:
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), gc_policy.rollouts_in_flight():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_process_freeze_is_left_alone() -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    with gc_policy.rollouts_in_flight():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen  # not unfrozen by the policy


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
    assert gc.get_threshold()[2] == 10 * gc_policy.FULL_GC_THRESHOLD_FACTOR
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
        assert gc.get_threshold() == (1000, 20, 30 * gc_policy.FULL_GC_THRESHOLD_FACTOR)
    assert gc.get_threshold() == (1000, 20, 30)
