"""``fsm-rollout run``'s progress line and summary: queued samples apart, and an interrupt's three counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsm_rollout.cli.run import _progress_line, summary
from fsm_rollout.runtime.metrics import MetricsSnapshot


def snapshot(**values: Any) -> MetricsSnapshot:
    base: dict[str, Any] = {
        "occupancy": {},
        "in_flight": 0,
        "dwell_ms_mean": {},
        "statuses": {},
        "reasons": {},
        "samples_done": 0,
        "turns": 0,
        "tokens_generated": 0,
        "elapsed_s": 1.0,
        "samples_per_s": 0.0,
        "turns_per_s": 0.0,
        "tokens_per_s": 0.0,
    }
    return MetricsSnapshot(**{**base, **values})


def test_the_progress_line_shows_samples_waiting_for_a_slot_apart_from_the_states() -> None:
    line = _progress_line(snapshot(occupancy={"generating": 16}, in_flight=16, queued=56), 88)
    assert "generating=16 queued=56" in line
    assert "queued" not in _progress_line(snapshot(occupancy={"generating": 2}, in_flight=2), 2)


def test_an_interrupted_run_counts_finished_aborted_mid_way_and_never_started() -> None:
    interrupted = snapshot(samples_done=88, statuses={"completed": 16, "aborted": 72},
                           reasons={"env_done": 16, "cancelled": 16, "not_started": 56})  # fmt: skip
    text = summary(interrupted, total=88, skipped=0, out=Path("r.jsonl"), trace=None)
    first, second = text.splitlines()[:2]
    assert first.startswith("16/88 samples finished")
    assert second == "16 aborted mid-way, 56 never started"
    whole = summary(snapshot(samples_done=3, statuses={"completed": 3}, reasons={"env_done": 3}), total=3,
                    skipped=0, out=Path("r.jsonl"), trace=None)  # fmt: skip
    assert whole.startswith("3/3 samples finished") and "never started" not in whole


def test_the_engine_bench_reads_the_summary_line_it_times() -> None:
    from fsm_rollout.cli.bench.demo import _SUMMARY

    done = snapshot(samples_done=88, turns=252, tokens_generated=9387, elapsed_s=6.05, samples_per_s=14.5,
                    tokens_per_s=1551.6, statuses={"truncated": 88})  # fmt: skip
    found = _SUMMARY.search(summary(done, total=88, skipped=0, out=Path("r.jsonl"), trace=None))
    assert found is not None
    assert (found["done"], found["total"], found["wall"], found["tokens"], found["rate"]) == (
        "88", "88", "6.0", "9387", "1552"
    )  # fmt: skip
