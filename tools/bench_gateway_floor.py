"""The HTTP floor under the ``dialects`` figures (:mod:`tools.bench_gateway_dialects`): a relay that does a gateway
call's traffic and nothing else, timed the same way beside the gateway.

Per call the relay reads and parses the harness's request (40-50 KB), sends the engine what the gateway sends (on a
session's first call the render request, the conversation as chat messages and tools, whose answer of about 12k
token ids it parses; then the generate request with the prompt's ids, streamed), parses each streamed chunk and
writes one event per chunk to the harness, then a last event. It keeps no sample, checks nothing, decodes no text
and runs no state machine: what the gateway costs beyond it is the rollout's work; the relay's own figure is what
any gateway on this HTTP stack pays for the same bytes.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

MODEL = "fake-model"
OBSERVATION = 40
"""Tokens the relay adds between a session's calls, standing for the tool output the harness sent back."""


class Relay:
    """An aiohttp app at ``/relay/{session}/{path}`` in front of the bench's engine (see the module docstring)."""

    def __init__(self, engine_url: str, chat: dict[str, Any], ids_per_answer: int) -> None:
        self._engine = engine_url
        self._chat = chat  # the render request's body: the conversation as chat messages and tools
        self._ids = ids_per_answer
        self._sessions: dict[str, list[int]] = {}
        self._http: Any = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> Relay:
        import aiohttp

        self._http = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/relay/{sid}/{path:.*}", self._call)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    def base_url(self, index: int) -> str:
        return f"{self.url}/relay/s{index}"

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        async with self._http.post(self._engine + path, data=orjson.dumps(body), headers=_JSON) as response:
            return orjson.loads(await response.read())

    async def _call(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        orjson.loads(await request.read())  # parsed, as a gateway must, though the relay needs none of it
        prompt = self._sessions.get(sid)
        if prompt is None:
            rendered = await self._post("/v1/chat/completions/render", {"model": MODEL, **self._chat})
            if not isinstance(rendered, dict) or "token_ids" not in rendered:
                raise web.HTTPBadGateway(text=f"the engine's render answered {str(rendered)[:300]}")
            prompt = rendered["token_ids"]
        else:
            prompt = prompt + prompt[:OBSERVATION]
        generate = {
            "model": MODEL,
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 4096, "temperature": 1.0, "top_p": 1.0, "logprobs": 1},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        generated: list[int] = []
        async with self._http.post(
            self._engine + "/inference/v1/generate", data=orjson.dumps(generate), headers=_JSON
        ) as response:
            partial = b""
            async for chunk in response.content.iter_any():
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    for choice in orjson.loads(line[5:]).get("choices") or ():
                        new = choice.get("token_ids") or []
                        generated.extend(new)
                        await answer.write(b"data: " + orjson.dumps({"token_ids": new}) + b"\n\n")
        self._sessions[sid] = prompt + generated
        ids = [f"toolu_relay_{sid}_{len(prompt)}_{index}" for index in range(self._ids)]
        await answer.write(b"data: " + orjson.dumps([{"id": value} for value in ids]) + b"\n\n")
        await answer.write_eof()
        return answer


_JSON = {"content-type": "application/json"}
