"""A recording stand-in for the Responses and Messages endpoints: what a real coding harness sends, captured.

Run by hand (``python tests/harness/record_server.py --out DIR``): it listens on loopback, prints its port, saves
every request it gets (method, path, query, headers, body) as ``DIR/NNN-<kind>.json`` and answers the two dialects
with the least a streaming client accepts:

* ``POST .../responses`` (Codex): Responses SSE events, ``response.created`` to ``response.completed``. While no
  ``function_call_output`` is in the input the answer is a ``function_call`` of the shell tool, else a message.
* ``POST .../messages`` (Claude Code): Anthropic SSE events, ``message_start`` to ``message_stop``. While no
  ``tool_result`` is in the last user message and ``Bash`` is among the tools the answer is a ``tool_use`` of it,
  else text.

With ``--thinking`` each answer starts with a ``reasoning`` item (with ``encrypted_content``) or a ``thinking`` block
(with a ``signature``), to see what the harness echoes back. Anything else is recorded and answered 404, so a
harness's side traffic shows in the captures. The shell command is ``--command`` (default: write ``out.txt`` in
the harness's working directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import pathlib
import sys
from typing import Any

from aiohttp import web

DEFAULT_COMMAND = "echo harness-was-here > out.txt"
FINAL_TEXT = "The file is written."
THINKING = "I should write the file with the shell."


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class Recorder:
    def __init__(self, out: pathlib.Path, command: str, thinking: bool) -> None:
        self.out = out
        self.thinking = thinking
        self.command = command
        self.counter = itertools.count(1)
        self.ids = itertools.count(1)
        out.mkdir(parents=True, exist_ok=True)

    def save(self, request: web.Request, raw: bytes, kind: str) -> None:
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        record = {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "headers": dict(request.headers),
            "body": body,
            "body_bytes": len(raw),
        }
        name = self.out / f"{next(self.counter):03d}-{kind}.json"
        name.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"recorded {request.method} {request.path_qs} -> {name.name}", file=sys.stderr, flush=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        with contextlib.suppress(ValueError):
            body = json.loads(raw) if raw else None
        if request.method == "POST" and request.path.endswith("/responses") and isinstance(body, dict):
            self.save(request, raw, "responses")
            return await self.responses(request, body)
        if request.method == "POST" and request.path.endswith("/messages") and isinstance(body, dict):
            self.save(request, raw, "messages")
            return await self.messages(request, body)
        self.save(request, raw, "other")
        return web.json_response({"error": {"message": f"not recorded: {request.path}"}}, status=404)

    # --- Responses (Codex) ---

    async def responses(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        answered = any(isinstance(item, dict) and item.get("type") == "function_call_output" for item in items)
        tool_names = [tool.get("name") for tool in body.get("tools") or [] if isinstance(tool, dict)]
        n = next(self.ids)
        response_id = f"resp_{n}"
        if not answered and "exec_command" in tool_names:
            item: dict[str, Any] = {
                "type": "function_call",
                "id": f"fc_{n}",
                "call_id": f"call_{n}",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": self.command}),
                "status": "completed",
            }
        else:
            item = {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": FINAL_TEXT, "annotations": []}],
            }
        reasoning = {
            "type": "reasoning",
            "id": f"rs_{n}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": THINKING}],
            "encrypted_content": f"opaque-{n}",
        }
        base = {
            "id": response_id,
            "object": "response",
            "created_at": 0,
            "model": body.get("model"),
            "output": [],
            "status": "in_progress",
        }
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        seq = itertools.count()
        await stream.write(
            sse("response.created", {"type": "response.created", "sequence_number": next(seq), "response": base})
        )
        output: list[dict[str, Any]] = []
        if self.thinking:
            await stream.write(
                sse(
                    "response.output_item.added",
                    {
                        "type": "response.output_item.added",
                        "sequence_number": next(seq),
                        "output_index": 0,
                        "item": {**reasoning, "content": []},
                    },
                )
            )
            await stream.write(
                sse(
                    "response.reasoning_text.delta",
                    {
                        "type": "response.reasoning_text.delta",
                        "sequence_number": next(seq),
                        "item_id": reasoning["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "delta": THINKING,
                    },
                )
            )
            await stream.write(
                sse(
                    "response.output_item.done",
                    {
                        "type": "response.output_item.done",
                        "sequence_number": next(seq),
                        "output_index": 0,
                        "item": reasoning,
                    },
                )
            )
            output.append(reasoning)
        index = len(output)
        await stream.write(
            sse(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": next(seq),
                    "output_index": index,
                    "item": {**item, "status": "in_progress"},
                },
            )
        )
        if item["type"] == "message":
            await stream.write(
                sse(
                    "response.output_text.delta",
                    {
                        "type": "response.output_text.delta",
                        "sequence_number": next(seq),
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": FINAL_TEXT,
                    },
                )
            )
        await stream.write(
            sse(
                "response.output_item.done",
                {
                    "type": "response.output_item.done",
                    "sequence_number": next(seq),
                    "output_index": index,
                    "item": item,
                },
            )
        )
        output.append(item)
        usage = {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        }
        done = {**base, "status": "completed", "output": output, "usage": usage}
        await stream.write(
            sse("response.completed", {"type": "response.completed", "sequence_number": next(seq), "response": done})
        )
        await stream.write_eof()
        return stream

    # --- Messages (Claude Code) ---

    async def messages(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        content = last.get("content") if isinstance(last, dict) else None
        answered = isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_result" for block in content
        )
        tool_names = [tool.get("name") for tool in body.get("tools") or [] if isinstance(tool, dict)]
        n = next(self.ids)
        message_id = f"msg_{n:024d}"
        if not answered and "Bash" in tool_names:
            block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{n:024d}", "name": "Bash", "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps({"command": self.command, "description": "Write the file"}),
            }
            stop_reason = "tool_use"
        else:
            block = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": FINAL_TEXT}
            stop_reason = "end_turn"
        if not body.get("stream"):
            if block["type"] == "tool_use":
                full = {**block, "input": json.loads(delta["partial_json"])}
            else:
                full = {"type": "text", "text": FINAL_TEXT}
            return web.json_response(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body.get("model"),
                    "content": [full],
                    "stop_reason": stop_reason,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 5},
                }
            )
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        start = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1},
        }
        await stream.write(sse("message_start", {"type": "message_start", "message": start}))
        index = 0
        if self.thinking:
            await stream.write(
                sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                    },
                )
            )
            await stream.write(
                sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "thinking_delta", "thinking": THINKING},
                    },
                )
            )
            await stream.write(
                sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "signature_delta", "signature": f"sig-{n}"},
                    },
                )
            )
            await stream.write(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
            index = 1
        await stream.write(
            sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
        )
        await stream.write(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        await stream.write(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        await stream.write(
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": 5},
                },
            )
        )
        await stream.write(sse("message_stop", {"type": "message_stop"}))
        await stream.write_eof()
        return stream


async def serve(out: pathlib.Path, command: str, port: int, thinking: bool) -> None:
    recorder = Recorder(out, command, thinking)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--command", default=DEFAULT_COMMAND)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--thinking", action="store_true", help="answers start with a reasoning item / thinking block")
    args = parser.parse_args()
    asyncio.run(serve(args.out, args.command, args.port, args.thinking))


if __name__ == "__main__":
    main()
