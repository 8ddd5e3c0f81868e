"""The agent gateway over real HTTP on loopback, driven by the ``openai`` SDK against the scripted fake engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.tokens.chat import template_token_ids

SAMPLING = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3, "exact": false}}\n</tool_call><|im_end|>'


class Http:
    """A few raw calls on loopback (aiohttp), answering (status, JSON)."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.session = session

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.session.request(method, self.base + path, **kwargs) as response:
            text = await response.text()
            return response.status, (json.loads(text) if text else None)

    async def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        return await self.call("POST", path, **kwargs)

    async def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        return await self.call("GET", path, **kwargs)


def runner_for(server: FakeVLLMServer, tokenizer: Any, **overrides: Any) -> RolloutRunner:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": "fake-model",
        "max_turns": 50,
        "check_invariants": True,
    }
    values.update(overrides)
    return RolloutRunner(RolloutConfig(**values), sampling_params=SAMPLING, tokenizer=tokenizer)


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any) -> AsyncIterator[AgentGateway]:
    async with AgentGateway(runner_for(fake_vllm, tokenizer)) as gateway:
        yield gateway


def check_token_exact(server: FakeVLLMServer, session_id: str, sample: Sample, tokenizer: Any) -> None:
    """Every generate request of the session sent a prefix of the exported tokens, and what each generated follows
    it there with mask 1; the exported tokens end with the last answer."""
    requests = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session_id]
    assert requests, "no generate request carried the session id"
    prompt_length = len(sample.tokens) - sample.response_length
    assert sample.loss_mask is not None
    for request in requests:
        sent = request.body["token_ids"]
        assert sample.tokens[: len(sent)] == sent
        assert len(sent) >= prompt_length
    # every token with mask 1 was generated: it lies right after some request's prompt
    starts = sorted(len(r.body["token_ids"]) for r in requests)
    trained = [prompt_length + i for i, bit in enumerate(sample.loss_mask) if bit == 1]
    assert trained and trained[0] == starts[0]
    for request in server.requests_to(RENDER_PATH):
        assert request.headers.get("x-session-id") in (session_id, None) or request.headers.get("x-session-id")


async def test_sdk_tool_call_session_is_token_exact(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session(metadata={"task": "add"})
    fake_vllm.script(
        [ScriptedTurn(text=CALL), ScriptedTurn(text="The sum is 5.<|im_end|>")], session=session.session_id
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3, "exact": False}
    assert call.id.startswith("call_")
    assert first.usage is not None and first.usage.completion_tokens > 0
    # the agent re-serialises the arguments its own way: still the same call by meaning
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"exact":false,"b":3,"a":2}'},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    second = await client.chat.completions.create(
        model="fake-model",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0.25,
        max_tokens=40,
        seed=7,
    )
    assert second.choices[0].message.content == "The sum is 5."
    assert second.choices[0].finish_reason == "stop"
    samples = await session.close(reward=1.0)
    assert len(samples) == 1
    sample = samples[0]
    assert sample.status.value == "completed"
    assert sample.metadata["rollout_reason"] == "session_closed"
    assert sample.reward == 1.0
    check_token_exact(fake_vllm, session.session_id, sample, tokenizer)
    generates = fake_vllm.requests_to(GENERATE_PATH)
    assert len(generates) == 2
    # the second call's sampling settings reached its generate request, and only its
    params = generates[1].body["sampling_params"]
    assert params["temperature"] == 0.25 and params["seed"] == 7 and params["max_tokens"] <= 40
    assert generates[0].body["sampling_params"]["temperature"] == 1.0
    # the model's tool call is in the tokens exactly as generated, never re-serialised
    text = tokenizer.decode(sample.tokens)
    assert '{"name": "add", "arguments": {"a": 2, "b": 3, "exact": false}}' in text
    assert '{"exact":false' not in text
    assert gateway.runner.metrics().sessions_total == 1
    assert gateway.runner.metrics().sessions_open == 0


async def test_sdk_streaming_with_usage_and_sync_client(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text="Hello there.<|im_end|>"), ScriptedTurn(text=CALL)], session=session.session_id)
    client = openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0)

    def stream_first() -> tuple[str, list[Any]]:
        chunks = list(
            client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "Hi"}],
                tools=TOOLS,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks

    text, chunks = await asyncio.to_thread(stream_first)
    assert text == "Hello there."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    def stream_tool_call() -> Any:
        stream = client.chat.completions.create(
            model="fake-model",
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there."},
                {"role": "user", "content": "Add 2 and 3."},
            ],
            tools=TOOLS,  # type: ignore[arg-type]  (a call without tools gets no tool call)
            stream=True,
        )
        calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        return calls

    calls = await asyncio.to_thread(stream_tool_call)
    assert [c.function.name for c in calls] == ["add"]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3, "exact": False}
    samples = await session.close()
    assert samples[-1].metadata["rollout_reason"] == "session_closed"


async def test_http_surface_errors_and_status(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    async with aiohttp.ClientSession() as raw:
        http = Http(gateway.url, raw)
        status, body = await http.post("/sessions", json={"metadata": {"k": 1}, "label": "x"})
        assert status == 201
        session_id = body["session_id"]
        assert len(session_id) >= 22  # >= 128 bits, url-safe base64
        assert body["base_url"] == f"{gateway.url}/sessions/{session_id}/v1"
        status, body = await http.post("/sessions/nope/v1/chat/completions", json={"messages": []})
        assert status == 404
        assert set(body["error"]) >= {"message", "type", "code"}
        chat = f"/sessions/{session_id}/v1/chat/completions"
        for bad in (
            {"messages": [{"role": "user", "content": "x"}], "n": 2},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            {"messages": [{"role": "wizard", "content": "x"}]},
            {"messages": [{"role": "tool", "content": "x"}]},
        ):
            status, body = await http.post(chat, json=bad)
            assert status == 400, bad
            assert body["error"]["type"] == "invalid_request_error"
        status, body = await http.post(chat, data=b"{not json")
        assert status == 400 and body["error"]["code"] == "invalid_json"
        _, models = await http.get(f"/sessions/{session_id}/v1/models")
        assert models["data"][0]["id"] == "fake-model"
        _, state = await http.get(f"/sessions/{session_id}")
        assert state["state"] == "waiting_for_first_call" and state["metadata"] == {"k": 1}
        fake_vllm.script([ScriptedTurn(text="ok<|im_end|>")], session=session_id)
        status, body = await http.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "go"}]})
        assert status == 200, body
        _, state = await http.get(f"/sessions/{session_id}")
        assert state["state"] == "stepping" and state["turns"] == 1
        status, _ = await http.post(f"/sessions/{session_id}/reward", json={"reward": 0.5})
        assert status == 200
        status, _ = await http.post(f"/sessions/{session_id}/reward", json={"reward": "high"})
        assert status == 400
        status, body = await http.post(f"/sessions/{session_id}/close")
        samples = body["samples"]
        assert len(samples) == 1 and samples[0]["reward"] == 0.5
        assert samples[0]["status"] == "completed" and samples[0]["metadata"]["rollout_reason"] == "session_closed"
        status, body = await http.post(chat, json={"messages": [{"role": "user", "content": "go"}]})
        assert status == 409 and body["error"]["code"] == "session_closed"  # a call after close
        status, again = await http.post(f"/sessions/{session_id}/close")
        assert status == 200 and again == {"samples": samples}  # a lost close response loses nothing
        status, _ = await http.post("/sessions/never-opened/close")
        assert status == 404


async def test_a_closed_session_is_forgotten_after_its_ttl(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    async with (
        AgentGateway(runner_for(fake_vllm, tokenizer), closed_session_ttl_s=0.0) as gateway,
        aiohttp.ClientSession() as raw,
    ):
        http = Http(gateway.url, raw)
        _, opened = await http.post("/sessions")
        assert (await http.post(f"/sessions/{opened['session_id']}/close"))[0] == 200
        status, body = await http.post(f"/sessions/{opened['session_id']}/close")
        assert status == 404 and body["error"]["code"] == "session_not_found"


async def test_a_second_concurrent_call_gets_409(gateway: AgentGateway, fake_vllm: FakeVLLMServer) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text="slow<|im_end|>", hang=True)], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    first = asyncio.ensure_future(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    )
    await fake_vllm.wait_until_waiting(1)
    with pytest.raises(openai.ConflictError):  # another call of the same chain, not a retry of the first
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_api_keys_guard_control_and_agent_endpoints(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    runner = runner_for(fake_vllm, tokenizer)
    control = {"Authorization": "Bearer control-key"}
    async with (
        AgentGateway(runner, api_key="control-key", agent_api_key="agent-key") as gateway,
        aiohttp.ClientSession() as raw,
    ):
        http = Http(gateway.url, raw)
        assert (await http.post("/sessions"))[0] == 401
        status, opened = await http.post("/sessions", headers=control)
        assert status == 201
        session_id = opened["session_id"]
        fake_vllm.script([ScriptedTurn(text="ok<|im_end|>")], session=session_id)
        wrong = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="control-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        right = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="agent-key", max_retries=0)
        answer = await right.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        assert answer.choices[0].message.content == "ok"
        assert (await http.get(f"/sessions/{session_id}"))[0] == 401
        assert (await http.post(f"/sessions/{session_id}/close", headers=control))[0] == 200


async def test_a_rewritten_history_forks_and_never_trains_unseen_tokens(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text="First answer.<|im_end|>"), ScriptedTurn(text="Second answer.<|im_end|>")],
        session=session.session_id,
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    question = {"role": "user", "content": "Question?"}
    first = await client.chat.completions.create(model="m", messages=[question])  # type: ignore[list-item]
    assert first.choices[0].message.content == "First answer."
    # the agent compacts its history: the model's answer is replaced by a summary it never wrote
    rewritten = [
        question,
        {"role": "assistant", "content": "(summary of an earlier answer)"},
        {"role": "user", "content": "Go on."},
    ]
    second = await client.chat.completions.create(model="m", messages=rewritten)  # type: ignore[arg-type]
    assert second.choices[0].message.content == "Second answer."
    samples = await session.close(reward=2.0)
    # one rollout that took the history policies' fork edge: the first sequence is the last one's branch
    assert samples[-1].branches == samples[:-1]
    assert samples[0].metadata["history_rewritten"].startswith("messages[1] (assistant) differs")
    assert samples[-1].metadata["rollout_reason"] == "session_closed"
    assert "history_rewritten" not in samples[-1].metadata
    assert all(s.status.value == "completed" for s in samples)
    assert [s.metadata["branch"] for s in samples] == [0, 1]
    assert all(s.reward == 2.0 and s.session_id == session.session_id for s in samples)
    metrics = gateway.runner.metrics()
    assert (metrics.forks, metrics.samples_done, metrics.sequences) == (1, 1, 2)
    # the new sequence's prompt is the template's render of the new conversation, all of it mask 0
    renders = [r for r in fake_vllm.requests_to(RENDER_PATH) if r.headers.get("x-session-id") == session.session_id]
    assert len(renders) == 2
    expected = template_token_ids(
        tokenizer.apply_chat_template(rewritten, tokenize=True, add_generation_prompt=True), what="the re-render"
    )
    second_sample = samples[1]
    assert second_sample.tokens[: len(second_sample.tokens) - second_sample.response_length] == expected
    # each generated token is trained in exactly one sequence, and the summary is in no sequence's trained tokens
    generated = [tokenizer.encode("First answer.<|im_end|>"), tokenizer.encode("Second answer.<|im_end|>")]
    for sample, tokens in zip(samples, generated, strict=True):
        assert sample.loss_mask is not None
        start = len(sample.tokens) - sample.response_length
        trained = [t for t, bit in zip(sample.tokens[start:], sample.loss_mask, strict=True) if bit == 1]
        assert trained == tokens
    assert "summary" not in tokenizer.decode(samples[0].tokens)


async def test_changed_tools_fork_and_a_retried_call_is_answered_again(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer
) -> None:
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text="One.<|im_end|>"), ScriptedTurn(text="Two.<|im_end|>")], session=session.session_id
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    first = await client.chat.completions.create(model="m", messages=messages)
    # the agent's client retries the same call (a timeout on its side, say): the same answer, nothing generated
    again = await client.chat.completions.create(model="m", messages=messages)
    assert again.choices[0].message.content == first.choices[0].message.content == "One."
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1
    messages += [{"role": "assistant", "content": "One."}, {"role": "user", "content": "More"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].message.content == "Two."
    samples = await session.close()
    assert samples[-1].branches == samples[:-1] and len(samples) == 2
    assert samples[-1].metadata["rollout_reason"] == "session_closed"
    assert samples[0].metadata["history_rewritten"] == "the tools changed"
    assert "tools" not in samples[0].metadata
    assert samples[1].metadata["tools"] == TOOLS
    # the new sequence's prompt was rendered with the call's tools
    assert fake_vllm.requests_to(RENDER_PATH)[-1].body["tools"] == TOOLS


async def test_the_agents_max_tokens_cut_is_length_and_the_session_goes_on(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text="one two three four five six<|im_end|>"), ScriptedTurn(text="done<|im_end|>")],
        session=session.session_id,
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Count"}]
    cut = await client.chat.completions.create(model="m", messages=messages, max_completion_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None and cut.usage.completion_tokens == 3
    assert fake_vllm.requests_to(GENERATE_PATH)[0].body["sampling_params"]["max_tokens"] == 3
    messages += [{"role": "assistant", "content": cut.choices[0].message.content}, {"role": "user", "content": "?"}]
    last = await client.chat.completions.create(model="m", messages=messages, logprobs=True)
    assert last.choices[0].message.content == "done"
    assert last.choices[0].logprobs is not None and last.choices[0].logprobs.content
    samples = await session.close()
    assert len(samples) == 1 and samples[0].metadata["rollout_reason"] == "session_closed"
    assert tokenizer.decode(samples[0].tokens).count("one two three") == 1


async def test_a_recorded_session_replays_identically_and_inspect_shows_it(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any, capsys: Any
) -> None:
    trace = tmp_path / "gateway.jsonl"
    runner = runner_for(fake_vllm, tokenizer, trace=str(trace), record=True)
    async with AgentGateway(runner) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=CALL), ScriptedTurn(text="Five.<|im_end|>")], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "2+3?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0.5)  # type: ignore[arg-type]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "5"}]
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, top_p=0.5, max_tokens=30)  # type: ignore[arg-type]
        await session.close(reward=1.0)
    from fsm_rollout.cli import main

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["replay", str(trace)]) == 0, capsys.readouterr()
    replayed = capsys.readouterr().out
    assert "re-executed 2 turns" in replayed and "identical 1" in replayed, replayed
    assert await asyncio.to_thread(main, ["inspect", str(trace), "--sample", "0.0"]) == 0
    shown = capsys.readouterr().out
    assert "session_closed" in shown
    # the session's own machine is traced beside the rollout's transitions (and readers of those skip it)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    path = [(row["src"], row["trigger"], row["dst"]) for row in rows if row["event"] == "session_transition"]
    assert path == [
        ("waiting_for_first_call", "call", "answering"),
        ("answering", "answered", "waiting_for_agent"),
        ("waiting_for_agent", "call", "answering"),
        ("answering", "answered", "waiting_for_agent"),
        ("waiting_for_agent", "close", "closed"),
    ]
    assert {row["session_id"] for row in rows if row["event"] == "session_transition"} == {session.session_id}


async def test_a_rewrite_the_engine_renders_as_the_model_saw_it_continues_the_sequence(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    # the agent renames its tool message: a rewrite by the history check, but the template does not write tool
    # names, so the engine's render of the call extends the tokens the model saw and no sequence closes
    session = await gateway.open_session()
    fake_vllm.script(
        [ScriptedTurn(text=CALL), ScriptedTurn(text="Five.<|im_end|>"), ScriptedTurn(text="Bye.<|im_end|>")],
        session=session.session_id,
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "2+3?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "name": "add", "content": "5"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    messages[-1] = {**messages[-1], "name": "plus"}
    messages += [{"role": "assistant", "content": second.choices[0].message.content}]
    messages += [{"role": "user", "content": "Thanks."}]
    third = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert third.choices[0].message.content == "Bye."
    samples = await session.close()
    assert len(samples) == 1 and samples[0].branches == []
    assert gateway.runner.metrics().forks == 0
    check_token_exact(fake_vllm, session.session_id, samples[0], tokenizer)
    renders = [r for r in fake_vllm.requests_to(RENDER_PATH) if r.headers.get("x-session-id") == session.session_id]
    assert len(renders) == 2  # the first call's, and the rewritten call's


async def test_http_calls_share_the_rollouts_pacer_under_a_loop_slice(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    from fsm_rollout.runtime.pacing import pacer_for

    async with AgentGateway(runner_for(fake_vllm, tokenizer, loop_slice_ms=5.0)) as gateway:
        pacer = pacer_for(asyncio.get_running_loop(), 5.0)
        before = pacer.admitted
        async with aiohttp.ClientSession() as raw:
            status, _ = await Http(gateway.url, raw).post("/sessions", json={})
        assert status == 201
        # opening a session starts no rollout: the one admission is the handler's
        assert pacer.admitted == before + 1


async def test_tool_choice_none_returns_the_markup_as_content_and_no_call(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer
) -> None:
    session = await gateway.open_session()
    fake_vllm.script([ScriptedTurn(text=CALL), ScriptedTurn(text="Ok.<|im_end|>")], session=session.session_id)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "2+3?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL.removesuffix("<|im_end|>").strip()
    # sent back as the text it was, the history extends: one sequence
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "And?"}]
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    samples = await session.close()
    assert len(samples) == 1 and samples[0].metadata["rollout_reason"] == "session_closed"


def png_data_url(color: tuple[int, int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def test_image_url_parts_reach_the_engine_as_image_observations(tokenizer: Any) -> None:
    from fsm_rollout.testing.fake_vllm import QwenLikeImageRender

    render = QwenLikeImageRender(tokenizer)
    async with (
        FakeVLLMServer(tokenizer, model="fake-model", render_features=render) as fake,
        AgentGateway(runner_for(fake, tokenizer, image_merge_size=2)) as gateway,
    ):
        session = await gateway.open_session()
        fake.script(
            [ScriptedTurn(text="A red square.<|im_end|>"), ScriptedTurn(text="Now blue.<|im_end|>")],
            session=session.session_id,
        )
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        red, blue = png_data_url((200, 0, 0)), png_data_url((0, 0, 200))
        messages: list[Any] = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": red}},
                ],
            }
        ]
        first = await client.chat.completions.create(model="m", messages=messages)
        assert first.choices[0].message.content == "A red square."
        messages += [
            {"role": "assistant", "content": "A red square."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": blue}},
                    {"type": "text", "text": "And this?"},
                ],
            },
        ]
        second = await client.chat.completions.create(model="m", messages=messages)
        assert second.choices[0].message.content == "Now blue."
        samples = await session.close()
        with pytest.raises(openai.BadRequestError):  # an image behind a URL the tape could not hold
            other = await gateway.open_session()
            agent = openai.AsyncOpenAI(base_url=other.base_url, api_key="unused", max_retries=0)
            await agent.chat.completions.create(
                model="m",
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
                ],
            )
    assert len(samples) == 1 and samples[0].metadata["rollout_reason"] == "session_closed"
    sample = samples[0]
    check_token_exact(fake, session.session_id, sample, tokenizer)
    # both images went to the engine's render, in order, and the sample trains with both images' features
    renders = [r for r in fake.requests_to(RENDER_PATH) if r.headers.get("x-session-id") == session.session_id]
    urls = [
        part["image_url"]["url"]
        for r in renders
        for m in r.body["messages"]
        for part in (m["content"] if isinstance(m["content"], list) else [])
        if part.get("type") == "image_url"
    ]
    assert red in urls and blue in urls and urls.index(red) < urls.index(blue)
    assert sample.multimodal_train_inputs is not None
    assert len(sample.multimodal_train_inputs["image_grid_thw"]) == 2
    # the image tokens are in the prompt and the observation, never trained
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert pad in sample.tokens
    start = len(sample.tokens) - sample.response_length
    assert all(
        bit == 0 for token, bit in zip(sample.tokens[start:], sample.loss_mask or [], strict=True) if token == pad
    )


async def test_a_gateway_stopped_with_a_session_open_ends_it_aborted_shutdown_and_replays(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any, capsys: Any
) -> None:
    trace = tmp_path / "gateway.jsonl"
    runner = runner_for(fake_vllm, tokenizer, trace=str(trace), record=True)
    async with AgentGateway(runner) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text="Hello.<|im_end|>")], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert session.status()["status"] == "waiting_for_agent"  # open: not the rollout's provisional status
        assert session.status()["session_state"] == "waiting_for_agent"
    # the gateway stopped with the session waiting for its agent
    status = session.status()
    assert (status["session_state"], status["status"], status["reason"]) == ("closed", "aborted", "shutdown")
    from fsm_rollout.cli import main

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["replay", str(trace)]) == 0, capsys.readouterr()
    assert "identical 1" in capsys.readouterr().out
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    ends = [row for row in rows if row["event"] == "session_transition" and row["dst"] == "closed"]
    assert [(row["src"], row["trigger"], row.get("reason")) for row in ends] == [
        ("waiting_for_agent", "shutdown", "shutdown")
    ]
