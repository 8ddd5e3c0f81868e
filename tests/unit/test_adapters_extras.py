"""Each adapter without its optional package: one line naming the extra that installs it; an adapter form on the
command line that names nothing is a clear error too."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from fsm_rollout.adapters import gym_env, skyrl_env, verifiers_env
from fsm_rollout.envs.adapters.spec import factory_from_spec, is_adapter_spec
from fsm_rollout.envs.protocol import load_env_factory, load_env_module
from fsm_rollout.errors import EnvironmentNotFoundError, MissingExtraError

CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("gymnasium", lambda: gym_env("CartPole-v1"), "the gym adapter needs gymnasium, which is not installed: "
     "pip install 'fsm-rollout[gym]'"),
    ("skyrl_gym", lambda: skyrl_env("gsm8k"), "the skyrl adapter needs skyrl-gym, which is not installed: "
     "pip install 'fsm-rollout[skyrl]'"),
    ("verifiers", lambda: verifiers_env("anything"), "the verifiers adapter needs verifiers<0.4, which is not "
     "installed: pip install 'fsm-rollout[verifiers]'"),
]  # fmt: skip


@pytest.mark.parametrize("module, make, message", CASES, ids=[case[0] for case in CASES])
def test_a_missing_package_names_the_extra(
    module: str, make: Callable[[], Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails as if it were not installed
    with pytest.raises(MissingExtraError) as raised:
        make()
    assert str(raised.value) == message and "\n" not in str(raised.value)


def test_adapter_forms_are_told_apart_from_module_names() -> None:
    assert [is_adapter_spec(name) for name in ("gym:x", "trl:m:C", "fsm_rollout.envs.geo3k", "other:x")] == [
        True,
        True,
        False,
        False,
    ]
    with pytest.raises(EnvironmentNotFoundError, match="names no environment after gym:"):
        load_env_factory("gym:")
    with pytest.raises(EnvironmentNotFoundError, match="the form is trl:MODULE:CLASS"):
        factory_from_spec("trl:only_a_module", load_module=load_env_module)
