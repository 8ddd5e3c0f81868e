"""vLLM's streamed generate (``"stream": true``) on the fake server and the embedded engine: the chunks have vLLM
0.32's shape, and a client that streams gets the very turn it gets without streaming (tokens, logprobs, finish,
weight versions), its sink seeing every token once, in order."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.engine.local import LocalEngine, tiny_model_dir
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn

CHOICE_KEYS = [
    "index",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
    "sampling_mask",
    "weight_versions",
    "logprobs",
]


async def raw_chunks(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as http, http.post(url + GENERATE_PATH, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
    return [
        line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:])
        for line in text.split("\n\n")
        if line.startswith("data: ")
    ]


def check_chunks(chunks: list[Any], request_id: str) -> list[int]:
    assert chunks[-1] == "[DONE]"
    *tokens, usage, _ = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    streamed: list[int] = []
    for chunk in tokens:
        assert list(chunk) == ["request_id", "usage", "output_mode", "choices"]
        assert chunk["request_id"] == f"generate-tokens-{request_id}" and chunk["output_mode"] == "tokens"
        (choice,) = chunk["choices"]
        assert list(choice) == CHOICE_KEYS
        streamed += choice["token_ids"]
        assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in tokens[:-1])
    assert tokens[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert tokens[-1]["choices"][0]["weight_versions"] is not None
    assert usage["usage"]["completion_tokens"] == len(streamed)
    return streamed


async def streamed_equals_whole(url: str, body: dict[str, Any]) -> None:
    seen: list[tuple[list[int], list[float]]] = []
    async with VLLMClient(url) as client:
        whole = await client.generate(body, request_id="whole")
        streamed = await client.generate(body, request_id="streamed", sink=lambda ids, lps: seen.append((ids, lps)))
    assert streamed.token_ids == whole.token_ids and streamed.logprobs == whole.logprobs
    assert streamed.finish == whole.finish
    assert streamed.meta.weight_version_spans == whole.meta.weight_version_spans
    assert [token for ids, _ in seen for token in ids] == whole.token_ids
    assert [value for _, lps in seen for value in lps] == whole.logprobs


async def test_the_fake_server_streams_a_scripted_turn_as_vllm_does(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    text = "A streamed answer.<|im_end|>"
    fake_vllm.script([ScriptedTurn(text=text)] * 3)
    body = {
        "token_ids": [1, 2, 3],
        "sampling_params": {"logprobs": 1},
        "model": "fake-model",
        "request_id": "r1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert check_chunks(await raw_chunks(fake_vllm.url, body), "r1") == tokenizer.encode(text)
    plain = {key: value for key, value in body.items() if key not in ("stream", "stream_options", "request_id")}
    await streamed_equals_whole(fake_vllm.url, plain)


async def test_the_embedded_engine_streams_each_sampled_token() -> None:
    async with LocalEngine(tiny_model_dir(), served_model_name="policy") as engine:
        sampling = {"logprobs": 1, "max_tokens": 12, "seed": 7, "temperature": 1.0, "ignore_eos": True}
        body = {"token_ids": [1, 2, 3], "sampling_params": sampling, "model": "policy"}
        streamed_body = {**body, "request_id": "r1", "stream": True, "stream_options": {"include_usage": True}}
        assert len(check_chunks(await raw_chunks(engine.url, streamed_body), "r1")) == 12
        await streamed_equals_whole(engine.url, body)
