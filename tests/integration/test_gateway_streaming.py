"""True streaming through the gateway: a streamed call's first content event reaches the agent while the engine is
still generating (the fake server holds the rest of the turn until the test has seen it), the exported sequence is
token-exact, and a client that goes away mid-stream has its engine request aborted with earlier turns kept.
Every wait is on an event (a held request, a line read), never on time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from fsm_rollout import RolloutConfig
from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
from fsm_rollout.engine.local.scheduler import GenerateJob
from fsm_rollout.gateway import AgentGateway
from fsm_rollout.gateway.answers import TokenText
from fsm_rollout.gateway.session import SessionEnvironment
from fsm_rollout.gateway.stream_text import AnswerStream
from fsm_rollout.runtime.runner import RolloutRunner
from fsm_rollout.testing.fake_vllm import ABORT_PATH, GENERATE_PATH, FakeVLLMServer, ScriptedTurn

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
TEXT = "Streaming answers arrive piece by piece, long before the end.<|im_end|>"


def gateway_for(server: FakeVLLMServer, tokenizer: Any, trace: str | None = None, **options: Any) -> AgentGateway:
    config = RolloutConfig(engine_url=server.url, model="fake-model", max_turns=20, check_invariants=True, trace=trace)
    return AgentGateway(RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer), **options)


async def events(response: aiohttp.ClientResponse) -> Any:
    """Each ``data:`` payload of an SSE answer, decoded, as it arrives (``[DONE]`` as text)."""
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield data.decode() if data == b"[DONE]" else orjson.loads(data)


def content_of(event: Any) -> str:
    if not isinstance(event, dict) or not event.get("choices"):
        return ""
    return str(event["choices"][0]["delta"].get("content") or "")


async def test_a_streamed_chat_answer_starts_before_generation_ends_and_is_token_exact(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True, held_after=6)], session=session.session_id)
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "logprobs": True}
        received: list[Any] = []
        released = False
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{session.base_url}/chat/completions", json=body) as response,
        ):
            assert response.status == 200
            async for event in events(response):
                received.append(event)
                if content_of(event) and not released:
                    # the first content event is here, and the engine holds the rest of the turn until the
                    # test lets it go: the answer started before its generation ended
                    await fake_vllm.wait_until_waiting(1)
                    (held,) = fake_vllm.held_request_ids
                    assert fake_vllm.release(held) == 1
                    released = True
        samples = await session.close()
    streamed = "".join(content_of(event) for event in received)
    assert streamed == TEXT.removesuffix("<|im_end|>")
    first_content = next(index for index, event in enumerate(received) if content_of(event))
    assert 0 < len(content_of(received[first_content])) < len(streamed)  # a piece, not the whole answer
    assert received[-1] == "[DONE]"
    assert received[-2]["choices"][0]["finish_reason"] == "stop"
    logprobs = [
        entry["logprob"]
        for event in received[:-1]
        for entry in (event["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    generated = tokenizer.encode(TEXT)
    assert logprobs == [-0.01 * (i + 1) for i in range(len(generated))]
    sample = samples[0]
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt:] == generated and sample.loss_mask == [1] * len(generated)
    assert sample.rollout_log_probs is not None and sample.rollout_log_probs[-len(generated) :] == logprobs
    (request,) = fake_vllm.requests_to(GENERATE_PATH)
    assert request.body["stream"] is True


HELD_AFTER = 6


async def test_a_client_gone_mid_stream_aborts_the_engine_request_and_keeps_what_was_generated(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closes: list[SessionEnvironment] = []
    monkeypatch.setattr(SessionEnvironment, "close", lambda env: closes.append(env))
    trace = tmp_path / "trace.jsonl"
    async with gateway_for(fake_vllm, tokenizer, disconnect_grace_s=0.0, trace=str(trace)) as gateway:
        session = await gateway.open_session()
        fake_vllm.script(
            [ScriptedTurn(text="First.<|im_end|>"), ScriptedTurn(text=TEXT, hang=True, held_after=HELD_AFTER)],
            session=session.session_id,
        )
        generated = tokenizer.encode(TEXT)
        shown = tokenizer.decode(generated[:HELD_AFTER])
        messages: list[Any] = [{"role": "user", "content": "Hi"}]
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{session.base_url}/chat/completions", json={"messages": messages}) as answer:
                assert answer.status == 200
            messages += [{"role": "assistant", "content": "First."}, {"role": "user", "content": "Again"}]
            response = await http.post(
                f"{session.base_url}/chat/completions", json={"messages": messages, "stream": True, "logprobs": True}
            )
            seen = ""
            async for event in events(response):
                seen += content_of(event)
                if seen == shown:
                    break  # the agent saw every token the engine streamed before it held the rest, and goes away
            response.close()
            assert session.rollout is not None
            await asyncio.wait_for(asyncio.shield(session.rollout), 30)  # the sequence's rollout ends
        assert fake_vllm.requests_to(ABORT_PATH)  # the engine request was named to the engine
        status = session.status()
        samples = await session.close()
    assert status["status"] == "aborted" and status["reason"] == "agent_disconnected"
    sample = samples[0]
    first = tokenizer.encode("First.<|im_end|>")
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt : prompt + len(first)] == first
    # the cut turn's streamed tokens are kept as generated: after the second call's observation (mask 0)
    assert sample.tokens[-HELD_AFTER:] == generated[:HELD_AFTER]
    assert sample.loss_mask is not None and sample.loss_mask[-HELD_AFTER:] == [1] * HELD_AFTER
    assert sum(sample.loss_mask) == len(first) + HELD_AFTER
    assert sample.rollout_log_probs is not None
    assert sample.rollout_log_probs[-HELD_AFTER:] == [-0.01 * (i + 1) for i in range(HELD_AFTER)]
    assert sample.metadata["disconnected_turn"]["end"] == sample.response_length
    (generate,) = [r for r in fake_vllm.requests_to(GENERATE_PATH) if r.body.get("stream")]
    assert generate.body["request_id"] in fake_vllm.disconnected_request_ids  # its stream was closed too
    assert len(closes) == 1  # the session's environment, closed once
    rows = [orjson.loads(line) for line in trace.read_text().splitlines()]
    (abort,) = [row for row in rows if row.get("trigger") == "abort"]
    assert abort["src"] == "generating" and abort["reason"] == "agent_disconnected"
    assert abort["kept_tokens"] == HELD_AFTER


async def test_a_streamed_retry_within_the_grace_gets_the_whole_answer_generated_once(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer, disconnect_grace_s=3600.0) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True, held_after=HELD_AFTER)], session=session.session_id)
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        headers = {"Idempotency-Key": "call-1"}
        async with aiohttp.ClientSession() as http:
            response = await http.post(f"{session.base_url}/chat/completions", json=body, headers=headers)
            async for event in events(response):
                if content_of(event):
                    break  # the agent saw the first piece, and goes away; its client retries the call
            response.close()
            retried = ""
            async with http.post(f"{session.base_url}/chat/completions", json=body, headers=headers) as retry:
                assert retry.status == 200
                async for event in events(retry):
                    retried += content_of(event)
                    if retried == tokenizer.decode(tokenizer.encode(TEXT)[:HELD_AFTER]):
                        (held,) = fake_vllm.held_request_ids  # the retry has caught up: let the rest come
                        assert fake_vllm.release(held) == 1
        samples = await session.close()
    assert retried == TEXT.removesuffix("<|im_end|>")  # the whole answer, the pieces before the retry included
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 1  # generated once
    assert not fake_vllm.requests_to(ABORT_PATH)
    sample = samples[0]
    generated = tokenizer.encode(TEXT)
    assert sample.status.value == "completed"
    assert sample.tokens[len(sample.tokens) - sample.response_length :] == generated


async def test_a_streamed_chat_answer_on_the_embedded_engine_starts_before_generation_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's worker is held (blocked after sampling) once the tokens so far show content, until the agent
    has the first content event: that event cannot come from a finished generation."""
    go_on = threading.Event()
    sampled: list[tuple[int, float]] = []
    record_token = GenerateJob.record_token
    visible: list[AnswerStream] = []

    def held_record_token(job: GenerateJob, version: str) -> None:
        record_token(job, version)
        generation = job.generation
        if job.on_token is None or generation is None:
            return
        sampled.append((generation.token_ids[-1], generation.logprobs[-1].logprob))
        if not go_on.is_set() and visible and visible[0].feed([generation.token_ids[-1]]):
            assert go_on.wait(60), "the agent never saw the first content event"

    monkeypatch.setattr(GenerateJob, "record_token", held_record_token)
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url,
            model="policy",
            tokenizer_path=str(engine.model_dir),
            max_turns=10,
            check_invariants=True,
        )
        runner = RolloutRunner(config, sampling_params={"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0})
        async with AgentGateway(runner) as gateway:
            session = await gateway.open_session()
            visible.append(AnswerStream(TokenText(runner.tokenizer, runner.sampling_params), parse_calls=False))
            body = {
                "messages": [{"role": "user", "content": "Say something."}],
                "stream": True,
                "max_tokens": 48,
                "seed": 3,
            }
            received: list[Any] = []
            live_at_first_content: list[str] = []
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{session.base_url}/chat/completions", json=body) as response,
            ):
                assert response.status == 200
                async for event in events(response):
                    received.append(event)
                    if content_of(event) and not go_on.is_set():
                        live_at_first_content = engine.live_request_ids()
                        go_on.set()
            samples = await session.close()
    assert len(live_at_first_content) == 1  # the generation was still running when the first content arrived
    sample = samples[0]
    generated = [token for token, _ in sampled]
    assert sample.tokens[len(sample.tokens) - sample.response_length :] == generated
    assert sample.loss_mask == [1] * len(generated)
    assert sample.rollout_log_probs is not None
    assert sample.rollout_log_probs[-len(generated) :] == [logprob for _, logprob in sampled]
    streamed = "".join(content_of(event) for event in received)
    assert streamed == visible[0].content or streamed.startswith(visible[0].content)


def dialect_text(event: Any) -> str:
    """The answer text an event of the Responses or Messages stream adds."""
    if not isinstance(event, dict):
        return ""
    if event.get("type") == "response.output_text.delta":
        return str(event["delta"])
    delta = event.get("delta") if event.get("type") == "content_block_delta" else None
    return str(delta.get("text") or "") if isinstance(delta, dict) else ""


@pytest.mark.parametrize("dialect", ["responses", "messages"])
async def test_a_streamed_responses_or_messages_answer_starts_before_generation_ends(
    fake_vllm: FakeVLLMServer, tokenizer: Any, dialect: str
) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        fake_vllm.script([ScriptedTurn(text=TEXT, hang=True, held_after=6)], session=session.session_id)
        if dialect == "responses":
            url = f"{session.base_url}/responses"
            body: dict[str, Any] = {"input": "Hi", "stream": True}
        else:
            url = f"{session.base_url}/messages"
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 256, "stream": True}
        received: list[Any] = []
        released = False
        async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
            assert response.status == 200
            async for event in events(response):
                received.append(event)
                if dialect_text(event) and not released:
                    await fake_vllm.wait_until_waiting(1)  # the rest of the turn is still held by the engine
                    (held,) = fake_vllm.held_request_ids
                    assert fake_vllm.release(held) == 1
                    released = True
        samples = await session.close()
    assert released
    pieces = [dialect_text(event) for event in received if dialect_text(event)]
    assert len(pieces) > 1 and "".join(pieces) == TEXT.removesuffix("<|im_end|>")
    kinds = [event["type"] for event in received]
    if dialect == "responses":
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.completed"
        assert [event["sequence_number"] for event in received] == list(range(len(received)))
        done = next(event for event in received if event["type"] == "response.output_text.done")
        assert done["text"] == TEXT.removesuffix("<|im_end|>")
    else:
        assert kinds[:3] == ["message_start", "ping", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert received[-2]["delta"]["stop_reason"] == "end_turn"
    generated = tokenizer.encode(TEXT)
    sample = samples[0]
    assert sample.tokens[len(sample.tokens) - sample.response_length :] == generated
    assert sample.loss_mask == [1] * len(generated)


async def test_the_models_list_says_whether_answers_stream_as_generated(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    async with gateway_for(fake_vllm, tokenizer) as gateway:
        session = await gateway.open_session()
        async with aiohttp.ClientSession() as http, http.get(f"{session.base_url}/models") as response:
            streaming = (await response.json())["data"][0]["metadata"]["streaming"]
        assert streaming == "tokens"
        client = gateway.runner.engine_client(fake_vllm.url)  # a transport that cannot stream: whole answers
        original = client.transport
        client.transport = type("Plain", (), {"post_json": original.post_json, "base_url": fake_vllm.url})()
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{session.base_url}/models") as response:
                assert (await response.json())["data"][0]["metadata"]["streaming"] == "whole_answer"
        finally:
            client.transport = original


@pytest.mark.parametrize("refusal", ["rejected", "ignored"])
async def test_an_engine_that_cannot_stream_gets_whole_answer_requests_from_then_on(
    tokenizer: Any, refusal: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An older vLLM answers a streamed generate with 400 (``rejected``) or with its whole
    JSON answer (``ignored``): the call is answered all the same, token-exact, and the engine gets whole-answer
    requests from then on, with one warning and ``GET /v1/models`` saying so."""
    server = FakeVLLMServer(tokenizer, model="fake-model", generate_stream=refusal)
    async with server, gateway_for(server, tokenizer) as gateway:
        session = await gateway.open_session()
        server.script([ScriptedTurn(text="First.<|im_end|>"), ScriptedTurn(text=TEXT)], session=session.session_id)
        models = f"{session.base_url}/models"
        messages: list[Any] = [{"role": "user", "content": "Hi"}]
        answers: list[str] = []
        async with aiohttp.ClientSession() as http:
            async with http.get(models) as response:
                assert (await response.json())["data"][0]["metadata"]["streaming"] == "tokens"
            for follow_up in ("Again", None):  # a call, then its follow-up
                body = {"messages": messages, "stream": True}
                async with http.post(f"{session.base_url}/chat/completions", json=body) as response:
                    assert response.status == 200
                    received = [event async for event in events(response)]
                assert received[-1] == "[DONE]" and received[-2]["choices"][0]["finish_reason"] == "stop"
                answers.append("".join(content_of(event) for event in received))
                if follow_up is not None:
                    messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": "Again"}]
            async with http.get(models) as response:
                assert (await response.json())["data"][0]["metadata"]["streaming"] == "whole_answer"
        samples = await session.close()
    assert answers == ["First.", TEXT.removesuffix("<|im_end|>")]
    asked = [bool(request.body.get("stream")) for request in server.requests_to(GENERATE_PATH)]
    # rejected: the refused request, then the same call whole; ignored: answered whole at once. Then whole only.
    assert asked == ([True, False, False] if refusal == "rejected" else [True, False])
    warnings = [record for record in caplog.records if "come whole from now on" in record.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    sample = samples[0]
    first, second = tokenizer.encode("First.<|im_end|>"), tokenizer.encode(TEXT)
    prompt = len(sample.tokens) - sample.response_length
    assert sample.tokens[prompt : prompt + len(first)] == first and sample.tokens[-len(second) :] == second
    assert sum(sample.loss_mask or []) == len(first) + len(second)
