"""``fsm-rollout diagram``: the lifecycle diagrams, drawn from the transition tables and kept in step with them.

The command writes, into ``diagrams/``, from :mod:`fsm_rollout.machine.lifecycle` with
:mod:`fsm_rollout.machine.diagrams`:

``lifecycle.mmd``  the Mermaid ``stateDiagram-v2``;
``lifecycle.dot``  the Graphviz source;
``lifecycle.svg``  ``dot -Tsvg`` of that source;

and ``gateway_session.mmd``/``.dot`` from the gateway session's table. It writes nothing else: the README's and
``docs/cli.md``'s generated sections and the README's screenshot are the maintainers' ``python -m tools.docs``, which
is not installed with the package.

Staleness: the Mermaid and DOT texts are compared byte for byte, but an SVG's bytes depend on the graphviz version
and the installed fonts. So an SVG counts as up to date when the DOT hash it records
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
from pathlib import Path

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

DOCS_COMMAND = "python -m tools.docs"
"""The maintainers' command that writes the documents' generated sections (from a checkout; not installed)."""

MERMAID_FILE = "lifecycle.mmd"
DOT_FILE = "lifecycle.dot"
SVG_FILE = "lifecycle.svg"
DEFAULT_OUT_DIR = Path("diagrams")
"""Where the diagrams go, relative to the checkout (or to the working directory outside one)."""

OVERLAY_FORMATS = (".mmd", ".dot", ".gv", ".svg")
"""File name endings ``--trace ... -o FILE`` accepts; the ending picks the format."""

EPILOG = """\
Without --trace it writes lifecycle.mmd, lifecycle.dot and lifecycle.svg from the table in
fsm_rollout/machine/lifecycle.py, and gateway_session.mmd and gateway_session.dot from the gateway session's table,
into diagrams/ of the checkout (of the working directory outside one; --out DIR elsewhere). The SVG needs Graphviz's
`dot`, and only when it is out of date. --check writes nothing and exits 1 when any of them is stale.

With --trace TRACE -o FILE it draws one recorded run on the lifecycle instead: each edge with the transitions that
took it and the share of samples that did, each state with the samples that entered it and the median of their
dwell times; --sample ID highlights one sample's path. The ending of FILE picks the format (.mmd, .dot or .gv,
.svg).

Exit codes: 0 written (or up to date); 1 stale, under --check; 2 an error (no `dot` for an SVG, an unreadable
trace)."""


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


def diagram_texts() -> dict[str, str]:
    """The text files of ``diagrams/`` as the tables give them now, by file name (the SVG aside)."""
    return {MERMAID_FILE: mermaid(), DOT_FILE: dot(), **session_diagram_files()}


def _current(path: Path) -> str | None:
    try:
        return path.read_bytes().decode()
    except (OSError, UnicodeDecodeError):
        return None


def stale_diagrams(out_dir: Path) -> list[str]:
    """What differs between the files in ``out_dir`` and what the tables give now: one line per stale file, empty
    when everything is up to date.

    The Mermaid and DOT files must match byte for byte; the SVG must be a rendering of the current DOT text
    (:func:`svg_problem`), which is checked without running ``dot``.
    """
    texts = diagram_texts()
    problems = []
    for name, text in texts.items():
        current = _current(out_dir / name)
        if current is None:
            problems.append(f"{out_dir / name} is missing")
        elif current != text:
            problems.append(f"{out_dir / name} differs from the transition table")
    svg = _current(out_dir / SVG_FILE)
    if svg is None:
        problems.append(f"{out_dir / SVG_FILE} is missing")
    else:
        problem = svg_problem(svg, texts[DOT_FILE])
        if problem:
            problems.append(f"{out_dir / SVG_FILE} {problem}")
    return problems


def write_diagrams(out_dir: Path) -> list[Path]:
    """Write the diagrams into ``out_dir``; returns the files changed.

    Files already up to date are left alone, so regenerating an unchanged table changes nothing; the SVG is
    re-rendered (which needs ``dot``) only when it does not match the current DOT text. Everything is computed
    before anything is written: a missing ``dot`` leaves all files as they were.
    """
    texts = diagram_texts()
    writes: dict[Path, str] = {out_dir / name: text for name, text in texts.items()}
    svg = _current(out_dir / SVG_FILE)
    if svg is None or svg_problem(svg, texts[DOT_FILE]) is not None:
        writes[out_dir / SVG_FILE] = render_svg(texts[DOT_FILE])
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
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any diagram is stale")
    # The command used to rewrite the README too: --no-readme is still accepted (it is what the command does now),
    # and --readme PATH says where that moved.
    parser.add_argument("--no-readme", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--readme", type=Path, help=argparse.SUPPRESS)
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


def _out_dir(args: argparse.Namespace) -> Path:
    """``--out``, else ``diagrams/`` of the checkout the working directory is in, else of the working directory."""
    if args.out is not None:
        return Path(args.out)
    root = checkout_root()
    return (Path(os.path.relpath(root)) if root is not None else Path()) / DEFAULT_OUT_DIR


def _regenerate_command(args: argparse.Namespace) -> str:
    return COMMAND + (f" --out {args.out}" if args.out is not None else "")


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout diagram``: 0 done (or up to date), 1 stale under ``--check``, 2 on errors."""
    if args.readme is not None:
        print(
            "fsm-rollout diagram: --readme is gone: the command writes only the diagrams; a checkout's README and "
            f"docs/cli.md sections are written by `{DOCS_COMMAND}` there",
            file=sys.stderr,
        )
        return 2
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
        out = _out_dir(args)
        if args.check:
            problems = stale_diagrams(out)
            if problems:
                print("The lifecycle diagrams are stale:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                print(f"Run `{_regenerate_command(args)}` and commit the result.", file=sys.stderr)
                return 1
            print("lifecycle diagrams are up to date")
            return 0
        changed = write_diagrams(out)
    except DiagramError as exc:
        print(f"fsm-rollout diagram: {exc}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print("lifecycle diagrams are up to date")
    return 0


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
