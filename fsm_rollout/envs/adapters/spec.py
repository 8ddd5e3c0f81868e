"""Internal: the adapters' names on the command line and in ``RolloutConfig.env_path`` (``verifiers:NAME``,
``skyrl:NAME``, ``gym:ID`` and ``trl:MODULE:CLASS``), and the samples an environment brings when it has one.

:func:`fsm_rollout.envs.protocol.load_env_factory` resolves these names here, so the CLI, the runner, the Ray pool's
workers and replay all accept them wherever they accept an environment module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from fsm_rollout.errors import EnvironmentContractError, EnvironmentNotFoundError

PREFIXES = ("verifiers", "skyrl", "gym", "trl")
FORMS = "verifiers:NAME, skyrl:NAME, gym:ID or trl:MODULE:CLASS"
DEFAULT_EPISODES = 4
"""Episodes ``--env gym:ID`` runs without ``--data`` or ``--limit`` (a game has no dataset: seeds 0, 1, ...)."""


def is_adapter_spec(target: str) -> bool:
    """Whether ``target`` names an environment through an adapter (``gym:...`` and the like)."""
    prefix, colon, _rest = target.partition(":")
    return bool(colon) and prefix in PREFIXES


def _split(target: str) -> tuple[str, str]:
    prefix, _colon, rest = target.partition(":")
    if prefix not in PREFIXES:
        raise EnvironmentNotFoundError(f"{target!r} names no adapter; the forms are {FORMS}", name=target)
    if not rest:
        raise EnvironmentNotFoundError(f"{target!r} names no environment after {prefix}:; the forms are {FORMS}")
    return prefix, rest


ENV_ARGS_FORMS = "--env skyrl:NAME (its env_config), verifiers:NAME (load_environment's arguments) or gym:ID (make's)"


def factory_from_spec(
    target: str, *, load_module: Callable[[str], ModuleType], env_args: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """The environment factory ``target`` names; ``load_module`` imports ``trl:``'s module (a dotted name or a
    ``.py`` path). ``env_args`` (``--env-args``) are a skyrl environment's ``env_config``, the keyword arguments of a
    verifiers environment's ``load_environment`` or of Gymnasium's ``make``."""
    prefix, rest = _split(target)
    if prefix == "verifiers":
        from fsm_rollout.envs.adapters.verifiers import verifiers_env

        return verifiers_env(rest, env_args=env_args)
    if prefix == "skyrl":
        from fsm_rollout.envs.adapters.skyrl import skyrl_env

        return skyrl_env(rest, env_config=env_args)
    if prefix == "gym":
        from fsm_rollout.envs.adapters.gym import gym_env

        return gym_env(rest, make_kwargs=env_args)
    if env_args is not None:
        raise EnvironmentContractError(f"--env {target}: a TRL environment class takes no --env-args (the forms: "
                                       f"{ENV_ARGS_FORMS})")  # fmt: skip
    from fsm_rollout.envs.adapters.trl import trl_env

    module_name, colon, class_name = rest.rpartition(":")
    if not colon or not module_name or not class_name:
        raise EnvironmentNotFoundError(f"{target!r}: the form is trl:MODULE:CLASS (a module or .py path, a class)")
    cls = getattr(load_module(module_name), class_name, None)
    if not callable(cls):
        raise EnvironmentContractError(f"{target!r}: {module_name} has no class {class_name!r}")
    return trl_env(cls)


def samples_from_spec(target: str, factory: Any, *, limit: int | None) -> list[Any]:
    """The samples the environment behind ``target`` brings: a verifiers environment's dataset, or ``limit``
    (default :data:`DEFAULT_EPISODES`) seeded episodes of a game. An environment without one is an error that
    asks for ``--data``."""
    prefix, _rest = _split(target)
    if prefix == "verifiers":
        from fsm_rollout.envs.adapters.verifiers import verifiers_samples

        return verifiers_samples(factory, n=-1 if limit is None else limit)
    if prefix == "gym":
        from fsm_rollout.envs.adapters.gym import gym_samples

        return gym_samples(DEFAULT_EPISODES if limit is None else limit)
    raise EnvironmentContractError(
        f"--env {target}: a {prefix} environment brings no dataset; give one with --data (JSONL: prompt, label, "
        "metadata)"
    )
