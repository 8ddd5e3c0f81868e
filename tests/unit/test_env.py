"""Loading environment modules and checking the environment protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_rollout.envs.protocol import check_environment, load_env_factory, load_env_module, unpack_step_result
from fsm_rollout.errors import EnvironmentContractError, EnvironmentLoadError, EnvironmentNotFoundError
from fsm_rollout.testing.envs import ScriptedEnv, build_env


def test_modules_load_by_dotted_name() -> None:
    assert load_env_factory("fsm_rollout.testing.envs") is build_env


def write_env(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_a_py_file_loads_once_per_path(tmp_path: Path) -> None:
    path = write_env(
        tmp_path / "my_env.py", "LOADS = []\nLOADS.append(1)\ndef build_env(sample, args):\n    return None\n"
    )
    first = load_env_module(str(path))
    second = load_env_module(str(path))
    assert first is second
    assert first.LOADS == [1]
    assert first.__name__ == "rollout_env_my_env"


def test_a_missing_py_file_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentLoadError, match="does not exist"):
        load_env_module(str(tmp_path / "absent.py"))


def test_a_missing_module_is_a_load_error_and_an_import_error() -> None:
    with pytest.raises(EnvironmentLoadError, match="no_such_env_module") as caught:
        load_env_module("no_such_env_module")
    assert isinstance(caught.value, ImportError)


@pytest.mark.parametrize(
    ("target", "missing"),
    [
        ("no_such_env_module", "no_such_env_module"),
        ("no_such_pkg.env", "no_such_pkg"),
        ("os.no_such_env", "os.no_such_env"),
    ],
)
def test_a_missing_module_is_a_module_not_found_error_as_in_the_seed(target: str, missing: str) -> None:
    with pytest.raises(ModuleNotFoundError) as caught:  # what code written against the seed catches
        load_env_module(target)
    assert isinstance(caught.value, EnvironmentNotFoundError) and isinstance(caught.value, EnvironmentLoadError)
    assert caught.value.name == missing
    assert "dotted module name" in str(caught.value)


def test_a_missing_py_file_is_a_module_not_found_error_as_in_the_seed(tmp_path: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match="does not exist") as caught:
        load_env_module(str(tmp_path / "absent.py"))
    assert isinstance(caught.value, EnvironmentNotFoundError)


def test_a_missing_import_of_the_environment_module_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_env(tmp_path / "env_with_missing_dep.py", "import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        EnvironmentNotFoundError, match="imports 'no_such_dependency_xyz', which is not installed"
    ) as caught:
        load_env_module("env_with_missing_dep")
    assert isinstance(caught.value, ModuleNotFoundError) and caught.value.name == "no_such_dependency_xyz"


def test_a_module_without_build_env_is_a_contract_error(tmp_path: Path) -> None:
    path = write_env(tmp_path / "no_build.py", "x = 1\n")
    with pytest.raises(EnvironmentContractError, match="callable build_env") as caught:
        load_env_factory(str(path))
    assert isinstance(caught.value, ValueError)


def test_a_non_callable_build_env_is_a_contract_error(tmp_path: Path) -> None:
    path = write_env(tmp_path / "bad_build.py", "build_env = 3\n")
    with pytest.raises(EnvironmentContractError):
        load_env_factory(str(path))


def test_an_environment_must_have_the_four_methods() -> None:
    check_environment(ScriptedEnv())

    class Partial:
        def reset(self) -> None: ...

        def step(self, text: str) -> None: ...

    with pytest.raises(EnvironmentContractError, match="format_observation"):
        check_environment(Partial())


def test_step_results_unpack_to_observation_and_done() -> None:
    assert unpack_step_result(("obs", 1, {})) == ("obs", True)


@pytest.mark.parametrize("result", [("obs", False), ("obs", False, {}, 1), None, ["obs", False, {}]])
def test_step_results_must_be_three_tuples(result: object) -> None:
    with pytest.raises(EnvironmentContractError, match="3-tuple"):
        unpack_step_result(result)


def test_the_one_adapter_reads_a_step_result_or_the_old_3_tuple() -> None:
    from fsm_rollout.envs.step import EndReason, StepResult, as_step_result

    typed = StepResult("obs", done=True, end=EndReason.SESSION_CLOSED)
    assert as_step_result(typed) is typed
    old = as_step_result(("obs", 1, {"reward": 2.0, "truncated": True, "other": "kept"}))
    assert (old.observation, old.done, old.reward, old.truncated, old.end) == ("obs", True, 2.0, True, None)
    assert old.info == {"reward": 2.0, "truncated": True, "other": "kept"}
    assert as_step_result(("obs", False, None)) == StepResult("obs")
    with pytest.raises(EnvironmentContractError, match=r"info\['truncated'\] must be a bool"):
        as_step_result(("obs", True, {"truncated": "yes"}))
    with pytest.raises(EnvironmentContractError, match="must be done"):
        StepResult(None, end=EndReason.AGENT_TIMEOUT)
    with pytest.raises(EnvironmentContractError, match="3-tuple"):
        as_step_result(("obs", True))


def test_a_step_result_round_trips_through_its_json() -> None:
    from fsm_rollout.envs.step import EndReason, NextCall, Rewrite, StepResult

    step = StepResult(
        [{"role": "user", "content": "hi"}],
        done=True,
        reward=1.0,
        end=EndReason.SESSION_CLOSED,
        next_call=NextCall({"temperature": 0.5}, Rewrite(({"role": "user", "content": "x"},), None, "messages[0]")),
        info={"k": [1, 2]},
    )
    assert StepResult.from_json(step.to_json()) == step
