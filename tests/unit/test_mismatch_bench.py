"""The mismatch bench's synthetic batch goes through every span-labelled event the issue's workload has: a resume
between two weight versions, routes from two requests within a turn, an observation between two turns."""

from __future__ import annotations

from fsm_rollout import mismatch
from fsm_rollout.cli.bench.mismatch import synthetic_batch


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
