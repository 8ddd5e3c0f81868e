"""``fsm-rollout gateway`` as a process: it listens, serves an SDK session, records it, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from process_groups import start_group_async, stop_group_async

from fsm_rollout.testing.fake_vllm import RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir


async def test_the_gateway_command_serves_a_session_and_stops_on_sigterm(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    process = await start_group_async([
        sys.executable, "-m", "fsm_rollout.cli", "gateway", "--engine-url", fake_vllm.url, "--model", "fake-model",
        "--tokenizer", str(qwen_tokenizer_dir()), "--port", "0", "--trace", str(trace), "--record",
        "--api-key", "k", "--loop-slice-ms", "0", "--no-tune-gc", "--history-policy", "append",
        "--chat-template-kwargs", '{"enable_thinking": false}', "--auto-sessions",
    ], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    try:
        await serve_one_session(process, fake_vllm, tmp_path)
    finally:
        await stop_group_async(process)  # the gateway dies with the test, whatever failed


async def serve_one_session(process: asyncio.subprocess.Process, fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    assert process.stdout is not None and process.stderr is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
    assert line.startswith("gateway listening on http://127.0.0.1:"), line + (await process.stderr.read()).decode()
    url = line.split()[3]
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
        async with http.post(f"{url}/sessions") as response:
            assert response.status == 201
            opened: dict[str, Any] = await response.json()
        fake_vllm.script([ScriptedTurn(text="Hi!<|im_end|>")], session=opened["session_id"])
        agent = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="none", max_retries=0)
        answer = await agent.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hey"}])
        assert answer.choices[0].message.content == "Hi!"
        async with http.post(f"{url}/sessions/{opened['session_id']}/close", json={"reward": 1}) as response:
            samples = (await response.json())["samples"]
        async with http.get(f"{url}/v1/models") as response:  # --auto-sessions serves the root paths
            assert (await response.json())["data"][0]["id"] == "fake-model"
    assert samples[0]["metadata"]["rollout_reason"] == "session_closed"
    # the chat template switches (an option shared with `run`) reach the engine's render
    renders = fake_vllm.requests_to(RENDER_PATH)
    assert renders and all(r.body["chat_template_kwargs"] == {"enable_thinking": False} for r in renders)
    process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), 60) == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert ("stepping", "observe", "completed") in [(e["src"], e["trigger"], e["dst"]) for e in events]
    assert (tmp_path / "trace.tape.jsonl").exists()


def test_bad_options_exit_2(capsys: Any) -> None:
    from fsm_rollout.cli import main

    assert main(["gateway", "--engine-url", "localhost:1"]) == 2
    assert "http(s) URL" in capsys.readouterr().err
    assert main(["gateway", "--record"]) == 2
    assert "--record needs --trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["gateway", "--chat-template-kwargs", "[1]"])
    assert exited.value.code == 2
    assert "must be a JSON object" in capsys.readouterr().err


async def test_a_max_tokens_over_the_engines_context_is_cut_to_the_room_left(tokenizer: Any, tmp_path: Path) -> None:
    """Claude Code asks every call for ``max_tokens: 128000``. Without ``--max-context-len`` the gateway takes the
    context the engine lists (``max_model_len``), so the call gets the room left, not the engine's 400 on a generate
    over its context (which the harness retries and then gives up on)."""
    import anthropic

    from fsm_rollout.testing.fake_vllm import GENERATE_PATH

    async with FakeVLLMServer(tokenizer, model="fake-model", max_model_len=2048) as server:
        process = await start_group_async([
            sys.executable, "-m", "fsm_rollout.cli", "gateway", "--engine-url", server.url,
            "--tokenizer", str(qwen_tokenizer_dir()), "--port", "0", "--loop-slice-ms", "0", "--no-tune-gc",
            "--auto-sessions",
        ], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        try:
            assert process.stdout is not None and process.stderr is not None
            line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
            assert line.startswith("gateway listening on http://"), line + (await process.stderr.read()).decode()
            url = line.split()[3]
            server.script([ScriptedTurn(text="Hi!<|im_end|>")])
            agent = anthropic.AsyncAnthropic(
                base_url=url, api_key="none", max_retries=0, default_headers={"X-Claude-Code-Session-Id": "s1"}
            )
            async with agent.messages.stream(  # the SDK streams a call this long, as Claude Code does
                model="any", max_tokens=128_000, messages=[{"role": "user", "content": "Hey"}]
            ) as stream:
                answer = await stream.get_final_message()
        finally:
            await stop_group_async(process)
        assert [block.text for block in answer.content if block.type == "text"] == ["Hi!"]
        (generate,) = server.requests_to(GENERATE_PATH)
        prompt = len(generate.body["token_ids"])
        assert generate.body["sampling_params"]["max_tokens"] == 2048 - prompt
