"""Codex CLI, unchanged, through the gateway's Responses dialect: it runs the model's shell call and reports."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

from harness_install import Harnesses
from harness_support import (
    COMMAND,
    FINAL_ANSWER,
    HARNESS_TIMEOUT_S,
    MODEL_CASES,
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
SUBTASK = "Count the files in the working directory."
DONE = "Done: the subagent counted them."
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


async def test_codex_spawns_a_subagent_through_its_namespaced_tool_and_the_subagent_is_a_lineage(
    harnesses: Harnesses, tmp_path: pathlib.Path
) -> None:
    """The model calls ``multi_agent_v1__spawn_agent`` (Codex's namespace tool, offered flat); the gateway sends the
    call back as ``{"name": "spawn_agent", "namespace": "multi_agent_v1"}``, Codex starts the subagent, and the
    subagent's own calls are a lineage of the session whose parent is the root thread's."""
    model = MODEL_CASES["qwen2"]
    tokenizer = model.tokenizer
    spawn = model.turn(tool_call("multi_agent_v1__spawn_agent", {"message": SUBTASK}), "")
    done = model.turn(DONE, "")
    # after the spawn, the root thread's next call and the subagent's first call race: both are held until both
    # have come, then the subagent's is answered first, so the root cannot end the run before the subagent is
    # served. Codex then tells the root that the subagent completed (a <subagent_notification> turn) when that
    # news reaches the root before its turn ends, which is Codex's race, not ours: a fourth turn is scripted for it.
    turns = [ScriptedTurn(text=spawn), ScriptedTurn(text=done, hang=True), ScriptedTurn(text=done, hang=True)]
    turns.append(ScriptedTurn(text=done))
    workdir = tmp_path / "work"
    workdir.mkdir()
    async with gateway_over(tokenizer) as (gateway, server):
        session = await gateway.open_session(metadata={"harness": "codex"})
        server.script(turns, session=session.session_id)
        subagent_answered = asyncio.Event()
        chat = session.chat

        async def spy(call: Any, **kwargs: Any) -> Any:
            answer = await chat(call, **kwargs)
            if call.messages[-1] == {"role": "user", "content": SUBTASK}:
                subagent_answered.set()
            return answer

        session.chat = spy  # type: ignore[method-assign]
        env = {
            **base_env(tmp_path / "home"),
            "CODEX_HOME": str(codex_home(tmp_path / "codex-home", session.base_url)),
            API_KEY_VAR: "unused",
        }
        command = [
            str(harnesses.codex), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "Ask a subagent to count the files.",
        ]  # fmt: skip
        run = asyncio.ensure_future(run_harness(command, cwd=workdir, env=env))
        try:
            await asyncio.wait_for(server.wait_until_waiting(2), HARNESS_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError((await run).describe()) from None
        generates = server.requests_to(GENERATE_PATH)
        assert len(generates) == 3
        subagent_ending = f"<|im_start|>user\n{SUBTASK}<|im_end|>\n<|im_start|>assistant\n"
        [child] = [r for r in generates[1:] if tokenizer.decode(r.body["token_ids"]).endswith(subagent_ending)]
        [root] = [r for r in generates[1:] if r is not child]
        assert server.release(child.body["request_id"]) == 1
        await asyncio.wait_for(subagent_answered.wait(), HARNESS_TIMEOUT_S)
        assert server.release(root.body["request_id"]) == 1
        finished = await run
        assert finished.returncode == 0, finished.describe()
        assert finished.stdout.strip() == DONE, finished.describe()  # the root's last answer
        assert "SpawnAgent" in finished.stderr  # Codex's own log of the call it dispatched
        lineages = session.status()["lineages"]
        sequences = await session.close(reward=1.0)
    generates = server.requests_to(GENERATE_PATH)
    # the spawn call reached Codex's dispatcher: its answer (the new agent's id) is the root's next observation
    root_prompt = tokenizer.decode(root.body["token_ids"])
    assert "multi_agent_v1__spawn_agent" in root_prompt
    assert f'"agent_id":"{lineages[1]["lineage_key"]}"' in root_prompt  # the subagent's thread is the spawned agent
    roots = [generates[0], root, *generates[3:]]
    if len(roots) == 3:  # the notification turn: the subagent's answer, reported to the root by Codex
        notified = tokenizer.decode(roots[2].body["token_ids"][len(root.body["token_ids"]) :])
        assert "<subagent_notification>" in notified and DONE in notified
    assert len(generates) in (3, 4)
    assert [(each["lineage"], each["parent_lineage"], each["calls"]) for each in lineages] == [
        ("l0", None, len(roots)),
        ("l1", "l0", 1),
    ]
    by_lineage = {sequence.metadata["lineage"]: sequence for sequence in sequences}
    assert by_lineage["l1"].metadata["parent_lineage"] == "l0" and by_lineage["l0"].metadata["parent_lineage"] is None
    # each lineage is token-exact: what the engine was sent, then what it generated (mask 1 only there)
    texts = [spawn, done, done]
    for lineage, requests, generated_texts in (("l0", roots, texts[: len(roots)]), ("l1", [child], [done])):
        sequence = by_lineage[lineage]
        generated = [tokenizer.encode(text, add_special_tokens=False) for text in generated_texts]
        assert sequence.tokens == requests[-1].body["token_ids"] + generated[-1]
        prompt_length = len(requests[0].body["token_ids"])
        mask = [0] * (len(sequence.tokens) - prompt_length)
        for request, output in zip(requests, generated, strict=True):
            start = len(request.body["token_ids"]) - prompt_length
            assert sequence.tokens[: len(request.body["token_ids"])] == request.body["token_ids"]
            mask[start : start + len(output)] = [1] * len(output)
        assert sequence.loss_mask == mask and sequence.reward == 1.0
