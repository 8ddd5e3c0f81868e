"""An importable verifiers environment module, as an Environments Hub package is one: ``load_environment()``."""

from __future__ import annotations

from verifiers_envs import load_tool_environment as load_environment

__all__ = ["load_environment"]
