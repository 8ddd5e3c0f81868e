"""An environment module that defines no ``build_env``: loading it by file path must be rejected."""

from __future__ import annotations

NAME = "env_without_build_env"
