"""The gateway's per-call cap (``max_call_tokens``, ``fsm-rollout gateway --max-call-tokens``): every dialect's
call reaches the engine with ``min(client's max tokens, cap)`` (the cap when the client sets none), and an answer the
cap cuts is reported as that dialect reports a length cut, the session still open for the next call."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.cli import gateway as gateway_cli
from fsm_rollout.errors import ConfigError
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

CAP = 6
LONG = "one two three four five six seven eight nine ten eleven twelve<|im_end|>"


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> AsyncIterator[AgentGateway]:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=50, check_invariants=True)
    sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    runner = RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer)
    async with AgentGateway(runner, max_call_tokens=CAP) as gateway:
        yield gateway


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


def _last_max_tokens(fake: FakeVLLMServer) -> int:
    return int(fake.requests_to(GENERATE_PATH)[-1].body["sampling_params"]["max_tokens"])


@pytest.mark.parametrize(("asked", "sent"), [(None, CAP), (100, CAP), (3, 3)])
async def test_a_chat_call_is_capped_at_the_smaller_of_the_clients_limit_and_the_cap(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, asked: int | None, sent: int
) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=LONG)], session=session.session_id)
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "count"}]}
    if asked is not None:
        body["max_tokens"] = asked
    status, answer = await _post(f"{session.base_url}/chat/completions", body)
    assert status == 200, answer
    assert _last_max_tokens(fake_vllm) == sent
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == sent
    await session.close()


async def test_a_responses_call_without_max_output_tokens_is_cut_at_the_cap_and_the_session_goes_on(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer
) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=LONG), ScriptedTurn(text="ok<|im_end|>")], session=session.session_id)
    first = {"model": "fake-model", "input": "count", "store": False}
    status, body = await _post(f"{session.base_url}/responses", first)
    assert status == 200, body
    assert _last_max_tokens(fake_vllm) == CAP
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == CAP
    text = body["output"][-1]["content"][0]["text"]
    second = {
        "model": "fake-model",
        "store": False,
        "input": [
            {"type": "message", "role": "user", "content": "count"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
            {"type": "message", "role": "user", "content": "stop"},
        ],
    }
    status, body = await _post(f"{session.base_url}/responses", second)
    assert status == 200, body
    assert body["status"] == "completed"
    assert body["output"][-1]["content"][0]["text"] == "ok"
    samples = await session.close()
    assert len(samples) == 1  # the cut answer was continued, not forked


async def test_a_messages_call_is_capped_below_its_required_max_tokens(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer
) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=LONG)], session=session.session_id)
    body = {"model": "fake-model", "max_tokens": 4096, "messages": [{"role": "user", "content": "count"}]}
    status, answer = await _post(f"{session.base_url}/messages", body)
    assert status == 200, answer
    assert _last_max_tokens(fake_vllm) == CAP
    assert answer["stop_reason"] == "max_tokens"
    assert answer["usage"]["output_tokens"] == CAP
    await session.close()


async def test_a_cap_below_one_is_refused(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    config = RolloutConfig(engine_url=fake_vllm.url, model="fake-model", max_turns=5)
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
    runner = RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="max_call_tokens"):
        AgentGateway(runner, max_call_tokens=0)


def test_the_cli_refuses_a_cap_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    args = parser.parse_args(["--max-call-tokens", "0"])
    assert gateway_cli.main(args) != 0
    assert "--max-call-tokens must be at least 1" in capsys.readouterr().err
