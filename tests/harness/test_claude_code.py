"""Claude Code, unchanged, through the gateway's Messages dialect: it runs the model's Bash call and reports."""

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


def claude_env(home: pathlib.Path, base_url: str) -> dict[str, str]:
    """Claude Code's environment: the session as its Anthropic base URL (the client appends ``/v1/messages``), no
    side traffic, no retries (a refused call shows at once instead of after minutes of backoff)."""
    return {
        **base_env(home),
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }


async def test_claude_code_runs_the_models_bash_call_and_the_session_is_token_exact(
    harnesses: Harnesses, model: ModelCase, tmp_path: pathlib.Path
) -> None:
    tokenizer = model.tokenizer
    scripted = [
        model.turn(
            tool_call("Bash", {"command": COMMAND, "description": "Write the file"}), "The shell can write the file."
        ),
        model.turn(FINAL_ANSWER, "The command succeeded."),
    ]
    workdir = tmp_path / "work"
    workdir.mkdir()
    trace = tmp_path / "gateway.jsonl"
    async with gateway_over(tokenizer, trace=str(trace)) as (gateway, server):
        session = await gateway.open_session(metadata={"harness": "claude-code"})
        server.script([ScriptedTurn(text=text) for text in scripted], session=session.session_id)
        # --dangerously-skip-permissions refuses to run as root; allowing the Bash tool is enough. The prompt goes
        # after "--": --allowedTools takes every word that follows it.
        command = [str(harnesses.claude), "-p", "--allowedTools", "Bash", "--", TASK]
        run = await run_harness(command, cwd=workdir, env=claude_env(tmp_path / "home", session.base_url))
        assert run.returncode == 0, run.describe()
        assert run.stdout.strip() == FINAL_ANSWER, run.describe()
        assert (workdir / "out.txt").read_text(encoding="utf-8") == WRITTEN
        sequences = await session.close(reward=1.0)
    check_token_exact(server, session.session_id, sequences, scripted, tokenizer)
    generates = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session.session_id]
    # Claude Code's report of the command (no output) reached the engine as the observation after the call
    second_prompt = tokenizer.decode(generates[1].body["token_ids"][len(generates[0].body["token_ids"]) :])
    assert "(Bash completed with no output)" in second_prompt
    sequence = sequences[0]
    assert sequence.reward == 1.0
    assert sequence.metadata["rollout_reason"] == "session_closed"
    # only the new block, the tool result, was encoded as observation tokens: nothing Claude Code echoed back
    [observation] = sequence.metadata["observations"]
    assert [message["role"] for message in observation["messages"]] == ["tool"]
    assert observation["messages"][0]["content"] == "(Bash completed with no output)"
    assert sequence.metadata["lineage"] is not None and sequence.metadata["parent_lineage"] is None
    first_prompt = tokenizer.decode(generates[0].body["token_ids"])
    assert TASK in first_prompt
    # its system blocks and the mid-conversation system message (the environment) reached the engine
    assert "You are a Claude agent, built on Anthropic's Claude Agent SDK." in first_prompt
    assert "Primary working directory" in first_prompt
    await check_replays_identically(trace)  # offline, turn for turn, from the session's tape alone
