"""Environments named the way their own libraries name them, resolved before anything starts: Gymnasium's
``module:EnvId`` form (a third-party package that registers on import), ``obs_to_text(observation, info)``, the action
text without the end-of-turn token, skyrl-gym's attribute configs and ``aime``'s label, verifiers' environment
arguments and unknown names, ``--env-args``, TRL dataset columns, and ``--env`` without ``--data``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from adapters_support import run_recorded
from test_adapters_cli import HERE, run_cli
from test_run_cli import dataset, one_error_line, results

from fsm_rollout import Sample
from fsm_rollout.adapters import gym_env, skyrl_env, verifiers_env
from fsm_rollout.errors import EnvironmentNotFoundError
from fsm_rollout.runtime.dataset import load_jsonl
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

pytestmark = pytest.mark.own_process  # its framework's import stays out of the suite's process

PACKAGE = "fsm_third_party_gym"
GAME = f"{PACKAGE}:Echo-v0"
ECHO = '''"""A third-party Gymnasium package: importing it registers Echo-v0."""

import gymnasium

ACTIONS = []


class Echo(gymnasium.Env):
    """Asks for a number (its text also in info, as text games keep it), ends after one move."""

    observation_space = gymnasium.spaces.Text(200)
    action_space = gymnasium.spaces.Text(200)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "Say a number.", {"text": f"info: say a number (game {seed})"}

    def step(self, action):
        ACTIONS.append(action)
        return "bye", 1.0, True, False, {"text": "info: bye"}


gymnasium.register(id="Echo-v0", entry_point=Echo, disable_env_checker=True)
'''


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on ``sys.path`` holding the package (the import registers the id; a fresh import per test)."""
    folder = tmp_path / "site"
    (folder / PACKAGE).mkdir(parents=True)
    (folder / PACKAGE / "__init__.py").write_text(ECHO, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop(PACKAGE, None)
    import gymnasium

    gymnasium.envs.registry.pop("Echo-v0", None)


async def test_a_gymnasium_id_in_module_form_imports_the_package_that_registers_it(
    tokenizer: Any, tmp_path: Path, third_party: Path
) -> None:
    factory = gym_env(GAME, obs_to_text=lambda observation, info: info["text"])
    turn = ScriptedTurn(text="\\boxed{2}.<|im_end|>")
    [done] = await run_recorded(tokenizer, tmp_path, factory, [Sample(index=0, metadata={"seed": 7})], [turn])
    assert done.status.value == "completed", done.metadata
    assert done.prompt[-1]["content"] == "info: say a number (game 7)"  # obs_to_text got (observation, info)
    assert done.response.endswith("<|im_end|>")  # the engine's turn text ends with the end token...
    assert sys.modules[PACKAGE].ACTIONS == ["\\boxed{2}."]  # ... which the game's step does not get
    assert done.reward == 1.0


def test_an_unknown_gymnasium_id_is_an_error_when_the_factory_is_made(third_party: Path) -> None:
    with pytest.raises(EnvironmentNotFoundError, match=f"importing '{PACKAGE}' registered no Gymnasium environment"):
        gym_env(f"{PACKAGE}:Missing-v0")
    with pytest.raises(EnvironmentNotFoundError, match="no module 'no_such_gym_pkg' to import"):
        gym_env("no_such_gym_pkg:Echo-v0")


async def test_the_command_line_runs_a_third_party_gymnasium_package(
    fake_vllm: FakeVLLMServer, tmp_path: Path, third_party: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="7")] * 2)
    code, _stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--env", f"gym:{GAME}", "--limit", "2", "--quiet", env={"PYTHONPATH": str(third_party)}
    )
    assert code == 0, stderr
    rows = results(tmp_path)
    assert [(row["status"], row["reward"], row["prompt"][-1]["content"]) for row in rows] == [
        ("completed", 1.0, "Say a number.")
    ] * 2


async def test_a_wrong_environment_is_one_line_before_any_engine_is_reached(tmp_path: Path) -> None:
    from test_run_cli import run_command

    nowhere = ("--engine-url", "http://127.0.0.1:9", "--out", str(tmp_path / "r.jsonl"), "--quiet")
    code, stdout, stderr = await run_command("run", *nowhere, "--env", "gym:NoSuchGame-v9")
    assert code == 2 and stdout == ""
    assert one_error_line(stderr).startswith("error: gym adapter: no Gymnasium or GEM environment is registered as")

    code, _stdout, stderr = await run_command("run", *nowhere, "--env", "verifiers:no-such-vf-env")
    assert code == 2
    assert one_error_line(stderr) == (
        "error: verifiers adapter: no verifiers environment 'no-such-vf-env' is installed (verifiers imports the "
        "module 'no_such_vf_env'; install its Environments Hub package)"
    )

    module = tmp_path / "my_env.py"
    module.write_text("def build_env(*, sample, args):\n    raise AssertionError('never built')\n", encoding="utf-8")
    code, _stdout, stderr = await run_command("run", *nowhere, "--env", str(module))
    assert code == 2
    assert one_error_line(stderr).startswith(f"error: --env {module} brings no dataset (no demo_samples()): give one")


def test_a_module_id_whose_module_is_missing_is_refused_without_importing_gem() -> None:
    import subprocess

    probe = (
        "import sys\n"
        "from fsm_rollout.envs.adapters.gym import gym_maker\n"
        "from fsm_rollout.errors import EnvironmentNotFoundError\n"
        "for env_id in ('nosuchpkg:NoSuch-v0', 'game:GuessTheNumber-v0-easy'):\n"
        "    try:\n"
        "        gym_maker(env_id)\n"
        "        print(env_id, 'found', 'gem' in sys.modules)\n"
        "    except EnvironmentNotFoundError as error:\n"
        "        print(env_id, error, 'gem' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.splitlines() == [
        "nosuchpkg:NoSuch-v0 gym adapter: no Gymnasium or GEM environment is registered as 'nosuchpkg:NoSuch-v0' "
        "(no module 'nosuchpkg' to import for the form module:EnvId) False",  # GEM's source writes no 'nosuchpkg:'
        "game:GuessTheNumber-v0-easy found True",  # a prefix GEM does write: GEM is imported and has it
    ]


class NeedsAttributes:
    """A skyrl-gym-style environment that reads its config by attribute, as skyrl's search environment does."""

    def __init__(self, env_config: Any, extras: dict[str, Any]) -> None:
        self.url = env_config.search_url
        self.topk = env_config.topk

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [*prompt, {"role": "user", "content": f"search at {self.url}, top {self.topk}"}], {}

    def step(self, action: str) -> dict[str, Any]:
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {"action": action}}

    def close(self) -> None:
        return None


async def test_a_skyrl_config_given_as_a_dict_is_read_by_attribute(tokenizer: Any, tmp_path: Path) -> None:
    factory = skyrl_env(NeedsAttributes, env_config={"search_url": "http://search", "topk": 3})
    [done] = await run_recorded(
        tokenizer, tmp_path, factory, [Sample(index=0, prompt="Find it.")], [ScriptedTurn(text="found<|im_end|>")]
    )
    assert done.status.value == "completed", done.metadata
    assert done.prompt[-1]["content"] == "search at http://search, top 3"
    assert done.metadata["skyrl"]["metadata"] == [{"action": "found"}]  # without the end-of-turn token


async def test_a_skyrl_environment_that_reads_a_config_it_was_not_given_says_how_to_give_it(
    tokenizer: Any, tmp_path: Path
) -> None:
    [done] = await run_recorded(
        tokenizer, tmp_path, skyrl_env(NeedsAttributes), [Sample(index=0, prompt="Find it.")], [ScriptedTurn(text="x")]
    )
    assert done.status.value == "failed"
    assert done.metadata["rollout_error"]["message"] == (
        "skyrl adapter: make of 'NeedsAttributes' read its env_config, and none was given ('NoneType' object has no "
        "attribute 'search_url'): pass env_config= to skyrl_env (--env-args JSON on the command line)"
    )


async def test_aime_gets_the_label_where_it_reads_it(tokenizer: Any, tmp_path: Path) -> None:
    [done] = await run_recorded(
        tokenizer, tmp_path, skyrl_env("aime"), [Sample(index=0, prompt="What is 6 * 7?", label="42")],
        [ScriptedTurn(text="Answer: 42")],
    )  # fmt: skip
    assert (done.status.value, done.reward) == ("completed", 1.0), done.metadata


async def test_env_args_reach_a_skyrl_config_and_verifiers_load_environment(
    fake_vllm: FakeVLLMServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    assert verifiers_env("vf-tool-env", env_args={"max_turns": 2}).env.max_turns == 2

    fake_vllm.script([ScriptedTurn(text="#### 42")])
    data = dataset(tmp_path / "d.jsonl", {"prompt": "What is 40 + 2?", "label": "42"})
    on_path = {"PYTHONPATH": str(HERE)}
    module = f"{HERE / 'trl_envs.py'}"
    code, _stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--env", "skyrl:gsm8k", "--env-args", '{"unused": 1}', "--data", str(data), "--quiet",
        env=on_path,
    )  # fmt: skip
    assert code == 0, stderr
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", module, "--env-args", "{}", "--quiet")
    assert code == 2 and "--env-args is for --env skyrl:NAME" in one_error_line(stderr)
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", "skyrl:gsm8k", "--env-args", "[1]")
    assert code == 2 and "--env-args: a JSON object is needed, got list" in stderr


def test_a_trl_datasets_own_columns_become_the_row(tmp_path: Path) -> None:
    data = dataset(tmp_path / "d.jsonl", {"prompt": "Find it.", "start": 3, "metadata": {"row": {"secret": 5}}})
    [sample] = load_jsonl(data, columns_to_row=True).samples
    assert sample.metadata["row"] == {"secret": 5, "start": 3}
    with pytest.raises(ValueError, match=r"unknown keys \['start'\]"):
        load_jsonl(data)


async def test_the_command_line_hands_a_trl_environment_its_datasets_columns(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    probe = '<tool_call>{"name": "probe", "arguments": {"number": 3}}</tool_call>'
    fake_vllm.script([ScriptedTurn(text=probe), ScriptedTurn(text="3")])
    data = dataset(tmp_path / "t.jsonl", {"prompt": "Find it.", "secret": 3})
    env = f"trl:{HERE / 'trl_envs.py'}:HiddenNumberEnv"
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", env, "--data", str(data), "--quiet")
    assert code == 0, stderr
    [row] = results(tmp_path)
    assert (row["status"], row["reward"], row["metadata"]["row"]) == ("completed", 1.0, {"secret": 3})
