"""The environment protocol a rollout steps, and loading environment modules by name or file path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from fsm_rollout.envs.pool import env_thread_pool as env_thread_pool  # re-exported: its home before the adapters
from fsm_rollout.envs.step import as_step_result
from fsm_rollout.errors import EnvironmentContractError, EnvironmentLoadError, EnvironmentNotFoundError


@runtime_checkable
class Environment(Protocol):
    """One sample's interaction environment.

    ``step`` receives the decoded text of a generated turn (a :class:`~fsm_rollout.envs.step.Turn` instead when the
    class sets ``accepts_turn = True``) and returns a :class:`~fsm_rollout.envs.step.StepResult`, or the older
    3-tuple ``(observation, done, info)`` (``info["reward"]`` and a bool ``info["truncated"]`` become the step's
    ``reward`` and ``truncated``). A step's ``reward``, when not None, becomes ``sample.reward``; ``truncated`` with
    ``done`` ends the sample ``truncated`` (reason ``env_truncated``: the episode was cut short, as by a time
    limit) instead of ``completed``. ``format_observation`` turns an observation into a
    text-only chat message ``{"role", "content"}``, or a non-empty list of them (one ``{"role": "tool", "content",
    "tool_call_id"}`` result per tool call, say), which is appended as one observation rendered as the template
    renders those messages together. Any method (and ``build_env``) may be a coroutine function or return an
    awaitable: the rollout awaits it. Optional: ``snapshot() -> dict`` and ``restore(state)``, so that a sample
    suspended for a weight update can resume in another process.
    """

    def reset(self) -> Any: ...

    def step(self, response_text: Any) -> Any: ...

    def format_observation(self, observation: Any) -> dict[str, Any] | list[dict[str, Any]]: ...

    def close(self) -> Any: ...


EnvFactory = Callable[..., Environment]
"""``build_env(sample=..., args=...)``: builds one sample's environment (called with keywords only)."""

_FILE_MODULES: dict[Path, ModuleType] = {}
_FILE_MODULES_LOCK = threading.Lock()


def load_env_module(target: str) -> ModuleType:
    """Import an environment module by dotted name, or from a ``.py`` file (loaded once per resolved path)."""
    path = Path(target).expanduser()
    if path.suffix == ".py":
        if not path.exists():
            raise EnvironmentNotFoundError(f"environment file {target!r} does not exist", path=str(path))
        resolved = path.resolve()
        with _FILE_MODULES_LOCK:
            module = _FILE_MODULES.get(resolved)
            if module is None:
                module = _exec_file_module(resolved)
                _FILE_MODULES[resolved] = module
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        missing = error.name or target
        if target == missing or target.startswith(f"{missing}."):
            hint = "give a dotted module name on sys.path or a path to a .py file"
        else:  # the module exists but one of its own imports does not
            hint = f"the environment module imports {missing!r}, which is not installed"
        raise EnvironmentNotFoundError(
            f"cannot import environment module {target!r}: {error} ({hint})", name=missing, path=error.path
        ) from error


def _exec_file_module(path: Path) -> ModuleType:
    name = f"rollout_env_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EnvironmentLoadError(f"cannot import environment module from {path}", path=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(name, None)
        raise EnvironmentLoadError(
            f"environment file {path} has a syntax error at line {error.lineno}: {error.msg}", path=str(path)
        ) from error
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def env_factory_from_module(module: ModuleType) -> EnvFactory:
    """The module's ``build_env``; a clear error when it is missing or not callable."""
    build_env = getattr(module, "build_env", None)
    if not callable(build_env):
        raise EnvironmentContractError(
            f"Environment module {module.__name__!r} must expose a callable build_env(sample, args)."
        )
    factory: EnvFactory = build_env
    return factory


def load_env_factory(target: str) -> EnvFactory:
    """Load ``build_env`` from an environment module name or ``.py`` path, or build it through an adapter
    (``verifiers:NAME``, ``skyrl:NAME``, ``gym:ID``, ``trl:MODULE:CLASS``; see :mod:`fsm_rollout.adapters`, resolved in
    :mod:`fsm_rollout.envs.adapters.spec`)."""
    from fsm_rollout.envs.adapters.spec import factory_from_spec, is_adapter_spec

    if is_adapter_spec(target):
        factory: EnvFactory = factory_from_spec(target, load_module=load_env_module)
        return factory
    return env_factory_from_module(load_env_module(target))


def check_environment(env: Any) -> Environment:
    """Check that a built environment has the four protocol methods."""
    methods = ("reset", "step", "format_observation", "close")
    missing = [name for name in methods if not callable(getattr(env, name, None))]
    if missing:
        raise EnvironmentContractError(
            f"build_env returned {type(env).__name__}, which lacks the environment method(s) {missing}"
        )
    checked: Environment = env
    return checked


def unpack_step_result(result: Any) -> tuple[Any, bool]:
    """Split ``env.step``'s result into ``(observation, done)`` (:func:`fsm_rollout.envs.step.as_step_result`)."""
    step = as_step_result(result)
    return step.observation, step.done
