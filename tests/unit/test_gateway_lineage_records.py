"""How lineages and compactions are recorded: a compacted rewrite in a tape's step, and a session's runs grouped by
lineage for ``inspect`` and the report."""

from __future__ import annotations

from fsm_rollout.envs.step import NextCall, Rewrite, StepResult
from fsm_rollout.replay.paths import TracedPath, lineage_groups, lineage_of


def _step(rewrite: Rewrite) -> StepResult:
    return StepResult([{"role": "user", "content": "x"}], next_call=NextCall(sampling={}, rewrite=rewrite))


def test_a_compacted_rewrite_round_trips_and_a_plain_one_is_written_as_before() -> None:
    compacted = _step(Rewrite(({"role": "user", "content": "x"},), None, "messages[1] (user) differs", compacted=True))
    written = compacted.to_json()
    assert written["next_call"]["rewrite"]["compacted"] is True
    assert StepResult.from_json(written) == compacted
    plain = _step(Rewrite(({"role": "user", "content": "x"},), None, "the tools changed"))
    assert "compacted" not in plain.to_json()["next_call"]["rewrite"]  # older tapes and new ones read alike
    assert StepResult.from_json(plain.to_json()).next_call.rewrite.compacted is False  # type: ignore[union-attr]


def _path(sample_id: str, *reasons: str) -> TracedPath:
    forks = [{"trigger": "fork", "src": "observing", "dst": "rendered", "reason": reason} for reason in reasons]
    return TracedPath(sample_id, "s", [{"trigger": "render", "src": "pending", "dst": "rendered"}, *forks])


def test_a_sessions_runs_are_grouped_by_lineage() -> None:
    assert lineage_of("7.0.l2") == ("7.0", "l2")
    assert lineage_of("7.0") == ("7.0", "l0")
    assert lineage_of("7.level") == ("7.level", "l0")  # not a lineage suffix
    paths = [_path("3.0", "compacted"), _path("3.0.l1", "history_rewritten", "history_rewritten"), _path("4.0")]
    assert lineage_groups(paths) == [
        {
            "session": "3.0",
            "lineages": [
                {"lineage": "l0", "runs": 1, "sequences": 2, "forks": {"compacted": 1}},
                {"lineage": "l1", "runs": 1, "sequences": 3, "forks": {"history_rewritten": 2}},
            ],
        }
    ]
    assert lineage_groups([_path("4.0"), _path("5.0", "history_rewritten")]) is None
