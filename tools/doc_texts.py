"""The generated reference texts: the README's lifecycle table and layout map, and docs/cli.md's command line.

All are made from what the code runs (the transition table in :mod:`fsm_rollout.machine.lifecycle`, the parsers of
:mod:`fsm_rollout.cli`, the package's modules and their docstrings), and ``python -m tools.docs`` writes them between
their markers, so the documents cannot describe a table, an option or a module that is not there. The output
depends on nothing but the code (not on the terminal width or the Python version's help layout), so a check on
another machine compares equal. argparse has no public API for its actions, groups and help formatting, so the
command-line reference reads its private names.
"""

from __future__ import annotations

import argparse
import ast
import re
import textwrap
from pathlib import Path

from fsm_rollout.machine import lifecycle
from fsm_rollout.machine.diagrams import catch_all_groups

SYNOPSIS_WIDTH = 100
"""Where the synopsis lines wrap."""

_NONE = "—"


# ---------------------------------------------------------------------------------------------- lifecycle table


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else _NONE


def _work(edge_work: str, dest: lifecycle.StateSpec) -> str:
    """What taking an edge does: its own work, then the activity of the state it enters."""
    parts = [edge_work] if edge_work else []
    if dest.activity and dest.doc:
        parts.append(f"activity: {dest.doc}")
    return "; ".join(parts)


def lifecycle_table() -> str:
    """The transition table as a Markdown table, one row per edge in table order.

    Edges that exist alike from every non-terminal state (``abort``, ``fail``) are one row "any non-terminal"; the
    first row is the start, with the initial state's activity. Guards are listed in the order they are tried.
    """
    transitions = lifecycle.TRANSITIONS
    groups = catch_all_groups(transitions)
    group_of = {index: group for group in groups for index in group}
    initial = lifecycle.STATE_BY_NAME[lifecycle.INITIAL]
    rows = [
        "| from | trigger | guard (first match wins) | to | reason | work |",
        "|---|---|---|---|---|---|",
        f"| [*] | {_NONE} | {_NONE} | {initial.name} | {_NONE} | {_cell(_work('', initial))} |",
    ]
    for index, edge in enumerate(transitions):
        group = group_of.get(index)
        if group is not None and index != group[0]:
            continue
        source = "any non-terminal" if group is not None else edge.source
        guard = f"`{edge.guard}`" if edge.guard else ""
        reason = f"`{edge.reason}`" if edge.reason else ""
        work = _work(edge.work, lifecycle.STATE_BY_NAME[edge.dest]) if edge.dest in lifecycle.STATE_BY_NAME else ""
        rows.append(f"| {source} | {edge.trigger} | {_cell(guard)} | {edge.dest} | {_cell(reason)} | {_cell(work)} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- command line


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option(action: argparse.Action) -> str:
    """An option as the synopsis and the table show it: ``--name METAVAR`` (or the positional's name)."""
    if not action.option_strings:
        return str(action.metavar or action.dest)
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.metavar is not None:
        metavar = str(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        metavar = action.dest.upper()
    return f"{names} {metavar}"


def _shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)


def _synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    """``prog [--a A] [--b | --c] POSITIONAL``, wrapped at :data:`SYNOPSIS_WIDTH`."""
    exclusive = {id(action): group for group in parser._mutually_exclusive_groups for action in group._group_actions}
    parts: list[str] = []
    done: set[int] = set()
    for action in parser._actions:
        if not _shown(action) or id(action) in done:
            continue
        if not action.option_strings:
            parts.append(_option(action))
            continue
        group = exclusive.get(id(action))
        members = [member for member in group._group_actions if _shown(member)] if group is not None else [action]
        done.update(id(member) for member in members)
        shortest = [_option(member).split(", ")[-1] for member in members]  # the long name reads better
        parts.append("[" + " | ".join(shortest) + "]")
    positionals = [part for part in parts if not part.startswith("[")]
    options = [part for part in parts if part.startswith("[")]
    indent = " " * (len(prog) + 1)
    lines = [prog]
    for part in [*options, *positionals]:  # wrapped between items, never inside one
        if len(lines[-1]) + 1 + len(part) > SYNOPSIS_WIDTH and lines[-1] != prog:
            lines.append(indent + part)
        else:
            lines[-1] += " " + part
    return "\n".join(lines)


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """An option's help as ``--help`` prints it (its default included), on one line."""
    if not action.help:
        return ""
    return " ".join(formatter._expand_help(action).split())


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| option | meaning |", "|---|---|"]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if _shown(action)]
        if not actions:
            continue
        if group is not parser._positionals and group is not parser._optionals and group.title:
            rows.append(f"| *{group.title}* | |")
        rows.extend(f"| `{_cell(_option(action))}` | {_cell(_help(formatter, action))} |" for action in actions)
    return rows


def command_line() -> str:
    """Every subcommand: its one-line help, synopsis, options with their help and defaults, and its epilog."""
    from fsm_rollout.cli import SUBCOMMANDS, build_parser

    parsers = _subcommands(build_parser())
    blocks = ["Every command takes `-h`/`--help`, which prints the same with the current defaults."]
    for name, (_module, help_text) in SUBCOMMANDS.items():
        parser = parsers[name]
        prog = f"fsm-rollout {name}"
        block = [
            f"### `{prog}`",
            "",
            help_text[0].upper() + help_text[1:] + ".",
            "",
            "```text",
            _synopsis(prog, parser),
            "```",
            "",
            *_option_rows(parser),
        ]
        if parser.epilog:
            block += ["", parser.epilog]
        blocks.append("\n".join(block))
    return "\n\n".join(blocks) + "\n"


# ---------------------------------------------------------------------------------------------- layout map

LAYOUT_WIDTH = 120
"""Where the layout map's descriptions wrap."""

_LAYOUT_NAME_COLUMN = 26


_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def _plain(text: str) -> str:
    """reST markup as plain text: ``:class:`~a.B``` reads ``B``, ``:mod:`a.b``` reads ``a.b``, literals lose their
    double backquotes."""
    text = _ROLE.sub(lambda role: role[2].rsplit(".", 1)[-1] if role[1] else role[2], text)
    return text.replace("``", "")


def module_summary(path: Path) -> str:
    """The first sentence of a module's docstring (its first paragraph up to the first ``. ``), on one line, plain."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(docstring.split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return _plain(paragraph[: end + 1] if end >= 0 else paragraph).strip()


def _layout_entries(directory: Path, depth: int, max_depth: int | None) -> list[tuple[str, int, str]]:
    entries: list[tuple[str, int, str]] = []
    for child in sorted(directory.iterdir(), key=lambda item: (item.is_dir(), item.name)):
        if child.is_dir() and (child / "__init__.py").is_file():
            entries.append((child.name + "/", depth, module_summary(child / "__init__.py")))
            if max_depth is None or depth < max_depth:
                entries += _layout_entries(child, depth + 1, max_depth)
        elif child.suffix == ".py" and child.name != "__init__.py":
            entries.append((child.name, depth, module_summary(child)))
    return entries


def layout_map(max_depth: int | None = 0) -> str:
    """The package's layout, one entry per module and package with the first sentence of its docstring, in a fenced
    block: modules first, then packages, each alphabetical. ``max_depth`` 0 lists what lies directly in
    ``fsm_rollout/`` (the README's map); None lists every module at every depth."""
    import fsm_rollout

    root = Path(fsm_rollout.__file__).parent
    lines = ["```", "fsm_rollout/"]
    for name, depth, summary in _layout_entries(root, 0, max_depth):
        label = "  " * (depth + 1) + name
        indent = " " * max(_LAYOUT_NAME_COLUMN, len(label) + 1)
        wrapped = textwrap.wrap(summary, LAYOUT_WIDTH - len(indent), break_on_hyphens=False) or [""]
        lines.append((label.ljust(len(indent)) + wrapped[0]).rstrip())
        lines += [indent + more for more in wrapped[1:]]
    lines.append("```")
    return "\n".join(lines) + "\n"
