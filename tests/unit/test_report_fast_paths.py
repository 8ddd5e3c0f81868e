"""The report's fast paths give what the plain code they replaced gave: the edge index against a scan of the
table, whole-array rounding against ``round``, run lengths against a loop, and the script-safe JSON against a
per-character translation. Each reference below is the code as it was before it was made fast."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from fsm_rollout.machine import diagrams, lifecycle, overlays
from fsm_rollout.report import detail
from fsm_rollout.report.page import json_for_script


def scanned_edge(event: Mapping[str, Any], transitions: Sequence[lifecycle.Edge]) -> int | None:
    """The edge a transition took, found by scanning the whole table."""
    candidates = [
        index
        for index, edge in enumerate(transitions)
        if (edge.trigger, edge.source, edge.dest) == (event.get("trigger"), event.get("src"), event.get("dst"))
    ]
    reason = event.get("reason")
    if len(candidates) > 1 and any(transitions[index].reason == reason for index in candidates):
        candidates = [index for index in candidates if transitions[index].reason == reason]
    if len(candidates) > 1:
        with_evidence = [index for index in candidates if transitions[index].guard in overlays._GUARD_EVIDENCE]
        for index in with_evidence:
            if event.get(overlays._GUARD_EVIDENCE[str(transitions[index].guard)]) is True:
                return index
        candidates = [index for index in candidates if index not in with_evidence] or candidates
    return candidates[-1] if candidates else None


def varied_events(count: int, seed: int) -> list[dict[str, Any]]:
    """Transition events drawn from the table's own names and a few others, with every reason the table has and
    some it has not, evidence fields true, false, missing or not a bool, and fields of the wrong type."""
    rng = random.Random(seed)
    edges = lifecycle.TRANSITIONS
    states = sorted({edge.source for edge in edges} | {edge.dest for edge in edges} | {"nowhere"})
    triggers = sorted({edge.trigger for edge in edges} | {"teleport"})
    reasons = sorted({str(edge.reason) for edge in edges if edge.reason} | {"cancelled", "error", "made-up"})
    events = []
    for _ in range(count):
        if rng.random() < 0.7:  # mostly real edges, where the candidates are several
            edge = rng.choice(edges)
            event: dict[str, Any] = {"trigger": edge.trigger, "src": edge.source, "dst": edge.dest}
        else:
            event = {"trigger": rng.choice(triggers), "src": rng.choice(states), "dst": rng.choice(states)}
        roll = rng.random()
        if roll < 0.6:
            event["reason"] = rng.choice(reasons)
        elif roll < 0.7:
            event["reason"] = None
        for field in overlays._GUARD_EVIDENCE.values():
            event[field] = rng.choice([True, False, 1, "true", None])
        if rng.random() < 0.05:
            event[rng.choice(["trigger", "src", "dst"])] = rng.choice([None, 3, ["step"], {"a": 1}])
        events.append(event)
    return events


def test_the_edge_index_matches_as_the_table_scan_did() -> None:
    events = varied_events(20_000, seed=7)
    index = diagrams.EdgeIndex(lifecycle.TRANSITIONS)
    matched = [index.match(event) for event in events]
    assert matched == [scanned_edge(event, lifecycle.TRANSITIONS) for event in events]
    # the draw reaches edges that share trigger, source and destination, and events of no edge
    assert None in matched and len(set(matched)) > len(lifecycle.TRANSITIONS) // 2
    assert [diagrams.match_edge(event, lifecycle.TRANSITIONS) for event in events[:500]] == matched[:500]


def bits(values: Sequence[float]) -> list[bytes]:
    return [struct.pack("<d", value) for value in values]  # tells -0.0 from 0.0 and compares NaN


def test_rounding_whole_arrays_gives_what_round_gives() -> None:
    rng = random.Random(3)
    values: list[Any] = [-rng.expovariate(rng.choice([0.1, 2.0, 50.0])) for _ in range(50_000)]
    values += [rng.uniform(-1e6, 1e6) for _ in range(5_000)]
    values += [(2 * rng.randrange(-(10**6), 10**6) + 1) / 20_000 for _ in range(5_000)]  # halves: ties and near-ties
    values += [math.nextafter(value, math.inf) for value in values[-5_000:]]
    values += [1 / 32, -1 / 32, 0.00005, -0.00005, 0.0, -0.0, -0.00003, 1e300, -1e20, 2.0**60 + 0.5]
    values += [math.inf, -math.inf, math.nan, 0, -3, True, 7]  # ints and bools as float() takes them
    expected = [round(float(value), 4) for value in values]
    assert bits(detail.round_all(values, 4)) == bits(expected)
    assert bits(detail.round_all(values[:1000], 2)) == bits([round(float(value), 2) for value in values[:1000]])
    assert detail.round_all([], 4) == []


def looped_run_lengths(values: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([int(value), 1])
    return runs


def test_run_lengths_are_the_loops() -> None:
    rng = random.Random(5)
    for _ in range(200):
        values = [rng.choice([0, 1]) for _ in range(rng.randrange(0, 40))]
        assert [list(run) for run in detail._run_lengths(values)] == looped_run_lengths(values)


def test_script_json_escapes_as_the_translation_did() -> None:
    escapes = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}
    value = {"text": "</script><img src=x onerror=alert(1)> & &amp; <!-- \u2028 é", 3: ["<", ">", "&", 0.5]}
    translated = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode().translate(escapes)
    assert json_for_script(value) == translated
    assert "<" not in translated and ">" not in translated and "&" not in translated


def test_a_one_member_group_is_never_zero_variance() -> None:
    """A gateway run's sessions are one-member groups (``4.0``): no variance to speak of, so not counted."""
    from types import SimpleNamespace

    from fsm_rollout.report.model import group_rewards

    paths = [SimpleNamespace(sample_id=sample_id) for sample_id in ("0.0", "1.0", "1.1", "2.0", "2.1")]
    rows = [{"reward": 1.0}, {"reward": 0.5}, {"reward": 0.5}, {"reward": 1.0}, {"reward": 0.0}]
    groups = {group["group"]: group for group in group_rewards(paths, rows)}
    assert (groups["0"]["members"], groups["0"]["zero_variance"]) == (1, False)
    assert (groups["1"]["members"], groups["1"]["zero_variance"]) == (2, True)
    assert (groups["2"]["members"], groups["2"]["zero_variance"]) == (2, False)
