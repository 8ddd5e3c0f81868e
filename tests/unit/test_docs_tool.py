"""The maintainers' ``python -m tools.docs``: the documents' generated sections (the README's lifecycle diagram,
lifecycle table and layout map, docs/cli.md's command-line reference) are what the code gives, go stale when the
code changes, and are rewritten between their markers only."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_rollout.cli import build_parser
from fsm_rollout.machine import diagrams, lifecycle
from tools import doc_texts
from tools import docs as docs_tool

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CHECKED_IN = docs_tool.documents(REPO)


def readme_with_markers(directory: Path) -> Path:
    readme = directory / "README.md"
    readme.write_text(f"# Title\n\nbefore\n\n{docs_tool.README_BEGIN}\nold text\n{docs_tool.README_END}\n\nafter\n")
    return readme


def fake_checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's generated files in ``tmp_path`` (no kept report run, so no screenshot)."""
    for name in ("README.md", "docs/cli.md", *(f"diagrams/{path.name}" for path in (REPO / "diagrams").iterdir())):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, tmp_path / name)
    return tmp_path


def add_fake_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = lifecycle.Edge("retry", "generating", "rendered", guard="retry_allowed")
    monkeypatch.setattr(lifecycle, "TRANSITIONS", (*lifecycle.TRANSITIONS, extra))


def test_the_checked_in_sections_are_up_to_date() -> None:
    problems = docs_tool.stale_sections(CHECKED_IN)
    assert not problems, "\n".join([*problems, f"Run `{docs_tool.COMMAND}` from the repository root and commit."])


def test_an_added_transition_makes_the_readme_and_the_diagrams_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    add_fake_transition(monkeypatch)
    problems = "\n".join(docs_tool.stale(REPO))
    assert f"{README}: the generated lifecycle diagram section differs from the code" in problems
    assert f"{README}: the generated lifecycle table section differs from the code" in problems
    for name in ("lifecycle.mmd", "lifecycle.dot", "lifecycle.svg"):
        assert name in problems


def test_check_names_what_is_stale_and_the_command_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_checkout(tmp_path)
    assert docs_tool.main(["--check"], root=root) == 0
    add_fake_transition(monkeypatch)
    capsys.readouterr()
    assert docs_tool.main(["--check"], root=root) == 1
    err = capsys.readouterr().err
    assert "README.md: the generated lifecycle diagram section differs from the code" in err
    assert "python -m tools.docs" in err


def test_readme_section_is_rewritten_between_the_markers_only(tmp_path: Path) -> None:
    readme = readme_with_markers(tmp_path)
    text = docs_tool.replace_readme_section(readme.read_text(), diagrams.mermaid())
    begin, end = text.index(docs_tool.README_BEGIN), text.index(docs_tool.README_END)
    assert text[:begin] == "# Title\n\nbefore\n\n"
    assert text[end:] == f"{docs_tool.README_END}\n\nafter\n"
    assert text[begin + len(docs_tool.README_BEGIN) : end] == f"\n```mermaid\n{diagrams.mermaid()}```\n"


def test_readme_without_markers_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = fake_checkout(tmp_path)
    (root / "README.md").write_text("# no markers\n")
    with pytest.raises(diagrams.DiagramError, match="BEGIN GENERATED: lifecycle diagram"):
        docs_tool.stale_sections({docs_tool.README: root / "README.md"})
    assert docs_tool.main([], root=root) == 2
    assert "BEGIN GENERATED: lifecycle diagram" in capsys.readouterr().err


def test_write_then_check_is_clean_and_rewriting_changes_nothing(tmp_path: Path) -> None:
    readme = readme_with_markers(tmp_path)
    targets = {docs_tool.README: readme}
    assert docs_tool.write_sections(targets) == [readme]
    assert docs_tool.stale_sections(targets) == []
    assert docs_tool.write_sections(targets) == []
    assert (REPO / "diagrams" / "lifecycle.mmd").read_text() in readme.read_text()


def test_a_missing_marker_in_one_document_leaves_every_document_unwritten(tmp_path: Path) -> None:
    readme = readme_with_markers(tmp_path)
    before = readme.read_text()
    cli_doc = tmp_path / "cli.md"
    cli_doc.write_text("# no markers\n")
    with pytest.raises(diagrams.DiagramError, match="BEGIN GENERATED: command line"):
        docs_tool.write_sections({docs_tool.README: readme, docs_tool.CLI_DOC: cli_doc})
    assert readme.read_text() == before


def test_the_readme_holds_every_generated_section_once() -> None:
    text = README.read_text()
    for section in docs_tool.README_SECTIONS:
        assert text.count(section.begin) == 1 and text.count(section.end) == 1, section.name
        assert text.index(section.begin) < text.index(section.end), section.name


def test_each_document_holds_its_own_generated_sections_once_and_no_others() -> None:
    assert {section.file for section in docs_tool.SECTIONS} == {"README.md", "docs/cli.md"}
    assert [s.name for s in docs_tool.SECTIONS if s.file == "docs/cli.md"] == ["command line"]
    for file in {section.file for section in docs_tool.SECTIONS}:
        text = (REPO / file).read_text()
        for section in docs_tool.SECTIONS:
            count = 1 if section.file == file else 0
            assert text.count(section.begin) == count and text.count(section.end) == count, (file, section.name)


def test_the_lifecycle_table_has_one_row_per_edge_in_table_order() -> None:
    rows = [row.split(" | ") for row in doc_texts.lifecycle_table().splitlines()[3:]]
    grouped = {index for group in diagrams.catch_all_groups(lifecycle.TRANSITIONS) for index in group[1:]}
    edges = [edge for index, edge in enumerate(lifecycle.TRANSITIONS) if index not in grouped]
    assert len(rows) == len(edges)
    for row, edge in zip(rows, edges, strict=True):
        source, trigger, guard, dest, reason = row[0].lstrip("| "), row[1], row[2], row[3], row[4]
        assert source in (edge.source, "any non-terminal")
        assert (trigger, dest) == (edge.trigger, edge.dest)
        assert guard == (f"`{edge.guard}`" if edge.guard else "—")
        assert reason == (f"`{edge.reason}`" if edge.reason else "—")


def test_an_edited_edge_description_makes_the_readme_table_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    first = dataclasses.replace(lifecycle.TRANSITIONS[0], work="something else entirely")
    monkeypatch.setattr(lifecycle, "TRANSITIONS", (first, *lifecycle.TRANSITIONS[1:]))
    problems = docs_tool.stale_sections(CHECKED_IN)
    assert problems == [f"{README}: the generated lifecycle table section differs from the code"]


def test_an_added_option_makes_the_docs_command_line_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsm_rollout.cli import serve

    original = serve.add_arguments

    def with_extra_option(parser: argparse.ArgumentParser) -> None:
        original(parser)
        parser.add_argument("--brand-new", help="an option the README does not list")

    monkeypatch.setattr(serve, "add_arguments", with_extra_option)
    problems = docs_tool.stale_sections(CHECKED_IN)
    assert problems == [f"{REPO / 'docs/cli.md'}: the generated command line section differs from the code"]


def test_an_edited_docs_cli_makes_check_report_it_and_writing_restores_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_checkout(tmp_path)
    cli_doc = root / "docs" / "cli.md"
    original = cli_doc.read_text()
    cli_doc.write_text(original.replace("### `fsm-rollout serve`", "### `fsm-rollout serve-it`"))
    assert docs_tool.main(["--check"], root=root) == 1
    err = capsys.readouterr().err
    assert "cli.md: the generated command line section differs from the code" in err
    assert "README" not in err
    assert docs_tool.main([], root=root) == 0  # the diagrams are current, so no `dot` is needed
    assert "cli.md" in capsys.readouterr().out
    assert cli_doc.read_text() == original


def test_a_section_in_the_wrong_document_is_an_error_naming_where_it_lives(tmp_path: Path) -> None:
    readme = readme_with_markers(tmp_path)
    section = next(section for section in docs_tool.SECTIONS if section.name == "command line")
    readme.write_text(readme.read_text() + f"{section.begin}\nold reference\n{section.end}\n")
    with pytest.raises(diagrams.DiagramError, match=re.escape("lives in docs/cli.md now")):
        docs_tool.stale_sections({docs_tool.README: readme})
    cli_doc = tmp_path / "cli.md"
    cli_doc.write_text("# no markers\n")
    with pytest.raises(diagrams.DiagramError, match="BEGIN GENERATED: command line"):
        docs_tool.stale_sections({docs_tool.CLI_DOC: cli_doc})
    with pytest.raises(diagrams.DiagramError, match=re.escape("no generated sections live in notes.md")):
        docs_tool.stale_sections({"notes.md": cli_doc})


def test_the_command_line_reference_lists_every_command_and_option() -> None:
    text = doc_texts.command_line()
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, subparser in subcommands.items():
        assert f"### `fsm-rollout {name}`" in text
        for action in subparser._actions:
            if action.help != argparse.SUPPRESS and action.option_strings and "--help" not in action.option_strings:
                assert f"`{action.option_strings[-1]}" in text or f", {action.option_strings[-1]}" in text, action


def test_the_tool_runs_as_a_module_from_the_checkout() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.docs", "--help"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "--check" in result.stdout
