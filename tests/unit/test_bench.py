"""`fsm-rollout bench --quick` runs and writes its figures as JSON (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_rollout.cli import main


def test_quick_bench_writes_every_figure_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"machine", "turn"}
    assert {"shared_machine_transition_us", "dict_table_transition_us", "async_machine_transition_us"} <= set(
        figures["machine"]
    )
    assert {"turn_cpu_us_trace_off", "turn_cpu_us_trace_file", "machine_share_of_turn"} <= set(figures["turn"])
    assert all(value >= 0 for value in figures["machine"].values())
    assert "shared_machine_transition_us" in capsys.readouterr().out
