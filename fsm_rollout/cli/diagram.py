"""``fsm-rollout diagram``: the checked-in lifecycle diagrams and the documents' generated sections, kept in step.

The command writes three files from :mod:`fsm_rollout.machine.lifecycle` with :mod:`fsm_rollout.machine.diagrams`:

``lifecycle.mmd``  the Mermaid ``stateDiagram-v2`` (the README embeds the same text);
``lifecycle.dot``  the Graphviz source;
``lifecycle.svg``  ``dot -Tsvg`` of that source (and ``gateway_session.mmd``/``.dot`` of the gateway's table);

and rewrites the generated sections of the checkout's documents (:data:`SECTIONS`, each naming the file it lives in:
the README's lifecycle diagram, lifecycle table and layout map, and ``docs/cli.md``'s command-line reference), each
between its own ``BEGIN GENERATED`` and ``END GENERATED`` marker lines. The documents are those of the fsm-rollout
checkout the command runs in (the working directory or one above it); outside a checkout none is touched, since a
library installed elsewhere has no business writing one. ``--readme PATH`` and ``--no-readme`` choose the README
only: ``docs/cli.md`` is always the checkout's, so pointing the README elsewhere still keeps the reference in step.

Staleness: the Mermaid text, the DOT text and the README sections are compared byte for byte, but an SVG's bytes
depend on the graphviz version and the installed fonts. So an SVG counts as up to date when the DOT hash it records
(:data:`fsm_rollout.machine.diagrams.PROVENANCE`) is the hash of the DOT text the table gives now and it draws that
text's nodes and edges. Neither writing nor checking re-renders an up-to-date SVG, so neither needs ``dot`` then; delete
the SVG to force a re-render (after a graphviz upgrade, say).
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fsm_rollout.cli import docs
from fsm_rollout.gateway.session_table import diagram_files as session_diagram_files
from fsm_rollout.machine.diagrams import (
    PROVENANCE,
    DiagramError,
    Overlay,
    build_overlay,
    dot,
    dot_sha256,
    mermaid,
    read_trace,
    render_svg,
)

COMMAND = "fsm-rollout diagram"
"""The command that regenerates the checked-in diagrams (named in staleness messages)."""

MERMAID_FILE = "lifecycle.mmd"
DOT_FILE = "lifecycle.dot"
SVG_FILE = "lifecycle.svg"
DEFAULT_OUT_DIR = Path("diagrams")
"""Where the diagrams go, relative to the checkout (or to the working directory outside one)."""

OVERLAY_FORMATS = (".mmd", ".dot", ".gv", ".svg")
"""File name endings ``--trace ... -o FILE`` accepts; the ending picks the format."""

EPILOG = """\
Without --trace it writes lifecycle.mmd, lifecycle.dot and lifecycle.svg from the table in
fsm_rollout/machine/lifecycle.py (the SVG needs Graphviz's `dot`, and only when it is out of date), and the generated
sections of the checkout's README.md (the lifecycle diagram, the lifecycle table and the layout map) and
docs/cli.md (this command-line reference). --readme PATH and --no-readme choose the README only; docs/cli.md is
always the checkout's. Outside a checkout neither is touched. --check writes nothing and exits 1 when anything is
stale.

With --trace TRACE -o FILE it draws one recorded run on the lifecycle instead: each edge with the transitions that
took it and the share of samples that did, each state with the samples that entered it and the median of their
dwell times; --sample ID highlights one sample's path. The ending of FILE picks the format (.mmd, .dot or .gv,
.svg).

Exit codes: 0 written (or up to date); 1 stale, under --check; 2 an error (no `dot` for an SVG, an unreadable
trace, a README or docs/cli.md without its generated sections)."""


# ---------------------------------------------------------------------------------------------- generated sections

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
    GeneratedSection("lifecycle table", lambda: "\n" + docs.lifecycle_table()),
    GeneratedSection("command line", lambda: "\n" + docs.command_line(), required=True, file=CLI_DOC),
    GeneratedSection("layout", lambda: "\n" + docs.layout_map()),
)
"""Every generated section, in the order each document holds them."""
README_SECTIONS = tuple(section for section in SECTIONS if section.file == README)
README_BEGIN = README_SECTIONS[0].begin
README_END = README_SECTIONS[0].end


def replace_section(readme_text: str, section: GeneratedSection, content: str, *, name: str = "README") -> str:
    """The document's text with ``section``'s content replaced.

    Raises :class:`DiagramError` when a required section is missing, or any section is there twice or unclosed.
    """
    begin = readme_text.find(section.begin)
    if begin < 0 and not section.required:
        return readme_text
    end = readme_text.find(section.end, begin + len(section.begin)) if begin >= 0 else -1
    if begin < 0 or end < 0 or readme_text.count(section.begin) != 1:
        raise DiagramError(
            f"{name} must hold exactly one generated section: a line {section.begin} followed later by {section.end}"
        )
    start = begin + len(section.begin)
    return readme_text[:start] + content + readme_text[end:]


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


def regenerate_readme(readme_text: str, *, name: str = "README") -> str:
    """The README text with every generated section present rewritten from the code."""
    return regenerate_document(readme_text, README, name=name)


# -------------------------------------------------------------------------------------------- SVG provenance

_DOT_NODE = re.compile(r"^ +(\w+) \[", re.MULTILINE)
_DOT_EDGE = re.compile(r"^ +(\w+) -> (\w+)[ ;]", re.MULTILINE)
_SVG_TITLE = re.compile(r'<g id="(node|edge)\d+" class="(?:node|edge)">\s*<title>(.*?)</title>')


def _svg_graph(svg_text: str) -> tuple[frozenset[str], Counter[str]]:
    """The node names and edges (``a->b``, counted) of an SVG that Graphviz rendered."""
    nodes: set[str] = set()
    edges: Counter[str] = Counter()
    for kind, title in _SVG_TITLE.findall(svg_text):
        if kind == "node":
            nodes.add(html.unescape(title))
        else:
            edges[html.unescape(title)] += 1
    return frozenset(nodes), edges


def _dot_graph(dot_text: str) -> tuple[frozenset[str], Counter[str]]:
    """The node names and edges (``a->b``, counted) of DOT text :func:`fsm_rollout.machine.diagrams.dot` wrote."""
    nodes = {name for name in _DOT_NODE.findall(dot_text) if name not in ("graph", "node", "edge")}
    edges = Counter(f"{source}->{dest}" for source, dest in _DOT_EDGE.findall(dot_text))
    return frozenset(nodes), edges


def svg_problem(svg_text: str, dot_text: str) -> str | None:
    """Why an SVG is not a rendering of ``dot_text`` (None when it is); compares structure, not bytes."""
    match = PROVENANCE.search(svg_text)
    if match is None:
        return "was not rendered by `fsm-rollout diagram` (no source hash)"
    if match.group(1) != dot_sha256(dot_text):
        return "was rendered from a different DOT text"
    if _svg_graph(svg_text) != _dot_graph(dot_text):
        return "does not hold the states and edges of the DOT text"
    return None


# ------------------------------------------------------------------------------------------------------ files


@dataclass(frozen=True)
class _Plan:
    """The text files and documents the code gives now, and what the SVG must be rendered from."""

    texts: Mapping[str, str]
    dot_text: str
    documents: Mapping[Path, tuple[str, str]]
    """Each document's path: its name in the checkout (:data:`README`, :data:`CLI_DOC`) and its regenerated text."""


def _documents(readme: Path | None, documents: Mapping[str, Path] | None) -> dict[str, Path]:
    """Each document to rewrite, by its name in the checkout: ``documents`` and ``readme`` (which wins)."""
    targets = dict(documents or {})
    unknown = sorted(set(targets) - {section.file for section in SECTIONS})
    if unknown:
        raise DiagramError(f"no generated sections live in {', '.join(unknown)}")
    if readme is not None:
        targets[README] = readme
    return targets


def _plan(readme: Path | None, documents: Mapping[str, Path] | None) -> _Plan:
    dot_text = dot()
    regenerated = {}
    for file, path in _documents(readme, documents).items():
        what = "README" if file == README else file
        regenerated[path] = (file, regenerate_document(_read_text(path, what), file, name=str(path)))
    return _Plan({MERMAID_FILE: mermaid(), DOT_FILE: dot_text, **session_diagram_files()}, dot_text, regenerated)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_bytes().decode()
    except FileNotFoundError as exc:
        raise DiagramError(f"{what} {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DiagramError(f"cannot read {what} {path}: {exc}") from exc


def _current(path: Path) -> str | None:
    try:
        return path.read_bytes().decode()
    except (OSError, UnicodeDecodeError):
        return None


def stale_diagrams(out_dir: Path, readme: Path | None, documents: Mapping[str, Path] | None = None) -> list[str]:
    """What differs between the files in ``out_dir`` (and the documents' sections) and what the code gives now.

    ``readme`` is the README whose sections are checked (None: none); ``documents`` the other documents holding
    generated sections, by their name in the checkout (``{CLI_DOC: path}``). Returns one line per stale file or
    section, empty when everything is up to date. The Mermaid and DOT files and the sections must match byte for
    byte; the SVG must be a rendering of the current DOT text (:func:`svg_problem`), which is checked without
    running ``dot``.
    """
    plan = _plan(readme, documents)
    problems = []
    for name, text in plan.texts.items():
        current = _current(out_dir / name)
        if current is None:
            problems.append(f"{out_dir / name} is missing")
        elif current != text:
            problems.append(f"{out_dir / name} differs from the transition table")
    svg = _current(out_dir / SVG_FILE)
    if svg is None:
        problems.append(f"{out_dir / SVG_FILE} is missing")
    else:
        problem = svg_problem(svg, plan.dot_text)
        if problem:
            problems.append(f"{out_dir / SVG_FILE} {problem}")
    for path, (file, _text) in plan.documents.items():
        current_text = _current(path) or ""
        for section in SECTIONS:
            if section.file == file and replace_section(current_text, section, section.render()) != current_text:
                problems.append(f"{path}: the generated {section.name} section differs from the code")
    return problems


def write_diagrams(out_dir: Path, readme: Path | None, documents: Mapping[str, Path] | None = None) -> list[Path]:
    """Write the diagrams into ``out_dir`` and the documents' generated sections; returns the files changed.

    ``readme`` and ``documents`` are as for :func:`stale_diagrams`. Files already up to date are left alone, so
    regenerating an unchanged table changes nothing; the SVG is re-rendered (which needs ``dot``) only when it does
    not match the current DOT text. Everything is computed before anything is written: a missing ``dot`` or marker
    leaves all files as they were.
    """
    plan = _plan(readme, documents)
    writes: dict[Path, str] = {out_dir / name: text for name, text in plan.texts.items()}
    svg = _current(out_dir / SVG_FILE)
    if svg is None or svg_problem(svg, plan.dot_text) is not None:
        writes[out_dir / SVG_FILE] = render_svg(plan.dot_text)
    writes.update({path: text for path, (_file, text) in plan.documents.items()})
    changed = [path for path, text in writes.items() if _current(path) != text]
    for path in changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(writes[path].encode())
    return changed


def write_overlay(trace: Path, output: Path, sample: str | None = None) -> Overlay:
    """Draw the run recorded in ``trace`` on the lifecycle and write it to ``output`` (format from its ending)."""
    suffix = output.suffix.lower()
    if suffix not in OVERLAY_FORMATS:
        raise DiagramError(f"cannot tell the format of {output}: name it *{', *'.join(OVERLAY_FORMATS)}")
    overlay = build_overlay(read_trace(trace), sample)
    if suffix == ".mmd":
        text = mermaid(overlay)
    elif suffix == ".svg":
        text = render_svg(dot(overlay))
    else:
        text = dot(overlay)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(text.encode())
    except OSError as exc:
        raise DiagramError(f"cannot write {output}: {exc.strerror or exc}") from exc
    return overlay


def checkout_root(start: Path | None = None) -> Path | None:
    """The fsm-rollout checkout holding ``start`` (default: the working directory), or None outside one.

    A checkout is a directory whose ``pyproject.toml`` names the project ``fsm-rollout`` and which holds the
    package's source, so an unrelated project's README is never taken for this one's.
    """
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        pyproject = directory / "pyproject.toml"
        if not (pyproject.is_file() and (directory / "fsm_rollout" / "machine" / "lifecycle.py").is_file()):
            continue
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
        if isinstance(project, dict) and project.get("name") == "fsm-rollout":
            return directory
    return None


# ------------------------------------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``diagram`` subcommand's options."""
    parser.epilog = EPILOG
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"where {MERMAID_FILE}, {DOT_FILE} and {SVG_FILE} go (default: diagrams/ of the checkout, or of the "
        "working directory outside one)",
    )
    readme = parser.add_mutually_exclusive_group()
    readme.add_argument(
        "--readme",
        type=Path,
        metavar="PATH",
        help="README whose generated sections are rewritten (default: the checkout's README.md; none outside one); "
        "docs/cli.md is the checkout's either way",
    )
    readme.add_argument(
        "--no-readme", action="store_true", help="leave the README alone (docs/cli.md is still rewritten)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if any generated file or section (README.md, docs/cli.md) is stale",
    )
    overlay = parser.add_argument_group("overlay of a recorded run")
    overlay.add_argument(
        "--trace", type=Path, metavar="TRACE", help="a transition trace (JSON lines) to draw on the lifecycle instead"
    )
    overlay.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help=f"where the overlay goes; the ending picks the format ({', '.join(OVERLAY_FORMATS)})",
    )
    overlay.add_argument("--sample", metavar="ID", help="highlight this sample's path (its sample_id)")


def _targets(args: argparse.Namespace) -> tuple[Path, Path | None, dict[str, Path]]:
    """The diagram directory, the README (None: none) and the other documents the options and working directory give.

    ``--readme`` and ``--no-readme`` choose the README only; the other documents are the checkout's (none outside
    one).
    """
    root = checkout_root()
    base = Path(os.path.relpath(root)) if root is not None else Path()
    out = args.out if args.out is not None else base / DEFAULT_OUT_DIR
    documents = {CLI_DOC: base / CLI_DOC} if root is not None else {}
    if args.no_readme:
        return out, None, documents
    if args.readme is not None:
        return out, args.readme, documents
    return out, (base / README if root is not None else None), documents


def _regenerate_command(args: argparse.Namespace) -> str:
    command = COMMAND
    if args.out is not None:
        command += f" --out {args.out}"
    if args.no_readme:
        command += " --no-readme"
    elif args.readme is not None:
        command += f" --readme {args.readme}"
    return command


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout diagram``: 0 done (or up to date), 1 stale under ``--check``, 2 on errors."""
    if args.trace is None and (args.output is not None or args.sample is not None):
        print("fsm-rollout diagram: -o/--output and --sample need --trace", file=sys.stderr)
        return 2
    if args.trace is not None and (args.output is None or args.check):
        print(
            "fsm-rollout diagram: --trace needs -o/--output FILE and cannot be combined with --check", file=sys.stderr
        )
        return 2
    try:
        if args.trace is not None:
            return _main_overlay(args)
        out, readme, documents = _targets(args)
        shot_root = _screenshot_root(args)
        if args.check:
            problems = stale_diagrams(out, readme, documents)
            if shot_root is not None:
                problems += [problem for problem in [_screenshot_problem(shot_root)] if problem is not None]
            if problems:
                print("The lifecycle diagrams or generated sections are stale:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                print(f"Run `{_regenerate_command(args)}` and commit the result.", file=sys.stderr)
                return 1
            print("lifecycle diagrams and generated sections are up to date")
            return 0
        changed = write_diagrams(out, readme, documents)
        if shot_root is not None and _screenshot_problem(shot_root) is not None:
            changed.append(_write_screenshot(shot_root))
    except DiagramError as exc:
        print(f"fsm-rollout diagram: {exc}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print("lifecycle diagrams and generated sections are up to date")
    if readme is None and not args.no_readme:
        print(
            f"note: not inside an fsm-rollout checkout, so no README was rewritten, nor {CLI_DOC} "
            "(--readme PATH rewrites a README)",
            file=sys.stderr,
        )
    return 0


def _screenshot_root(args: argparse.Namespace) -> Path | None:
    """The checkout whose docs/report.png this run keeps current (the default targets only), or None."""
    from fsm_rollout.report.screenshot import kept_by

    return None if args.out is not None or args.readme is not None or args.no_readme else kept_by(checkout_root())


def _screenshot_problem(root: Path) -> str | None:
    from fsm_rollout.report.screenshot import screenshot_problem

    return screenshot_problem(root)


def _write_screenshot(root: Path) -> Path:
    from fsm_rollout.report.chromium import ChromiumError
    from fsm_rollout.report.screenshot import write_screenshot

    try:
        return Path(os.path.relpath(write_screenshot(root)))
    except ChromiumError as error:  # say what to install
        raise DiagramError(f"docs/report.png is stale and cannot be shot again: {error}") from error


def _main_overlay(args: argparse.Namespace) -> int:
    overlay = write_overlay(args.trace, args.output, args.sample)
    print(f"wrote {args.output} ({overlay.total_samples} samples)")
    if overlay.total_samples == 0:
        print(f"warning: {args.trace} holds no transition events", file=sys.stderr)
    for (trigger, src, dst), count in overlay.unmatched.items():
        print(
            f"warning: {count} transitions {src} --{trigger}--> {dst} are not in the table "
            "(a trace from another version of the lifecycle?)",
            file=sys.stderr,
        )
    return 0
