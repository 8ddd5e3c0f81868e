"""``fsm-rollout run`` and the start-up template probe: append on a template whose observation boundary cannot be cut
exits 2 once, with the probe's explanation, before any sample runs; auto runs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from test_run_cli import dataset, done_after_one_turn, one_error_line, run_cli  # pytest puts this directory on sys.path

from fsm_rollout.cli.run import add_arguments
from fsm_rollout.testing.chat_templates import tokenizer_with_chat_template
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn


def takes_history_policy() -> bool:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return any("--history-policy" in action.option_strings for action in parser._actions)


@pytest.fixture
def qwen3_6_dir(tmp_path: Path) -> Path:
    """A tokenizer directory wearing Qwen3.6's template, which strips user-turn thinking."""
    directory = tmp_path / "qwen3_6"
    tokenizer_with_chat_template("qwen3_6").save_pretrained(str(directory))
    return directory


async def test_append_on_a_template_whose_boundary_cannot_be_cut_exits_2_once_with_the_probes_explanation(
    fake_vllm: FakeVLLMServer, tmp_path: Path, qwen3_6_dir: Path
) -> None:
    if not takes_history_policy():
        pytest.skip("--history-policy comes with RolloutConfig.history_policy (the forks branch)")
    data = dataset(tmp_path / "d.jsonl", *(done_after_one_turn(f"q{n}") for n in range(3)))
    engine = ("--engine-url", fake_vllm.url, "--model", "fake-model", "--tokenizer", str(qwen3_6_dir))
    code, _, stderr = await run_cli(
        fake_vllm, tmp_path, "--data", str(data), "--history-policy", "append", engine=engine
    )
    assert code == 2
    line = one_error_line(stderr)  # once, not per sample
    assert "history_policy='append' cannot run" in line and "boundary cannot be cut" in line
    assert "user observations" in line
    assert not fake_vllm.requests_to(RENDER_PATH) and not fake_vllm.requests_to(GENERATE_PATH)


async def test_auto_runs_on_the_same_template(fake_vllm: FakeVLLMServer, tmp_path: Path, qwen3_6_dir: Path) -> None:
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q0"))
    fake_vllm.script([ScriptedTurn(text="42")])
    engine = ("--engine-url", fake_vllm.url, "--model", "fake-model", "--tokenizer", str(qwen3_6_dir))
    code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), engine=engine)
    assert code == 0, stderr
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1


async def test_run_says_which_policy_auto_chose_and_why_and_the_summary_and_inspect_count_the_forks(
    tmp_path: Path, qwen3_6_dir: Path
) -> None:
    from test_run_cli import run_command

    two_turns = {"prompt": "q", "label": "1", "metadata": {"scripted_env": {"steps": [["again", False], ["ok", True]]}}}
    data = dataset(tmp_path / "d.jsonl", two_turns)
    # the engine's template drops the first turn's thinking once a user turn follows: the history is rewritten
    thinking = ["<think>\nSix sevens.\n</think>\n\nIt is 42.<|im_end|>", "<think>\nAgain.\n</think>\n\n42.<|im_end|>"]
    async with FakeVLLMServer(tokenizer_with_chat_template("qwen3_6")) as server:
        server.script([ScriptedTurn(text=text) for text in thinking])
        engine = ("--engine-url", server.url, "--model", "fake-model", "--tokenizer", str(qwen3_6_dir))
        code, stdout, stderr = await run_cli(server, tmp_path, "--data", str(data), "--max-turns", "2", "--quiet",
                                             engine=engine)  # fmt: skip
    assert code == 0, stderr
    [policy] = [line for line in stderr.splitlines() if line.startswith("history policy:")]
    assert policy.startswith("history policy: auto chose fork (chat template") and "rewritten" in policy, policy
    assert "history: 1 fork(s), 2 training sequence(s) from 1 sample(s)" in stdout, stdout
    code, shown, _ = await run_command("inspect", str(tmp_path / "trace.jsonl"))
    assert code == 0
    assert "1 fork(s) in 1 sample run(s) (2 training sequences)" in shown.splitlines()[0], shown
