"""The package's layout rules, checked on its source: no import cycle, seams instead of subclasses, and no module
writing another object's private attributes."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import fsm_rollout

PACKAGE = Path(fsm_rollout.__file__).parent


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_time_imports(tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    """``(module, name)`` of every import that runs when the module is imported (not those under TYPE_CHECKING or
    inside functions)."""
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.Import):
                for alias in sub.names:
                    yield alias.name, None
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                for alias in sub.names:
                    yield sub.module, alias.name


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules importing it runs, including the packages on the way (``a.b.c`` runs ``a.b``)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges: set[str] = set()
        for module, attr in import_time_imports(ast.parse(path.read_text())):
            target = f"{module}.{attr}" if attr and f"{module}.{attr}" in known else module
            if target not in known:
                continue
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                step = ".".join(parts[:end])
                if step in known and step != name and not name.startswith(step + "."):
                    edges.add(step)
        graph[name] = edges
    return graph


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                cycles.append([*path[path.index(successor):], successor])
            elif successor not in state:
                visit(successor)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_rollout_knows_no_recording_or_replay() -> None:
    imported = {module for module, _ in import_time_imports(ast.parse((PACKAGE / "rollout.py").read_text()))}
    every_import = {
        node.module
        for node in ast.walk(ast.parse((PACKAGE / "rollout.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in imported | every_import if m.startswith(("fsm_rollout.recording", "fsm_rollout.replay"))}


def test_nothing_subclasses_the_engine_client_to_intercept_it() -> None:
    subclasses = [
        f"{path.relative_to(PACKAGE.parent)}:{node.name}"
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("VLLMClient") for base in node.bases)
    ]
    assert subclasses == []


def test_no_module_writes_a_private_attribute_of_another_object() -> None:
    writes = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                for item in ast.walk(target):
                    if (
                        isinstance(item, ast.Attribute)
                        and item.attr.startswith("_")
                        and not item.attr.startswith("__")
                        and not (isinstance(item.value, ast.Name) and item.value.id in ("self", "cls"))
                    ):
                        writes.append(f"{path.relative_to(PACKAGE.parent)}:{item.lineno} {ast.unparse(item)}")
    assert writes == []


def test_a_client_given_a_transport_refuses_http_options_it_would_ignore() -> None:
    import pytest

    from fsm_rollout import VLLMClient
    from fsm_rollout.engine.transport import AiohttpTransport

    transport = AiohttpTransport("http://127.0.0.1:9")
    assert VLLMClient(transport=transport).transport is transport
    with pytest.raises(TypeError, match="api_key, retry"):
        VLLMClient(transport=transport, api_key="k", retry=fsm_rollout.RetryPolicy())
