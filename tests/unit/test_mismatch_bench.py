"""The mismatch bench's synthetic batch goes through every span-labelled event the issue's workload has: a resume
between two weight versions, routes from two requests within a turn, an observation between two turns."""

from __future__ import annotations

import pytest

from fsm_rollout import mismatch
from fsm_rollout.cli.bench.mismatch import synthetic_batch
from fsm_rollout.cli.bench.suite import print_table


def test_the_synthetic_batch_has_resumed_tokens_and_changed_routes() -> None:
    samples, trainer = synthetic_batch(16, 100)
    report = mismatch(samples, trainer, trainer_version="5")
    groups = {(group.dimension, group.label): group for group in report.events}
    trained = sum(sum(sample.loss_mask or []) for sample in samples)
    assert report.tokens == trained == 16 * 90
    assert groups["resume", "after_resume"].tokens == 16 * 40  # from the cut at 60 to the end
    assert groups["version", "4 -> 5 (staleness 1)"].staleness == 1
    # the second turn (positions 50-99) spans both requests' routes; the first (0-39) only the first's
    assert groups["routes", "routes_changed"].tokens == 16 * 50
    assert groups["routes", "routes_kept"].tokens == 16 * 40
    assert 0 < report.k3 < 1e-3


def test_the_table_prints_tiny_figures_in_scientific_notation(capsys: pytest.CaptureFixture[str]) -> None:
    print_table({"mismatch": {"plain_k3": 1.25e-7, "speed_mismatch_s": 1.5, "zero": 0.0}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["plain_k3", "1.250e-07"]  # 0.000 at three decimals
    assert lines[2].split() == ["speed_mismatch_s", "1.500"]
    assert lines[3].split() == ["zero", "0.000"]
