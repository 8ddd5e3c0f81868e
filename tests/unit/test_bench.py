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
    assert {"shared_machine_transition_us", "plain_transitions_machine_transition_us", "dict_table_transition_us",
            "async_machine_transition_us", "interleaved_transition_us"} <= set(figures["machine"])
    breakdown = {name: value for name, value in figures["client_http"].items() if name.startswith("breakdown_")}
    assert set(breakdown) == {"breakdown_machine_us", "breakdown_observation_tokens_us",
                              "breakdown_tokenizer_decode_us", "breakdown_rest_of_rollout_us", "breakdown_json_us",
                              "breakdown_http_and_event_loop_us"}
    assert all(value >= 0 for value in breakdown.values())
    assert figures["client_http"]["json_decode_and_parse_answer_us"] > 0
    assert {"turn_cpu_us_trace_off", "turn_cpu_us_trace_file", "machine_share_of_turn"} <= set(figures["turn"])
    assert {"time_ratio", "200_wall_s", "1000_wall_s", "1000_peak_rss_mib", "1000_kib_per_sample_beyond_tokens",
            "1000_loop_lag_p99_ms"} <= set(figures["scale"])
    assert {"overhead", "overhead_http_direct", "cpu_us_per_turn_off", "cpu_us_per_turn_file",
            "cpu_us_per_turn_file_least", "cpu_us_per_turn_file_greatest",
            "in_process_us_per_turn"} <= set(figures["tracing"])
    tracing, client = figures["tracing"], figures["client_http"]
    assert tracing["cpu_us_per_turn_file_least"] <= tracing["cpu_us_per_turn_file"]
    assert tracing["cpu_us_per_turn_file"] <= tracing["cpu_us_per_turn_file_greatest"]
    assert client["cpu_us_per_turn_least"] <= client["cpu_us_per_turn"] <= client["cpu_us_per_turn_greatest"]
    assert {"1000_full_gc_count", "1000_server_cpu_s", "200_wall_s_least", "1000_wall_s_greatest",
            "loop_lag_p99_ms_greatest", "time_ratio_of_median_walls"} <= set(figures["scale"])
    scale = figures["scale"]
    assert scale["time_ratio_pair_least"] <= scale["time_ratio"] <= scale["time_ratio_pair_greatest"]
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
