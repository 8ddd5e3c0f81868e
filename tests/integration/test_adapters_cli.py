"""``fsm-rollout run --env verifiers:NAME / skyrl:NAME / gym:ID / trl:MODULE:CLASS`` against the fake engine: the
environment's own samples where it has a dataset, --data where it has none, rewards in the results; a missing
optional package is one line naming the extra."""

from __future__ import annotations

from pathlib import Path

from test_run_cli import dataset, results, run_command

from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir

HERE = Path(__file__).parent
ON_PATH = {"PYTHONPATH": str(HERE)}


async def run_cli(
    server: FakeVLLMServer, tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``fsm-rollout run`` against ``server`` (the adapters' packages take a while to import: a longer limit)."""
    engine = ("--engine-url", server.url, "--model", "fake-model", "--tokenizer", str(qwen_tokenizer_dir()))
    out = ("--out", str(tmp_path / "results.jsonl"), "--max-new-tokens", "64")
    return await run_command("run", *engine, *out, *extra, env=env)


async def test_a_verifiers_environment_runs_its_own_dataset_from_the_command_line(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    multiply = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    fake_vllm.script([ScriptedTurn(text=multiply), ScriptedTurn(text="42")])
    code, _stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--env", "verifiers:vf-tool-env", "--limit", "1", "--quiet", env=ON_PATH
    )
    assert code == 0, (stderr, [row["metadata"] for row in results(tmp_path)])
    [row] = results(tmp_path)
    assert (row["status"], row["reward"], row["label"]) == ("completed", 1.5, "42")
    assert row["metadata"]["env_stop"] == "no_tools_called"


async def test_a_gem_game_runs_seeded_episodes_without_data(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="\\boxed{99}")] * 2)  # out of range, then past the turn limit
    code, _stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--env", "gym:game:GuessTheNumber-v0-easy", "--limit", "2", "--max-turns", "1",
        "--concurrency", "1", "--quiet",
    )  # fmt: skip
    assert code == 0, stderr
    rows = results(tmp_path)
    assert [row["metadata"]["seed"] for row in rows] == [0, 1]
    assert all(row["prompt"][-1]["content"].startswith("You are playing Guess The Number") for row in rows)
    assert [row["metadata"]["gym"]["rewards"] for row in rows] == [[0.0], [0.0]]


async def test_skyrl_and_trl_environments_run_a_dataset_given_with_data(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="#### 42")])
    data = dataset(tmp_path / "d.jsonl", {"prompt": "What is 40 + 2?", "label": "42"})
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", "skyrl:gsm8k", "--data", str(data), "--quiet")
    assert code == 0, stderr
    assert [(row["status"], row["reward"]) for row in results(tmp_path)] == [("completed", 1.0)]

    probe = '<tool_call>{"name": "probe", "arguments": {"number": 3}}</tool_call>'
    fake_vllm.script([ScriptedTurn(text=probe), ScriptedTurn(text="3")])
    data = dataset(tmp_path / "t.jsonl", {"prompt": "Find it.", "metadata": {"row": {"secret": 3}}})
    env = f"trl:{HERE / 'trl_envs.py'}:HiddenNumberEnv"
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", env, "--data", str(data), "--quiet")
    assert code == 0, stderr
    [row] = results(tmp_path)
    assert (row["status"], row["reward"], row["metadata"]["env_stop"]) == ("completed", 1.0, "no_tool_calls")


async def test_an_environment_without_a_dataset_asks_for_data(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    code, _stdout, stderr = await run_cli(fake_vllm, tmp_path, "--env", "skyrl:gsm8k", "--quiet")
    assert code == 2
    assert stderr.strip().splitlines()[-1] == (
        "error: --env skyrl:gsm8k: a skyrl environment brings no dataset; give one with --data (JSONL: prompt, "
        "label, metadata)"
    )


async def test_a_missing_optional_package_is_one_line_naming_the_extra(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    hidden = tmp_path / "hide"
    (hidden / "gymnasium").mkdir(parents=True)
    (hidden / "gymnasium" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'gymnasium'\", name='gymnasium')\n"
    )
    code, stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--env", "gym:CartPole-v1", "--quiet", env={"PYTHONPATH": str(hidden)}
    )
    assert code == 2 and stdout == ""
    assert stderr == (
        "error: the gym adapter needs gymnasium, which is not installed: pip install 'fsm-rollout[gym]'\n"
    )
