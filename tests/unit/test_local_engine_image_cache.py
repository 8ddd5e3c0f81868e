"""The embedded engine's memory of processed images and checked feature items stays bounded in entries and bytes."""

from __future__ import annotations

import pytest

from fsm_rollout.engine.local import images


def test_the_least_recently_used_entry_goes_first_when_the_count_is_reached() -> None:
    remembered = images._Remembered()
    for index in range(images._REMEMBERED + 1):
        remembered.remember(f"item {index}", index, 1)
        if index == 0:
            continue
        remembered.touch("item 0")  # kept fresh: the second oldest goes instead
    assert len(remembered) == images._REMEMBERED
    assert "item 0" in remembered and "item 1" not in remembered


def test_entries_go_when_their_bytes_pass_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "_REMEMBERED_BYTES", 100)
    remembered = images._Remembered()
    remembered.remember("a", 1, 40)
    remembered.remember("b", 2, 40)
    remembered.remember("c", 3, 40)
    assert list(remembered) == ["b", "c"]
    remembered.remember("huge", 4, 1_000)  # one entry over the budget alone is kept until the next one comes
    assert list(remembered) == ["huge"]
    remembered.remember("d", 5, 10)
    assert list(remembered) == ["d"]
