"""The load-with-faults scenario at test size: 300 samples, ~5 % transient server faults, ~1 % env exceptions."""

from __future__ import annotations

from typing import Any

from load_with_faults import measure


async def test_load_with_faults_loses_nothing_and_matches_the_fault_free_run(tokenizer: Any) -> None:
    report = await measure(tokenizer, 300, seed=1, concurrency=32)
    assert report.lost == 0
    assert report.terminal == 300
    assert sum(report.server_faults.values()) > 0
    assert report.completed > 0
    assert report.identical == report.completed, report.mismatched
    assert report.failed_unexpected == []
    assert report.completed + report.env_faults == 300
    assert report.ok, "\n".join(report.lines())
