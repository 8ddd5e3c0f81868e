"""The harness side of the gateway's ``dialects`` workload (:mod:`tools.bench_gateway_dialects`), in a process of its
own, so the CPU the benchmark reads is the gateway's alone: the agent's HTTP client (sending a 40-50 KB body, reading
an answer streamed as events) runs here, as a harness runs beside the gateway.

``python -m tools.bench_gateway_dialect_agent`` reads one job per line on stdin (JSON: ``path``, ``first``,
``second``, ``placeholders`` and ``base_urls``, as a :class:`~tools.bench_gateway_dialects.Conversation` and the
sessions to run it in), makes each session's two calls one after the other, and writes one line when the job is
done (``{"calls": N}``), or ``{"error": ...}`` and exits 1. It exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


async def _job(http: Any, job: dict[str, Any]) -> int:
    from tools.bench_gateway_dialects import Conversation, post

    conversation = Conversation(
        label=job["path"],
        path=job["path"],
        first=job["first"].encode(),
        second=job["second"].encode(),
        placeholders=[mark.encode() for mark in job["placeholders"]],
    )
    for base_url in job["base_urls"]:
        url = f"{base_url}/{conversation.path}"
        answer = await post(http, url, conversation.first)
        await post(http, url, conversation.continuation(answer))
    return 2 * len(job["base_urls"])


async def _serve() -> int:
    import aiohttp

    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return 0
            try:
                calls = await _job(http, json.loads(line))
            except Exception as error:  # the parent reports it; a half-done job must not look done
                print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
                return 1
            print(json.dumps({"calls": calls}), flush=True)


def main() -> int:
    return asyncio.run(_serve())


if __name__ == "__main__":
    sys.exit(main())
