"""gc_policy: the collector tuned while rollouts run (small young passes, no full ones), restored after the last one."""

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


def full_pass_allocations(thresholds: tuple[int, int, int]) -> int:
    """Net allocations between full collections: CPython collects a generation once its count exceeds its
    threshold."""
    young, middle, old = thresholds
    return young * (middle + 1) * (old + 1)


def test_tuned_while_in_flight_and_restored_after() -> None:
    gc.set_threshold(700, 10, 10)
    assert not gc_policy.tuning()
    with gc_policy.rollouts_in_flight():
        assert gc_policy.tuning()
        young, middle, old = gc.get_threshold()
        assert (young, middle) == (gc_policy.YOUNG_THRESHOLD, gc_policy.MIDDLE_THRESHOLD) == (300, 1)
        assert old == 14_116  # 700 * 11 * 11 * 100 net allocations between full passes, 600 per middle pass
    assert not gc_policy.tuning()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("saved", [(700, 10, 10), (500, 5, 7), (1000, 20, 30), (300, 1, 10), (2000, 0, 3)])
def test_a_full_pass_needs_the_factor_times_the_allocations(saved: tuple[int, int, int]) -> None:
    tuned = gc_policy.tuned_thresholds(saved)
    needed = full_pass_allocations(saved) * gc_policy.FULL_GC_THRESHOLD_FACTOR
    assert needed <= full_pass_allocations(tuned) < needed + tuned[0] * (tuned[1] + 1)


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
