"""The gateway benchmark's agents, in a process of their own: ``python -m tools.bench_gateway_agents URL N``.

Opens ``N`` sessions on the gateway at ``URL`` at once over HTTP, makes each one's calls (the messages grow as an
agent's do), closes it, and prints one JSON line: the wall time and the calls made. Agents are separate programs
in front of a real gateway, so the benchmark runs them here, and the gateway's event-loop lag is its own.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from fsm_rollout.cli.bench.params import PROMPT

CALLS = 3


async def _session(http: Any, url: str, calls: int) -> int:
    async with http.post(f"{url}/sessions", json={}) as response:
        opened = await response.json()
    base_url = opened["base_url"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for step in range(calls):
        async with http.post(f"{base_url}/chat/completions", json={"messages": messages}) as response:
            answer = await response.json()
        if "choices" not in answer:
            raise RuntimeError(f"bench: the gateway refused a call: {answer}")
        message = answer["choices"][0]["message"]
        messages += [{"role": "assistant", "content": message["content"]}, {"role": "user", "content": f"Go on {step}"}]
    async with http.post(f"{url}/sessions/{opened['session_id']}/close", json={}) as response:
        closed = await response.json()
    if len(closed.get("samples", ())) != 1:
        raise RuntimeError(f"bench: a session closed with {len(closed.get('samples', ()))} sequences, expected 1")
    return calls


async def run(url: str, sessions: int, calls: int = CALLS) -> dict[str, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started = time.perf_counter()
        made = await asyncio.gather(*(_session(http, url, calls) for _ in range(sessions)))
        wall = time.perf_counter() - started
    return {"wall_s": wall, "calls": float(sum(made))}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m tools.bench_gateway_agents URL SESSIONS", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(run(args[0], int(args[1])))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
