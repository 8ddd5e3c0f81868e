"""The package's public face: what ``fsm_rollout`` exports, that importing it stays light, and that every other module
says it is internal."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fsm_rollout

PACKAGE = Path(fsm_rollout.__file__).parent

PUBLIC_MODULES = frozenset({
    "fsm_rollout", "fsm_rollout.adapters", "fsm_rollout.adapters.trl_rollout", "fsm_rollout.adapters.verl_agent_loop",
    "fsm_rollout.cli", "fsm_rollout.compat", "fsm_rollout.config", "fsm_rollout.data", "fsm_rollout.data.demo",
    "fsm_rollout.data.practice", "fsm_rollout.distributed", "fsm_rollout.engine", "fsm_rollout.engine.client",
    "fsm_rollout.engine.local", "fsm_rollout.engine.local.default_model",
    "fsm_rollout.engine.local.harness_model", "fsm_rollout.engine.local.thinking_model", "fsm_rollout.engine.probe",
    "fsm_rollout.engine.transport", "fsm_rollout.envs", "fsm_rollout.envs.calculator", "fsm_rollout.envs.geo3k",
    "fsm_rollout.envs.grid", "fsm_rollout.envs.protocol", "fsm_rollout.envs.step", "fsm_rollout.errors",
    "fsm_rollout.examples", "fsm_rollout.examples.agent_gateway", "fsm_rollout.examples.embed_local",
    "fsm_rollout.examples.grpo", "fsm_rollout.examples.grpo_cli", "fsm_rollout.examples.grpo_tiny",
    "fsm_rollout.examples.grpo_tree",
    "fsm_rollout.gateway", "fsm_rollout.hooks", "fsm_rollout.machine", "fsm_rollout.machine.diagrams",
    "fsm_rollout.machine.lifecycle", "fsm_rollout.multimodal", "fsm_rollout.multimodal.codec",
    "fsm_rollout.recording", "fsm_rollout.replay", "fsm_rollout.report", "fsm_rollout.rollout", "fsm_rollout.runner",
    "fsm_rollout.runtime", "fsm_rollout.runtime.dataset", "fsm_rollout.runtime.gc_policy",
    "fsm_rollout.runtime.metrics", "fsm_rollout.runtime.runner", "fsm_rollout.runtime.service", "fsm_rollout.sample",
    "fsm_rollout.testing", "fsm_rollout.testing.chat_templates", "fsm_rollout.testing.envs",
    "fsm_rollout.testing.fake_vllm", "fsm_rollout.testing.templates", "fsm_rollout.testing.tokenizer",
    "fsm_rollout.tokens", "fsm_rollout.tokens.parity", "fsm_rollout.tokens.template_probe",
    "fsm_rollout.tokens.tool_calls", "fsm_rollout.tool_calls", "fsm_rollout.trace", "fsm_rollout.training",
    "fsm_rollout.types", "fsm_rollout.weights", "fsm_rollout.weights.resume_state", "fsm_rollout.weights.suspension",
})  # fmt: skip
"""Modules a user imports by name (the README and the docs point at them). Any other module is internal."""

INTERNAL_MARK = "Internal:"
INTERNAL_PACKAGE_MARK = "Its modules are internal"


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def documented_internal(name: str, known: dict[str, Path]) -> bool:
    """Its docstring starts with "Internal:", or a package above it says its modules are internal."""
    if docstring(known[name]).startswith(INTERNAL_MARK):
        return True
    parts = name.split(".")
    packages = [docstring(known[".".join(parts[:end])]) for end in range(1, len(parts))]
    return any(paragraph.startswith(INTERNAL_PACKAGE_MARK) for text in packages for paragraph in text.split("\n\n"))


def test_every_module_is_public_private_or_documented_as_internal() -> None:
    known = modules()
    undeclared = sorted(
        name for name in known
        if name not in PUBLIC_MODULES and not name.rsplit(".", 1)[-1].startswith("_")
        and not documented_internal(name, known)
    )  # fmt: skip
    assert undeclared == [], f"say '{INTERNAL_MARK}' first in their docstrings, or add them to PUBLIC_MODULES"
    assert sorted(PUBLIC_MODULES - set(known)) == []  # the list names only modules that exist
    marked_public = sorted(name for name in PUBLIC_MODULES if docstring(known[name]).startswith(INTERNAL_MARK))
    assert marked_public == []


def test_the_public_names_are_the_extension_points_and_all_resolve() -> None:
    assert set(fsm_rollout.__all__) >= {
        "Environment", "RolloutHooks", "Transport", "AiohttpTransport", "VLLMClient", "LocalEngine", "RayRolloutPool",
        "RolloutRunner", "RolloutConfig", "RetryPolicy", "Sample", "Status", "Suspender", "RolloutError",
    }  # fmt: skip
    assert fsm_rollout.__all__ == sorted(fsm_rollout.__all__)
    from fsm_rollout.distributed import RayRolloutPool
    from fsm_rollout.engine.local import LocalEngine
    from fsm_rollout.engine.transport import Transport
    from fsm_rollout.envs.protocol import Environment
    from fsm_rollout.hooks import RolloutHooks

    assert (fsm_rollout.LocalEngine, fsm_rollout.RayRolloutPool) == (LocalEngine, RayRolloutPool)
    assert (fsm_rollout.Environment, fsm_rollout.RolloutHooks, fsm_rollout.Transport) == (
        Environment, RolloutHooks, Transport)  # fmt: skip
    assert all(getattr(fsm_rollout, name) is not None for name in fsm_rollout.__all__)
    assert set(fsm_rollout.__all__) <= set(dir(fsm_rollout))


def test_an_unknown_name_is_an_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        fsm_rollout.Nope  # noqa: B018


def test_importing_the_package_loads_no_torch_transformers_ray_or_engine_server() -> None:
    code = (
        "import sys, fsm_rollout; "
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'fsm_rollout.engine.local', "
        "'fsm_rollout.distributed', 'aiohttp.web') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    star = "from fsm_rollout import *; import sys; print('ray' in sys.modules, 'torch' in sys.modules, LocalEngine)"
    out = subprocess.run([sys.executable, "-c", star], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False False <class 'fsm_rollout.engine.local.server.LocalEngine'>")
