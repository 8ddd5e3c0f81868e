"""`fsm-rollout bench --quick` runs and writes its figures as JSON (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fsm_rollout.cli import main

SECTIONS = {"machine", "turn", "client_http", "scale", "tracing", "replay", "baseline", "goals"}
GOALS = {
    "machine_share_of_client_turn_cpu",
    "client_cpu_us_per_turn_excl_template",
    "kib_per_inflight_sample",
    "loop_lag_p99_ms",
    "time_ratio_big_vs_small",
    "tracing_overhead",
    "replay_turns_per_s",
}


def test_quick_bench_writes_every_figure_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == SECTIONS
    assert {"shared_machine_transition_us", "dict_table_transition_us", "async_machine_transition_us"} <= set(
        figures["machine"]
    )
    assert {"turn_cpu_us_trace_off", "turn_cpu_us_trace_file", "machine_share_of_turn"} <= set(figures["turn"])
    assert {"time_ratio", "200_wall_s", "1000_wall_s", "1000_peak_rss_mib", "1000_kib_per_sample_beyond_tokens",
            "1000_loop_lag_p99_ms"} <= set(figures["scale"])
    assert {"overhead", "cpu_us_per_turn_off", "cpu_us_per_turn_file"} <= set(figures["tracing"])
    assert figures["replay"]["turns_executed"] > 0 and "turns_per_s" in figures["replay"]
    assert {"baseline_cpu_us_per_turn", "ours_vs_baseline_cpu"} <= set(figures["baseline"])
    assert set(figures["goals"]) == GOALS
    for goal in figures["goals"].values():
        assert set(goal) == {"figure", "target", "met"} and isinstance(goal["met"], bool)
    for section, values in figures.items():
        if section == "goals":
            continue
        assert all(isinstance(value, float) and math.isfinite(value) for value in values.values()), section
    assert all(value >= 0 for value in figures["machine"].values())
    printed = capsys.readouterr().out
    assert "shared_machine_transition_us" in printed and "[goals]" in printed
