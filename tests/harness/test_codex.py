"""Codex CLI, unchanged, through the gateway's Responses dialect: it runs the model's shell call and reports."""

from __future__ import annotations

import pathlib

from harness_install import Harnesses
from harness_support import (
    COMMAND,
    FINAL_ANSWER,
    WRITTEN,
    ModelCase,
    base_env,
    check_replays_identically,
    check_token_exact,
    gateway_over,
    run_harness,
    tool_call,
)

from fsm_rollout.testing.fake_vllm import GENERATE_PATH, ScriptedTurn

TASK = "Write the word harness-was-here into out.txt."
API_KEY_VAR = "FSM_ROLLOUT_GATEWAY_KEY"


def codex_home(path: pathlib.Path, base_url: str) -> pathlib.Path:
    """A ``CODEX_HOME`` whose only provider is the session; no retries, so a refused call shows at once; no
    analytics and no update check (the test talks to the gateway only)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(
        'model = "fake-model"\n'
        'model_provider = "gateway"\n'
        "check_for_update_on_startup = false\n"
        "\n"
        "[analytics]\n"
        "enabled = false\n"
        "\n"
        "[model_providers.gateway]\n"
        'name = "fsm-rollout gateway"\n'
        f'base_url = "{base_url}"\n'
        'wire_api = "responses"\n'
        f'env_key = "{API_KEY_VAR}"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n",
        encoding="utf-8",
    )
    return path


async def test_codex_exec_runs_the_models_shell_call_and_the_session_is_token_exact(
    harnesses: Harnesses, model: ModelCase, tmp_path: pathlib.Path
) -> None:
    tokenizer = model.tokenizer
    scripted = [
        model.turn(tool_call("exec_command", {"cmd": COMMAND}), "The shell can write the file."),
        model.turn(FINAL_ANSWER, "The command succeeded."),
    ]
    workdir = tmp_path / "work"
    workdir.mkdir()
    trace = tmp_path / "gateway.jsonl"
    async with gateway_over(tokenizer, trace=str(trace)) as (gateway, server):
        session = await gateway.open_session(metadata={"harness": "codex"})
        server.script([ScriptedTurn(text=text) for text in scripted], session=session.session_id)
        env = {
            **base_env(tmp_path / "home"),
            "CODEX_HOME": str(codex_home(tmp_path / "codex-home", session.base_url)),
            API_KEY_VAR: "unused",
        }
        command = [
            str(harnesses.codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK,
        ]  # fmt: skip
        run = await run_harness(command, cwd=workdir, env=env)
        assert run.returncode == 0, run.describe()
        assert run.stdout.strip() == FINAL_ANSWER, run.describe()
        assert (workdir / "out.txt").read_text(encoding="utf-8") == WRITTEN
        sequences = await session.close(reward=1.0)
    check_token_exact(server, session.session_id, sequences, scripted, tokenizer)
    generates = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session.session_id]
    # the shell's report reached the engine as the observation after the call (Codex reports exit code and output)
    second_prompt = tokenizer.decode(generates[1].body["token_ids"][len(generates[0].body["token_ids"]) :])
    assert "Process exited with code 0" in second_prompt
    sequence = sequences[0]
    assert sequence.reward == 1.0
    assert sequence.metadata["rollout_reason"] == "session_closed"
    # only the new item, the shell's output, was encoded as observation tokens: nothing Codex echoed back
    [observation] = sequence.metadata["observations"]
    assert [message["role"] for message in observation["messages"]] == ["tool"]
    assert "Process exited with code 0" in observation["messages"][0]["content"]
    # one chain (Codex's root thread), and the tools the prompt cannot hold are named, not silently lost; the
    # subagent tools of Codex's multi_agent_v1 namespace are offered as flat functions
    assert sequence.metadata["lineage"] is not None and sequence.metadata["parent_lineage"] is None
    assert sequence.metadata["gateway_session"]["dropped_tools"] == [{"type": "web_search"}]
    # what Codex put first, its developer instructions and the task, is what the engine was first sent
    first_prompt = tokenizer.decode(generates[0].body["token_ids"])
    assert "You are a coding agent running in the Codex CLI" in first_prompt
    assert TASK in first_prompt
    assert "multi_agent_v1__spawn_agent" in first_prompt
    await check_replays_identically(trace)  # offline, turn for turn, from the session's tape alone
