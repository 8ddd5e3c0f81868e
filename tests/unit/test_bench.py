"""`fsm-rollout bench --quick` runs and writes its figures as JSON (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout.cli import main

SECTIONS = {
    "machine",
    "turn",
    "client_http",
    "scale",
    "tracing",
    "replay",
    "baseline",
    "weight_update",
    "slow_env",
    "images",
    "goals",
}
GOALS = {
    "machine_share_of_client_turn_cpu",
    "client_cpu_us_per_turn_excl_template",
    "kib_per_inflight_sample",
    "loop_lag_p99_ms",
    "time_ratio_big_vs_small",
    "tracing_overhead",
    "replay_turns_per_s",
    "weight_update_tokens_thrown_away",
    "weight_update_suspend_ms",
    "weight_update_resume_to_all_resent_ms",
    "weight_update_abort_calls_per_engine",
    "slow_env_thread_loop_lag_p99_ms",
    "slow_env_thread_wall_beyond_sleep_free_s",
    "slow_env_async_loop_lag_p99_ms",
    "slow_env_async_wall_beyond_sleep_free_s",
    "image_observation_client_cpu_ms",
    "render_calls_per_image_observation",
}
WEIGHT_UPDATE_GOALS = {name for name in GOALS if name.startswith("weight_update_")}
SLOW_ENV_GOALS = {name for name in GOALS if name.startswith("slow_env_")}
IMAGE_GOALS = {"image_observation_client_cpu_ms", "render_calls_per_image_observation"}


def test_quick_bench_writes_every_figure_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == SECTIONS
    assert {
        "shared_machine_transition_us",
        "plain_transitions_machine_transition_us",
        "dict_table_transition_us",
        "async_machine_transition_us",
        "interleaved_transition_us",
    } <= set(figures["machine"])
    breakdown = {name: value for name, value in figures["client_http"].items() if name.startswith("breakdown_")}
    assert set(breakdown) == {
        "breakdown_machine_us",
        "breakdown_observation_tokens_us",
        "breakdown_tokenizer_decode_us",
        "breakdown_rest_of_rollout_us",
        "breakdown_json_us",
        "breakdown_http_and_event_loop_us",
    }
    assert all(value >= 0 for value in breakdown.values())
    assert figures["client_http"]["json_decode_and_parse_answer_us"] > 0
    assert {"turn_cpu_us_trace_off", "turn_cpu_us_trace_file", "machine_share_of_turn"} <= set(figures["turn"])
    assert {
        "time_ratio",
        "200_wall_s",
        "1000_wall_s",
        "1000_peak_rss_mib",
        "1000_kib_per_sample_beyond_tokens",
        "1000_loop_lag_p99_ms",
    } <= set(figures["scale"])
    assert {
        "overhead",
        "overhead_http_direct",
        "cpu_us_per_turn_off",
        "cpu_us_per_turn_file",
        "cpu_us_per_turn_file_least",
        "cpu_us_per_turn_file_greatest",
        "in_process_us_per_turn",
    } <= set(figures["tracing"])
    tracing, client = figures["tracing"], figures["client_http"]
    assert tracing["cpu_us_per_turn_file_least"] <= tracing["cpu_us_per_turn_file"]
    assert tracing["cpu_us_per_turn_file"] <= tracing["cpu_us_per_turn_file_greatest"]
    assert client["cpu_us_per_turn_least"] <= client["cpu_us_per_turn"] <= client["cpu_us_per_turn_greatest"]
    assert {
        "1000_full_gc_count",
        "1000_server_cpu_s",
        "200_wall_s_least",
        "1000_wall_s_greatest",
        "loop_lag_p99_ms_greatest",
        "time_ratio_of_median_walls",
    } <= set(figures["scale"])
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


def test_weight_update_workload_loses_nothing_with_suspend_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--only weight-update`, small: today's abort throws the partial turns away and loses every sample; suspend
    and resume keep every token the server produced, exactly, with one abort call (timings are not asserted)."""
    out = tmp_path / "weights.json"
    samples = 20
    assert (
        main(
            ["bench", "--only", "weight-update", "--quick", "--weight-update-samples", str(samples), "--json", str(out)]
        )
        == 0
    )
    figures = json.loads(out.read_text())
    assert set(figures) == {"weight_update", "goals"}
    assert set(figures["goals"]) == WEIGHT_UPDATE_GOALS
    weights = figures["weight_update"]
    assert all(isinstance(value, float) and math.isfinite(value) for value in weights.values())
    partial = weights["partial_tokens_per_request"]
    assert weights["samples"] == samples and partial > 0

    assert weights["today_held_requests"] == samples
    assert weights["today_tokens_thrown_away"] == samples * partial > 0
    assert weights["today_tokens_kept"] == 0
    assert weights["today_samples_lost"] == samples and weights["today_samples_completed"] == 0
    assert weights["today_abort_calls"] == samples  # one per rollout

    assert weights["suspend_resume_held_requests"] == samples
    assert weights["suspend_resume_requests_in_flight_at_suspend"] == samples
    assert weights["suspend_resume_in_flight_after_suspend"] == 0
    assert weights["suspend_resume_tokens_produced"] > 0
    assert weights["suspend_resume_tokens_thrown_away"] == 0
    assert weights["suspend_resume_tokens_kept"] == weights["suspend_resume_tokens_produced"]
    assert weights["suspend_resume_samples_not_as_produced"] == 0
    assert weights["suspend_resume_samples_completed"] == samples and weights["suspend_resume_samples_lost"] == 0
    assert weights["suspend_resume_abort_calls"] == 1 and weights["suspend_resume_abort_calls_client"] == 1
    assert {"bare_client_abort_to_all_answered_ms", "bare_client_send_to_all_arrived_ms"} <= set(weights)
    goals = figures["goals"]
    assert goals["weight_update_tokens_thrown_away"]["met"] and goals["weight_update_abort_calls_per_engine"]["met"]
    assert "[weight_update]" in capsys.readouterr().out


def test_slow_environment_workload_runs_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--only slow-env --quick`: every case completes its samples and reports wall and loop lag (not asserted)."""
    out = tmp_path / "envs.json"
    assert main(["bench", "--only", "slow-env", "--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"slow_env", "goals"} and set(figures["goals"]) == SLOW_ENV_GOALS
    slow = figures["slow_env"]
    assert slow["samples"] == 200 and slow["inline_samples"] == 40
    for mode in ("none", "thread", "async", "inline"):
        assert slow[f"{mode}_wall_s"] > 0 and slow[f"{mode}_loop_lag_p99_ms"] >= 0
    # two steps of 50 ms each: a batch whose steps block the loop takes at least its samples' steps end to end
    assert slow["inline_wall_s"] >= slow["inline_samples"] * slow["turns"] * slow["step_ms"] / 1000
    assert "[slow_env]" in capsys.readouterr().out


def test_image_workload_reports_cpu_render_calls_and_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--only images --quick`: every figure is there; one render per image observation (timings not asserted)."""
    out = tmp_path / "images.json"
    assert main(["bench", "--only", "images", "--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"images", "goals"} and set(figures["goals"]) == IMAGE_GOALS
    images = figures["images"]
    assert images["image_side_px"] == 448 and images["render_calls_per_image_observation"] == 1
    assert figures["goals"]["render_calls_per_image_observation"]["met"]
    # four images of 1,024 float32 patch rows of 1,176 values each, as base64 text: at least their raw size
    assert images["kib_per_sample_with_four_images"] >= 4 * 1024 * 1176 * 4 / 1024
    assert all(images[name] > 0 for name in ("client_cpu_ms_per_image_observation", "answer_parse_ms"))
    assert "[images]" in capsys.readouterr().out


def canned_results(*, lag_ms: float) -> dict[str, dict[str, Any]]:
    met = {"figure": 3.0, "target": "<= 5 ms", "met": True}
    missed = {"figure": lag_ms, "target": "<= 50 ms", "met": lag_ms <= 50}
    return {"machine": {"shared_machine_transition_us": 1.0}, "goals": {"suspend_ms": met, "loop_lag_p99_ms": missed}}


@pytest.mark.parametrize("quick", [True, False])
def test_check_exits_1_naming_each_missed_goal_under_the_targets_that_apply(
    quick: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lag = {"ms": 72.5}
    monkeypatch.setattr("fsm_rollout.cli.bench.suite.run_all", lambda *args, **kwargs: canned_results(lag_ms=lag["ms"]))
    profile = ["--quick"] if quick else []
    assert main(["bench", *profile, "--check"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "goal missed: loop_lag_p99_ms: 72.500 (target <= 50 ms)\n"
    assert re.search(r"loop_lag_p99_ms +72\.500 +<= 50 ms +MISSED", captured.out)
    targets = "targets of the --quick profile" if quick else "targets of a full run, as in the README"
    assert targets in captured.out
    assert (
        "time_ratio_big_vs_small is held to <= 5.25 (the README's <= 10.5)" in " ".join(captured.out.split())
    ) == quick

    assert main(["bench", *profile]) == 0  # without --check a miss is reported, not failed
    assert "goal missed: loop_lag_p99_ms" in capsys.readouterr().err
    lag["ms"] = 12.0
    assert main(["bench", *profile, "--check"]) == 0
    assert capsys.readouterr().err == ""
