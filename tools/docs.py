"""The checkout's generated documentation, kept in step with the code: ``python -m tools.docs [--check]``.

Writes, from what the code runs:

* ``diagrams/``: the lifecycle and gateway-session diagrams, as ``fsm-rollout diagram`` writes them;
* the generated sections of the documents (:data:`SECTIONS`, each naming the file it lives in): the README's
  lifecycle diagram, lifecycle table and layout map, and ``docs/cli.md``'s command-line reference, each between its
  own ``BEGIN GENERATED`` and ``END GENERATED`` marker lines;
* ``docs/report.png``, the README's screenshot of a report (:mod:`tools.screenshot`; shooting it needs Chromium,
  and only when it is stale).

``--check`` writes nothing, names every stale file or section on stderr and exits 1 when any is. A maintainer's
tool: it lives beside the package, not in it, and is run from the checkout's root.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsm_rollout.cli import diagram
from fsm_rollout.machine.diagrams import DiagramError, mermaid
from tools import doc_texts, screenshot

COMMAND = "python -m tools.docs"
"""The command that regenerates everything here (named in staleness messages)."""

REPO = Path(__file__).resolve().parents[1]
"""The checkout this tool belongs to."""

README = "README.md"
CLI_DOC = "docs/cli.md"
"""The documents holding generated sections, relative to the checkout."""


@dataclass(frozen=True)
class GeneratedSection:
    """A part of a document generated from the code, between its BEGIN and END marker lines."""

    name: str
    render: Callable[[], str]
    """What lies between the markers."""
    required: bool = False
    """Whether a document without this section is an error (the others are rewritten where present)."""
    file: str = README
    """The document the section lives in, relative to the checkout."""

    @property
    def begin(self) -> str:
        return f"<!-- BEGIN GENERATED: {self.name} -->"

    @property
    def end(self) -> str:
        return f"<!-- END GENERATED: {self.name} -->"


def readme_block(mermaid_text: str) -> str:
    """What lies between the lifecycle diagram's markers: the Mermaid text in a fenced block."""
    return f"\n```mermaid\n{mermaid_text}```\n"


SECTIONS: tuple[GeneratedSection, ...] = (
    GeneratedSection("lifecycle diagram", lambda: readme_block(mermaid()), required=True),
    GeneratedSection("lifecycle table", lambda: "\n" + doc_texts.lifecycle_table()),
    GeneratedSection("command line", lambda: "\n" + doc_texts.command_line(), required=True, file=CLI_DOC),
    GeneratedSection("layout", lambda: "\n" + doc_texts.layout_map()),
)
"""Every generated section, in the order each document holds them."""
README_SECTIONS = tuple(section for section in SECTIONS if section.file == README)
README_BEGIN = README_SECTIONS[0].begin
README_END = README_SECTIONS[0].end


def replace_section(text: str, section: GeneratedSection, content: str, *, name: str = "README") -> str:
    """The document's text with ``section``'s content replaced.

    Raises :class:`DiagramError` when a required section is missing, or any section is there twice or unclosed.
    """
    begin = text.find(section.begin)
    if begin < 0 and not section.required:
        return text
    end = text.find(section.end, begin + len(section.begin)) if begin >= 0 else -1
    if begin < 0 or end < 0 or text.count(section.begin) != 1:
        raise DiagramError(
            f"{name} must hold exactly one generated section: a line {section.begin} followed later by {section.end}"
        )
    start = begin + len(section.begin)
    return text[:start] + content + text[end:]


def replace_readme_section(readme_text: str, mermaid_text: str, *, name: str = "README") -> str:
    """The README text with the lifecycle diagram section replaced by ``mermaid_text``."""
    return replace_section(readme_text, README_SECTIONS[0], readme_block(mermaid_text), name=name)


def regenerate_document(text: str, file: str, *, name: str | None = None) -> str:
    """The text of document ``file`` (:data:`README`, :data:`CLI_DOC`) with its generated sections rewritten.

    A section that lives in another document is an error rather than left to go stale where it no longer belongs
    (a README from before the command-line reference moved to ``docs/cli.md``, say).
    """
    name = name or file
    for section in SECTIONS:
        if section.file == file:
            text = replace_section(text, section, section.render(), name=name)
        elif section.begin in text:
            raise DiagramError(
                f"{name} holds the generated {section.name} section, which lives in {section.file} now: "
                f"delete the lines from {section.begin} to {section.end}"
            )
    return text


def documents(root: Path) -> dict[str, Path]:
    """The checkout's documents holding generated sections, by their name in the checkout."""
    return {file: root / file for file in dict.fromkeys(section.file for section in SECTIONS)}


def _read(path: Path, file: str) -> str:
    try:
        return path.read_bytes().decode()
    except FileNotFoundError as exc:
        raise DiagramError(f"{file} {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DiagramError(f"cannot read {file} {path}: {exc}") from exc


def _check_names(targets: Mapping[str, Path]) -> None:
    unknown = sorted(set(targets) - {section.file for section in SECTIONS})
    if unknown:
        raise DiagramError(f"no generated sections live in {', '.join(unknown)}")


def stale_sections(targets: Mapping[str, Path]) -> list[str]:
    """One line per generated section of ``targets`` (document name in the checkout → its path) that differs from
    what the code gives now; empty when all are up to date. A document without a required section, or with one
    that lives elsewhere, raises :class:`DiagramError`."""
    _check_names(targets)
    problems = []
    for file, path in targets.items():
        text = _read(path, file)
        regenerate_document(text, file, name=str(path))  # raises on missing or misplaced sections
        for section in SECTIONS:
            if section.file == file and replace_section(text, section, section.render()) != text:
                problems.append(f"{path}: the generated {section.name} section differs from the code")
    return problems


def write_sections(targets: Mapping[str, Path]) -> list[Path]:
    """Rewrite the generated sections of ``targets`` (as for :func:`stale_sections`); returns the files changed.

    Every document is regenerated before any is written, so a missing marker leaves all of them as they were.
    """
    _check_names(targets)
    texts = {path: (_read(path, file), file) for file, path in targets.items()}
    writes = {path: regenerate_document(text, file, name=str(path)) for path, (text, file) in texts.items()}
    changed = [path for path, text in writes.items() if texts[path][0] != text]
    for path in changed:
        path.write_bytes(writes[path].encode())
    return changed


def stale(root: Path) -> list[str]:
    """Everything generated in the checkout at ``root`` that differs from the code: diagrams, sections, screenshot."""
    problems = diagram.stale_diagrams(root / diagram.DEFAULT_OUT_DIR) + stale_sections(documents(root))
    if screenshot.kept_by(root) is not None and (problem := screenshot.screenshot_problem(root)) is not None:
        problems.append(problem)
    return problems


def write(root: Path) -> list[Path]:
    """Bring everything generated in the checkout at ``root`` up to date; returns the files changed."""
    changed = diagram.write_diagrams(root / diagram.DEFAULT_OUT_DIR) + write_sections(documents(root))
    if screenshot.kept_by(root) is not None and screenshot.screenshot_problem(root) is not None:
        from tools.chromium import ChromiumError

        try:
            changed.append(screenshot.write_screenshot(root))
        except ChromiumError as error:  # say what to install
            raise DiagramError(f"{screenshot.SCREENSHOT} is stale and cannot be shot again: {error}") from error
    return changed


def main(argv: Sequence[str] | None = None, root: Path = REPO) -> int:
    """0 written (or up to date), 1 stale under ``--check``, 2 on errors (no ``dot`` or Chromium, a missing marker)."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming what is stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale(root)
            if problems:
                print("Generated files or sections are stale:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                print(f"Run `{COMMAND}` from the checkout's root and commit the result.", file=sys.stderr)
                return 1
            print("generated files and sections are up to date")
            return 0
        changed = write(root)
    except DiagramError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"wrote {os.path.relpath(path)}")
    if not changed:
        print("generated files and sections are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
