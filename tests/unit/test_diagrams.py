"""Generated lifecycle diagrams: complete, deterministic, checked for staleness, and able to draw a recorded run."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout.cli import diagram as diagram_cli
from fsm_rollout.cli import main as cli_main
from fsm_rollout.machine import diagrams, lifecycle, overlays

REPO = Path(__file__).resolve().parents[2]
MERMAID_EDGE = re.compile(r"^    (\w+) --> (\w+) : (.*)$", re.MULTILINE)
DOT_EDGE = re.compile(r"^    (\w+) -> (\w+) \[(.*)\];$", re.MULTILINE)
# In CI (where .ci/run installs Graphviz) a missing dot fails these tests instead of skipping them.
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None and not os.environ.get("CI"), reason="Graphviz `dot` is not installed"
)


def expected_guard_labels() -> dict[int, str]:
    """Each edge's guard label, spelled out from the table: numbered when a trigger has several edges."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, edge in enumerate(lifecycle.TRANSITIONS):
        groups[(edge.trigger, edge.source)].append(index)
    labels = {}
    for indices in groups.values():
        for position, index in enumerate(indices, start=1):
            guard = lifecycle.TRANSITIONS[index].guard
            if len(indices) == 1:
                labels[index] = f"[{guard}]" if guard else ""
            else:
                labels[index] = f"[{position}. {guard}]" if guard else "[else]"
    return labels


def add_fake_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = lifecycle.Edge("retry", "generating", "rendered", guard="retry_allowed")
    monkeypatch.setattr(lifecycle, "TRANSITIONS", (*lifecycle.TRANSITIONS, extra))


def fake_checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's generated files (and what marks a checkout) in ``tmp_path``."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "fsm-rollout"\n')
    (tmp_path / "fsm_rollout" / "machine").mkdir(parents=True)
    (tmp_path / "fsm_rollout" / "machine" / "lifecycle.py").write_text("")
    for name in (
        "README.md",
        "docs/cli.md",
        "diagrams/lifecycle.mmd",
        "diagrams/lifecycle.dot",
        "diagrams/lifecycle.svg",
        "diagrams/gateway_session.mmd",
        "diagrams/gateway_session.dot",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, tmp_path / name)
    return tmp_path


def hide_graphviz(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "dot" else real_which(name))


# ------------------------------------------------------------------------------------------------------ Mermaid


def test_mermaid_is_a_state_diagram_with_every_state() -> None:
    text = diagrams.mermaid()
    assert text.splitlines()[1] == "stateDiagram-v2"
    mentioned = set(re.findall(r"\w+", text))
    assert {state.name for state in lifecycle.STATES} <= mentioned


def test_mermaid_draws_every_edge_with_trigger_and_guard_in_evaluation_order() -> None:
    drawn = MERMAID_EDGE.findall(diagrams.mermaid())
    table_edges = [edge for edge in drawn if edge[1] != "[*]"]
    guard_labels = expected_guard_labels()
    assert len(table_edges) == len(lifecycle.TRANSITIONS)
    for index, (edge, (source, dest, label)) in enumerate(zip(lifecycle.TRANSITIONS, table_edges, strict=True)):
        assert (source, dest) == (edge.source, edge.dest)
        assert label.startswith(f"{edge.trigger} {guard_labels[index]}".rstrip())
    assert "generating --> aborted : step [1. server_aborted] reason=server_abort" in diagrams.mermaid()
    assert "generating --> stepping : step [else]" in diagrams.mermaid()


def test_mermaid_shows_the_reason_on_every_terminal_edge_that_has_one() -> None:
    text = diagrams.mermaid()
    for edge in lifecycle.TRANSITIONS:
        if edge.reason:
            assert re.search(
                rf"{edge.source} --> {edge.dest} : {re.escape(edge.trigger)} .*reason={edge.reason}$",
                text,
                re.MULTILINE,
            ), edge


def test_mermaid_marks_the_initial_state_and_only_terminal_states_final() -> None:
    text = diagrams.mermaid()
    assert f"    [*] --> {lifecycle.INITIAL}\n" in text
    finals = set(re.findall(r"^    (\w+) --> \[\*\]$", text, re.MULTILINE))
    assert finals == set(lifecycle.TERMINAL)


def test_mermaid_labels_avoid_characters_that_end_a_mermaid_label() -> None:
    for _source, _dest, label in MERMAID_EDGE.findall(diagrams.mermaid()):
        assert not set(label) & {":", ";"}, label


# ----------------------------------------------------------------------------------------------------- Graphviz


def test_dot_declares_every_state_and_marks_terminal_states_final() -> None:
    text = diagrams.dot()
    for state in lifecycle.STATES:
        line = re.search(rf"^ +{state.name} \[(.*)\];$", text, re.MULTILINE)
        assert line, state.name
        assert ('peripheries="2"' in line.group(1)) == state.terminal, state.name


def test_dot_marks_the_initial_state() -> None:
    assert f"    __start__ -> {lifecycle.INITIAL};" in diagrams.dot()


def test_dot_draws_each_guarded_edge_with_its_order_and_reason() -> None:
    drawn = DOT_EDGE.findall(diagrams.dot())
    guard_labels = expected_guard_labels()
    grouped = {index for group in diagrams.catch_all_groups(lifecycle.TRANSITIONS) for index in group}
    for index, edge in enumerate(lifecycle.TRANSITIONS):
        if index in grouped:
            continue
        head = f"{edge.trigger} {guard_labels[index]}".rstrip()
        matches = [
            attrs
            for source, dest, attrs in drawn
            if (source, dest) == (edge.source, edge.dest) and attrs.startswith(f"label=<{head}")
        ]
        assert len(matches) == 1, edge
        if edge.reason:
            assert f"reason={edge.reason}" in matches[0]


def test_abort_fail_and_the_rollout_timeout_are_one_edge_each_from_the_box_of_non_terminal_states() -> None:
    text = diagrams.dot()
    groups = diagrams.catch_all_groups(lifecycle.TRANSITIONS)
    assert {lifecycle.TRANSITIONS[group[0]].trigger for group in groups} == {"abort", "fail", "rollout_timeout"}
    box = re.search(r"subgraph cluster_non_terminal \{(.*?)\n    \}", text, re.DOTALL)
    assert box
    assert set(re.findall(r"^        (?!graph )(\w+) \[", box.group(1), re.MULTILINE)) == set(lifecycle.NON_TERMINAL)
    for trigger, dest in (("abort", "aborted"), ("fail", "failed"), ("rollout_timeout", "truncated")):
        edges = [attrs for _source, edge_dest, attrs in DOT_EDGE.findall(text) if f"label=<{trigger} (" in attrs]
        assert len(edges) == 1 and 'ltail="cluster_non_terminal"' in edges[0], trigger
        assert re.search(rf"-> {dest} \[label=<{trigger} \(from any state in the box\)", text)


def test_a_state_that_loses_its_abort_edge_gets_its_abort_edges_drawn_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = tuple(edge for edge in lifecycle.TRANSITIONS if (edge.trigger, edge.source) != ("abort", "rendered"))
    monkeypatch.setattr(lifecycle, "TRANSITIONS", table)
    assert [table[group[0]].trigger for group in diagrams.catch_all_groups(table)] == ["rollout_timeout", "fail"]
    # the typed reasons' edges (a disconnect's first where it has one), then the caller's
    for label in (r"abort \[\d\. oversampled\]", r"abort \[else\]"):
        abort_edges = re.findall(rf"^    (\w+) -> aborted \[label=<{label}[<>]", diagrams.dot(), re.MULTILINE)
        assert sorted(abort_edges) == sorted(set(lifecycle.NON_TERMINAL) - {"rendered"})


def test_generated_text_is_deterministic() -> None:
    assert diagrams.mermaid() == diagrams.mermaid()
    assert diagrams.dot() == diagrams.dot()
    assert not re.search(r"\d{4}-\d{2}-\d{2}", diagrams.mermaid() + diagrams.dot())


@needs_dot
def test_svg_is_deterministic_and_records_its_source_instead_of_the_graphviz_comment() -> None:
    dot_text = diagrams.dot()
    svg = diagrams.render_svg(dot_text)
    assert svg == diagrams.render_svg(dot_text)
    assert "Generated by graphviz" not in svg
    assert f"sha256={diagrams.dot_sha256(dot_text)}" in svg
    assert diagram_cli.svg_problem(svg, dot_text) is None


def test_missing_graphviz_is_a_clear_error_for_svg(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_graphviz(monkeypatch)
    with pytest.raises(diagrams.GraphvizNotFoundError, match="apt-get install graphviz"):
        diagrams.render_svg(diagrams.dot())


def test_missing_graphviz_leaves_every_file_unwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_graphviz(monkeypatch)
    with pytest.raises(diagrams.GraphvizNotFoundError):
        diagram_cli.write_diagrams(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- staleness check


def test_checked_in_diagrams_are_up_to_date() -> None:
    problems = diagram_cli.stale_diagrams(REPO / "diagrams")
    assert not problems, "\n".join([*problems, f"Run `{diagram_cli.COMMAND}` from the repository root and commit."])


def test_an_added_transition_makes_the_checked_in_diagrams_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    add_fake_transition(monkeypatch)
    problems = "\n".join(diagram_cli.stale_diagrams(REPO / "diagrams"))
    for name in ("lifecycle.mmd", "lifecycle.dot", "lifecycle.svg"):
        assert name in problems


def test_check_command_names_the_command_to_run_when_stale(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    add_fake_transition(monkeypatch)
    code = cli_main(["diagram", "--check", "--out", str(REPO / "diagrams")])
    assert code == 1
    assert "fsm-rollout diagram" in capsys.readouterr().err


def test_the_readme_options_are_gone_from_the_command_it_names_where_they_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# untouched\n")
    assert cli_main(["diagram", "--out", str(tmp_path / "out"), "--readme", str(readme)]) == 2
    assert "python -m tools.docs" in capsys.readouterr().err
    assert readme.read_text() == "# untouched\n" and not (tmp_path / "out").exists()


@needs_dot
def test_write_then_check_is_clean_and_rewriting_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "diagrams"
    written = diagram_cli.write_diagrams(out)
    assert sorted(path.name for path in written) == [
        "gateway_session.dot",  # the gateway session's table, drawn beside the lifecycle's
        "gateway_session.mmd",
        "lifecycle.dot",
        "lifecycle.mmd",
        "lifecycle.svg",
    ]
    assert diagram_cli.stale_diagrams(out) == []
    assert diagram_cli.write_diagrams(out) == []


@needs_dot
def test_svg_from_another_graphviz_version_is_not_stale(tmp_path: Path) -> None:
    out = tmp_path / "diagrams"
    diagram_cli.write_diagrams(out)
    svg = out / "lifecycle.svg"
    svg.write_text(re.sub(r"with graphviz [^>]*-->", "with graphviz 99.0.0 (0) -->", svg.read_text(), count=1))
    assert diagram_cli.stale_diagrams(out) == []
    assert diagram_cli.write_diagrams(out) == []


@needs_dot
def test_svg_of_an_edited_table_is_stale_even_without_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "diagrams"
    add_fake_transition(monkeypatch)
    diagram_cli.write_diagrams(out)
    monkeypatch.undo()
    (out / "lifecycle.mmd").write_text(diagrams.mermaid())
    (out / "lifecycle.dot").write_text(diagrams.dot())
    hide_graphviz(monkeypatch)
    assert diagram_cli.stale_diagrams(out) == [f"{out / 'lifecycle.svg'} was rendered from a different DOT text"]


@needs_dot
def test_check_command_exits_zero_when_up_to_date(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["diagram", "--out", str(tmp_path / "d")]
    assert cli_main(args) == 0
    assert cli_main([*args, "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------ overlay


def event(sample: str | int, trigger: str, src: str, dst: str, dwell_ms: float, **fields: Any) -> dict[str, Any]:
    return {
        "event": "transition",
        "schema": 1,
        "sample_id": sample,
        "trigger": trigger,
        "src": src,
        "dst": dst,
        "dwell_ms": dwell_ms,
        **fields,
    }


def two_turns(sample: str, *, eos: bool = False) -> list[dict[str, Any]]:
    return [
        event(sample, "render", "pending", "rendered", 10.0),
        event(sample, "generate", "rendered", "generating", 1.0),
        event(sample, "step", "generating", "stepping", 40.0, eos_inserted=eos),
        event(sample, "observe", "stepping", "observing", 2.0),
        event(sample, "generate", "observing", "generating", 3.0),
        event(sample, "step", "generating", "stepping", 60.0, eos_inserted=False),
        event(sample, "observe", "stepping", "completed", 2.0, reason="env_done"),
    ]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Four samples: two complete after two turns (one with a stop EOS), one hits the length, one is aborted."""
    events = [
        *two_turns("a"),
        *two_turns("b", eos=True),
        event("c", "render", "pending", "rendered", 30.0),
        event("c", "generate", "rendered", "generating", 1.0),
        event("c", "step", "generating", "truncated", 50.0, reason="length"),
        event(7, "render", "pending", "rendered", 20.0),
        event(7, "abort", "rendered", "aborted", 5.0, reason="weight_update"),
    ]
    lines = ["not json at all", json.dumps({"event": "log", "msg": "hello"}), "[1, 2]"]
    lines += [json.dumps(item) for item in events]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def edge_index(trigger: str, source: str, dest: str, guard: str | None = None) -> int:
    for index, edge in enumerate(lifecycle.TRANSITIONS):
        if (edge.trigger, edge.source, edge.dest, edge.guard) == (trigger, source, dest, guard):
            return index
    raise AssertionError((trigger, source, dest, guard))


def test_overlay_counts_transitions_and_samples_per_edge(trace: Path) -> None:
    overlay = diagrams.build_overlay(diagrams.read_trace(trace))
    assert overlay.total_samples == 4
    usage = overlay.edges
    render = usage[edge_index("render", "pending", "rendered")]
    assert (render.transitions, render.samples) == (4, 4)
    plain_step = usage[edge_index("step", "generating", "stepping")]
    assert (plain_step.transitions, plain_step.samples) == (3, 2)
    eos_step = usage[edge_index("step", "generating", "stepping", "stop_eos_due")]
    assert (eos_step.transitions, eos_step.samples) == (1, 1)
    assert usage[edge_index("step", "generating", "truncated", "finished_by_length")].samples == 1
    assert usage[edge_index("abort", "rendered", "aborted")].sample_ids == {"7"}
    assert usage[edge_index("generate", "rendered", "truncated", "budget_exhausted")].transitions == 0
    assert sum(edge.transitions for edge in usage) == 7 + 7 + 3 + 2
    assert overlay.unmatched == {}


def test_overlay_gives_each_state_its_occupancy_and_dwell_median(trace: Path) -> None:
    states = diagrams.build_overlay(diagrams.read_trace(trace)).states
    assert states["pending"] == diagrams.StateUsage(4, 15.0)
    assert states["generating"] == diagrams.StateUsage(3, 50.0)
    assert states["completed"] == diagrams.StateUsage(2, None)
    assert states["failed"].samples == 0


def test_overlay_labels_edges_with_counts_and_shares_and_keeps_unused_edges_faint(trace: Path) -> None:
    text = diagrams.dot(diagrams.build_overlay(diagrams.read_trace(trace)))
    assert "4 transitions · 100% of samples" in text
    assert "3 transitions · 50% of samples" in text
    unused = re.search(r"^    rendered -> truncated \[(.*)\];$", text, re.MULTILINE)
    assert unused and "unused" in unused.group(1) and 'style="dashed"' in unused.group(1)
    assert f'color="{diagrams._FAINT}"' in unused.group(1)
    mermaid = diagrams.mermaid(diagrams.build_overlay(diagrams.read_trace(trace)))
    assert "rendered --> truncated : generate [1. budget_exhausted] reason=budget_exhausted · unused" in mermaid
    assert "    generating : 3 samples · p50 50.0 ms" in mermaid


def test_sample_highlight_marks_the_path_of_one_sample(trace: Path) -> None:
    overlay = diagrams.build_overlay(diagrams.read_trace(trace), sample="b")
    assert overlay.edges[edge_index("step", "generating", "stepping", "stop_eos_due")].sample_steps == (3,)
    assert overlay.edges[edge_index("step", "generating", "stepping")].sample_steps == (6,)
    assert overlay.edges[edge_index("step", "generating", "truncated", "finished_by_length")].sample_steps == ()
    on_path = {name for name, usage in overlay.states.items() if usage.on_sample_path}
    assert on_path == {"pending", "rendered", "generating", "stepping", "observing", "completed"}
    text = diagrams.dot(overlay)
    highlighted = re.findall(rf'^    (\w+) -> (\w+) \[.*color="{diagrams._HIGHLIGHT}".*\];$', text, re.MULTILINE)
    assert len(highlighted) == 7
    assert "sample b at 3" in text


def test_numeric_sample_ids_are_selected_by_their_text(trace: Path) -> None:
    overlay = diagrams.build_overlay(diagrams.read_trace(trace), sample="7")
    assert overlay.edges[edge_index("abort", "rendered", "aborted")].sample_steps == (2,)


def test_abort_from_the_box_lists_its_source_states(trace: Path) -> None:
    text = diagrams.dot(diagrams.build_overlay(diagrams.read_trace(trace)))
    abort = re.search(r"^    \w+ -> aborted \[label=<abort \(from any state in the box\)(.*)\];$", text, re.MULTILINE)
    assert abort and "1 transition · 25% of samples" in abort.group(1) and "rendered 1" in abort.group(1)


def test_every_table_edge_can_be_told_apart_in_a_trace() -> None:
    for index, edge in enumerate(lifecycle.TRANSITIONS):
        recorded: dict[str, Any] = {
            "trigger": edge.trigger,
            "src": edge.source,
            "dst": edge.dest,
            "reason": edge.reason or ("cancelled" if edge.trigger == "abort" else "error"),
        }
        for guard, field in overlays._GUARD_EVIDENCE.items():
            recorded.setdefault(field, edge.guard == guard)
        assert diagrams.match_edge(recorded, lifecycle.TRANSITIONS) == index, edge


def test_transitions_outside_the_table_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(event("x", "teleport", "pending", "completed", 1.0)) + "\n")
    assert cli_main(["diagram", "--trace", str(path), "-o", str(tmp_path / "run.dot")]) == 0
    assert "teleport" in capsys.readouterr().err


def test_overlay_command_writes_each_format(trace: Path, tmp_path: Path) -> None:
    for name in ("run.mmd", "run.dot"):
        assert cli_main(["diagram", "--trace", str(trace), "-o", str(tmp_path / name), "--sample", "a"]) == 0
    assert (tmp_path / "run.mmd").read_text().startswith("%% Generated")
    assert "digraph lifecycle" in (tmp_path / "run.dot").read_text()


@needs_dot
def test_overlay_command_renders_svg(trace: Path, tmp_path: Path) -> None:
    assert cli_main(["diagram", "--trace", str(trace), "-o", str(tmp_path / "run.svg")]) == 0
    assert "<svg" in (tmp_path / "run.svg").read_text()


def test_overlay_svg_without_graphviz_exits_2(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hide_graphviz(monkeypatch)
    assert cli_main(["diagram", "--trace", str(trace), "-o", str(tmp_path / "run.svg")]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
    assert not (tmp_path / "run.svg").exists()


@pytest.mark.parametrize(
    "argv_tail",
    [
        ["--trace", "{missing}", "-o", "{out}/run.dot"],
        ["--trace", "{trace}", "-o", "{out}/run.png"],
        ["--trace", "{trace}", "-o", "{out}/run.dot", "--sample", "nobody"],
        ["--trace", "{trace}"],
        ["--trace", "{trace}", "-o", "{out}/run.dot", "--check"],
        ["-o", "{out}/run.dot"],
    ],
    ids=["unreadable-trace", "unknown-format", "unknown-sample", "no-output", "with-check", "output-without-trace"],
)
def test_overlay_usage_errors_exit_2(
    argv_tail: list[str], trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {"missing": str(tmp_path / "missing.jsonl"), "trace": str(trace), "out": str(tmp_path)}
    argv = ["diagram", *(part.format(**values) for part in argv_tail)]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.startswith("fsm-rollout diagram: ")


# ------------------------------------------------------------------------------------------------ the checkout


def test_in_a_checkout_the_command_writes_the_diagrams_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_checkout(tmp_path)
    monkeypatch.chdir(root / "docs")  # the checkout is found from a subdirectory too
    for name in ("README.md", "docs/cli.md"):  # stale documents are the maintainers' tool's business
        (root / name).write_text("# edited, no markers\n")
    (root / "diagrams" / "lifecycle.mmd").write_text("stale\n")
    assert cli_main(["diagram", "--check", "--no-readme"]) == 1  # --no-readme: still accepted, now what it always does
    err = capsys.readouterr().err
    assert "lifecycle.mmd differs from the transition table" in err
    assert "README" not in err and "cli.md" not in err
    assert cli_main(["diagram"]) == 0  # the SVG is current, so no `dot` is needed
    assert capsys.readouterr().out.split() == ["wrote", os.path.join("..", "diagrams", "lifecycle.mmd")]
    assert cli_main(["diagram", "--check"]) == 0
    assert (root / "README.md").read_text() == (root / "docs" / "cli.md").read_text() == "# edited, no markers\n"


def test_diagram_finds_the_checkout_from_a_subdirectory_and_nothing_outside_one(tmp_path: Path) -> None:
    assert diagram_cli.checkout_root(REPO / "tests" / "unit") == REPO
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert diagram_cli.checkout_root(tmp_path) is None


def test_check_outside_a_checkout_looks_at_no_readme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("# another project, no markers\n")
    assert cli_main(["diagram", "--check"]) == 1
    err = capsys.readouterr().err
    assert "diagrams/lifecycle.mmd is missing" in err and "README" not in err
    assert (tmp_path / "README.md").read_text() == "# another project, no markers\n"


@needs_dot
def test_writing_outside_a_checkout_leaves_any_readme_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("# another project, no markers\n")
    assert cli_main(["diagram"]) == 0
    assert sorted(path.name for path in (tmp_path / "diagrams").iterdir()) == [
        "gateway_session.dot",
        "gateway_session.mmd",
        "lifecycle.dot",
        "lifecycle.mmd",
        "lifecycle.svg",
    ]
    assert (tmp_path / "README.md").read_text() == "# another project, no markers\n"


def test_the_gateway_session_diagram_is_generated_and_checked(tmp_path: Path) -> None:
    from fsm_rollout.gateway import session_table

    root = fake_checkout(tmp_path)
    out = root / "diagrams"
    assert (REPO / "diagrams" / "gateway_session.mmd").read_text() == session_table.mermaid()
    for edge in session_table.TRANSITIONS:
        assert f"{edge.source} --> {edge.dest} : {edge.trigger}" in session_table.mermaid()
    (out / "gateway_session.mmd").unlink()
    (out / "gateway_session.dot").write_text("digraph stale {}\n")
    assert sorted(diagram_cli.stale_diagrams(out)) == [
        f"{out / 'gateway_session.dot'} differs from the transition table",
        f"{out / 'gateway_session.mmd'} is missing",
    ]
