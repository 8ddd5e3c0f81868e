"""The agent gateway's figures: client CPU and added latency per call, 1,000 concurrent sessions, re-tokenization.

Run it from a checkout with ``python -m tools.bench_gateway`` (``--quick``: fewer sessions; ``--json FILE``;
``--only WORKLOAD``, repeatable: just these). Workloads:

* ``per_call``: sessions of three calls each, one at a time, through the gateway against the canned loopback server
  (:mod:`fsm_rollout.cli.bench.server`, no delay, in a child process so its CPU is not counted). The gateway's CPU
  per call is this process's CPU per call minus the time spent in the chat template (the observation encoder, timed
  around each call) and minus the agent's own HTTP client, measured alone against the gateway's models endpoint,
  which does no rollout work. Beside it, the wall time per call through the gateway against a direct generate
  request with the same tokens to the same server: the difference is what the gateway adds.
* ``concurrent``: 1,000 sessions (``--quick``: 200) of three calls each, all opened at once over HTTP by agents in a
  child process (:mod:`tools.bench_gateway_agents`; agents are other programs in front of a real gateway), against
  the canned server with its 50 ms delay: wall, the gateway process's CPU per call and its event-loop lag (p99,
  max).
* ``retokenization``: 200 scripted sessions against the fake vLLM server whose model calls a tool with arguments
  such as ``false``, ``1.0`` and non-ASCII text, and whose agent re-serialises those arguments its own way (key
  order, spacing, escapes) before sending the history back. A break is a session that forked: the gateway found
  the history rewritten. Beside it, the breaks a proxy that re-renders the agent's history would have: the
  template's rendering of the conversation as the agent sent it, compared with the tokens the model saw.
* ``dialects`` and ``lineage_forks`` (:mod:`tools.bench_gateway_dialects`): the gateway's CPU per call for the
  Messages and Responses dialects on Claude Code's and Codex's recorded requests, each beside chat on the same
  conversation and beside the HTTP floor (:mod:`tools.bench_gateway_floor`: the same traffic relayed with no rollout
  work); and the forks of a Claude Code session with one subagent and one compaction.
* ``first_event`` (:mod:`tools.bench_gateway_first_event`): the time from the engine's first token to the agent's
  first text event, streamed, in each dialect.

Figures vary with the machine's load; nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fsm_rollout.cli.bench.params import LATENCY_S, PROMPT
from fsm_rollout.cli.bench.rollouts import LoopMonitor
from fsm_rollout.tokens.parity import template_token_ids

CHECKOUT = Path(__file__).resolve().parents[1]
"""Where the agents' process starts, so that ``tools`` is importable there."""

CALLS = 3
GOALS = {
    "gateway_cpu_ms_per_call": 1.0,
    "loop_lag_p99_ms": 50.0,
    "retokenization_breaks": 0,
    **{f"{name}_cpu_ms_per_call": 1.0 for name in ("messages", "chat_messages", "responses", "chat_responses")},
    "history_rewritten": 0,
    **{f"{name}_first_event_ms_median": 20.0 for name in ("chat", "responses", "messages")},
}
SUMMARY: tuple[tuple[str, str, str, float | None], ...] = (
    ("gateway CPU per call, template excluded (ms)", "per_call", "gateway_cpu_ms_per_call", 1.0),
    ("added latency per call vs a direct generate (ms)", "per_call", "added_latency_ms_per_call", None),
    ("loop lag p99, concurrent sessions (ms)", "concurrent", "loop_lag_p99_ms", 50.0),
    ("re-tokenization breaks (sessions)", "retokenization", "retokenization_breaks", 0.0),
    ("Messages CPU per call, Claude Code's request (ms)", "dialects", "messages_cpu_ms_per_call", 1.0),
    ("  chat on the same conversation (ms)", "dialects", "chat_messages_cpu_ms_per_call", 1.0),
    ("  HTTP floor: same traffic, no rollout work (ms)", "dialects", "relay_messages_cpu_ms_per_call", None),
    ("Responses CPU per call, Codex's request (ms)", "dialects", "responses_cpu_ms_per_call", 1.0),
    ("  chat on the same conversation (ms)", "dialects", "chat_responses_cpu_ms_per_call", 1.0),
    ("  HTTP floor: same traffic, no rollout work (ms)", "dialects", "relay_responses_cpu_ms_per_call", None),
    ("history_rewritten forks, a subagent and a compaction", "lineage_forks", "history_rewritten", 0.0),
    ("first SSE event after 1st engine token, chat (ms)", "first_event", "chat_first_event_ms_median", 20.0),
    ("  Responses (ms)", "first_event", "responses_first_event_ms_median", 20.0),
    ("  Messages (ms)", "first_event", "messages_first_event_ms_median", 20.0),
)
"""The issues' figures (#39's four, #42's): label, workload, figure and goal (None: reported only)."""
WORKLOADS = ("per_call", "concurrent", "retokenization", "dialects", "lineage_forks", "first_event")


def _gateway(url: str, tokenizer: Any, *, max_turns: int = 16, paced: bool = True) -> Any:
    from fsm_rollout import RolloutConfig, RolloutRunner
    from fsm_rollout.gateway import AgentGateway

    slice_ms = 5.0 if paced else None
    config = RolloutConfig(
        engine_url=url, model="fake-model", max_turns=max_turns, loop_slice_ms=slice_ms, tune_gc=True
    )
    runner = RolloutRunner(
        config, sampling_params={"max_new_tokens": None, "temperature": 1.0, "top_p": 1.0}, tokenizer=tokenizer
    )
    return AgentGateway(runner)


async def _session(gateway: Any, http: Any, calls: int = CALLS) -> float:
    """One agent session of ``calls`` calls over raw HTTP; returns the wall time of its calls."""
    session = await gateway.open_session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    spent = 0.0
    for step in range(calls):
        started = time.perf_counter()
        async with http.post(f"{session.base_url}/chat/completions", json={"messages": messages}) as response:
            answer = await response.json()
        spent += time.perf_counter() - started
        if "choices" not in answer:
            raise RuntimeError(f"bench: the gateway refused a call: {answer}")
        message = answer["choices"][0]["message"]
        messages += [{"role": "assistant", "content": message["content"]}, {"role": "user", "content": f"Go on {step}"}]
    await session.close()
    return spent


async def bench_per_call(url: str, tokenizer: Any, sessions: int) -> dict[str, float]:
    import aiohttp

    from fsm_rollout.engine.client import VLLMClient
    from tools.bench_gateway_dialects import timed_encoder

    async with _gateway(url, tokenizer) as gateway, aiohttp.ClientSession() as http:
        template = timed_encoder(gateway)
        await _session(gateway, http)  # warm up: imports, the connection pools, the encoder's prefixes
        cpu, template_before = time.process_time(), template()
        walls = [await _session(gateway, http) / CALLS for _ in range(sessions)]
        cpu = time.process_time() - cpu
        template_s = template() - template_before
        # the agent's own client: the same number of requests to an endpoint that does no rollout work
        probe = await gateway.open_session()
        agent_cpu = time.process_time()
        for _ in range(sessions * CALLS):
            async with http.get(f"{probe.base_url}/models") as response:
                await response.read()
        agent_cpu = time.process_time() - agent_cpu
        await probe.close()
        # a direct generate with the same tokens, to the same server
        prompt = gateway.runner.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], tokenize=True, add_generation_prompt=True
        )
        token_ids = template_token_ids(prompt, what="the prompt")
        direct: list[float] = []
        async with VLLMClient(url) as client:
            for index in range(sessions * CALLS):
                body = {
                    "model": "fake-model",
                    "token_ids": token_ids,
                    "sampling_params": {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "logprobs": 1},
                    "request_id": f"direct-{index}",
                }
                started = time.perf_counter()
                await client.generate(body, request_id=f"direct-{index}")
                direct.append(time.perf_counter() - started)
    calls = sessions * CALLS
    return {
        "calls": float(calls),
        "process_cpu_ms_per_call": cpu / calls * 1e3,
        "template_ms_per_call": template_s / calls * 1e3,
        "agent_client_ms_per_call": agent_cpu / calls * 1e3,
        "gateway_cpu_ms_per_call": max(0.0, cpu - template_s - agent_cpu) / calls * 1e3,
        "gateway_wall_ms_per_call_median": statistics.median(walls) * 1e3,
        "direct_generate_ms_median": statistics.median(direct) * 1e3,
        "added_latency_ms_per_call": (statistics.median(walls) - statistics.median(direct)) * 1e3,
    }


async def bench_concurrent(url: str, tokenizer: Any, sessions: int, *, paced: bool = True) -> dict[str, float]:
    """``sessions`` agents at once, in a child process (:mod:`tools.bench_gateway_agents`), against a gateway in this
    one."""
    async with _gateway(url, tokenizer, paced=paced) as gateway:
        monitor = LoopMonitor()
        monitor.start()
        wall, cpu = time.perf_counter(), time.process_time()
        agents = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tools.bench_gateway_agents",
            gateway.url,
            str(sessions),
            stdout=asyncio.subprocess.PIPE,
            cwd=CHECKOUT,
        )
        out, _ = await agents.communicate()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await monitor.stop()
        if agents.returncode != 0:
            raise RuntimeError(f"bench: the agents' process exited with {agents.returncode}")
        made = json.loads(out)
        if gateway.runner.metrics().sessions_total != sessions or made["calls"] != sessions * CALLS:
            raise RuntimeError(f"bench: {made['calls']} calls in {gateway.runner.metrics().sessions_total} sessions")
    return {
        "sessions": float(sessions),
        "wall_s": wall,
        "process_cpu_ms_per_call": cpu / (sessions * CALLS) * 1e3,
        "loop_lag_p99_ms": monitor.lag_p99_ms(),
        "loop_lag_max_ms": max(monitor.lags, default=0.0) * 1e3,
    }


ARGUMENTS = [
    {"flag": False, "count": 1.0, "name": "café ☕", "items": [1, 2.50, None], "nested": {"b": True, "a": "x\ty"}},
    {"query": 'what\'s "new"', "limit": 10, "exact": True},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "search", "description": "Search.", "parameters": {"type": "object", "properties": {}}},
    }
]


def _reserialised(arguments: dict[str, Any], variant: int) -> str:
    """The arguments written back the way various agents do: sorted keys, no spaces, ASCII escapes, indents."""
    if variant % 3 == 0:
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"))
    if variant % 3 == 1:
        return json.dumps(arguments, ensure_ascii=True, indent=2)
    return json.dumps(dict(reversed(list(arguments.items()))), ensure_ascii=False)


async def bench_retokenization(tokenizer: Any, sessions: int) -> dict[str, float]:
    import openai
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn

    breaks = 0
    rerender_breaks = 0
    async with FakeVLLMServer(tokenizer, model="fake-model") as server, _gateway(server.url, tokenizer) as gateway:
        for index in range(sessions):
            session = await gateway.open_session()
            arguments = ARGUMENTS[index % len(ARGUMENTS)]
            call = json.dumps({"name": "search", "arguments": arguments}, ensure_ascii=False)
            server.script(
                [
                    ScriptedTurn(text=f"<tool_call>\n{call}\n</tool_call><|im_end|>"),
                    ScriptedTurn(text="Done.<|im_end|>"),
                ],
                session=session.session_id,
            )
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
            messages: list[Any] = [{"role": "user", "content": f"Search {index}"}]
            first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            made = first.choices[0].message.tool_calls[0]  # type: ignore[index]
            assert isinstance(made, ChatCompletionMessageFunctionToolCall)
            decoded = json.loads(made.function.arguments)
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": made.id,
                            "type": "function",
                            "function": {"name": "search", "arguments": _reserialised(decoded, index)},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": made.id, "content": "3 results"})
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            samples = await session.close()
            breaks += len(samples) - 1
            # a proxy that re-renders the agent's history: does the render begin with the tokens the model saw?
            held = samples[0].tokens[: len(samples[0].tokens) - 1]
            render_messages = [dict(message) for message in messages]
            render_messages[1] = {
                **render_messages[1],
                "tool_calls": [
                    {
                        "id": made.id,
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]),
                        },
                    }
                ],
            }
            rendered = tokenizer.apply_chat_template(
                render_messages, tools=TOOLS, tokenize=True, add_generation_prompt=True
            )
            rendered = template_token_ids(rendered, what="the re-render")
            model_saw = samples[0].tokens[: len(samples[0].tokens) - samples[0].response_length]
            turn = [t for t, bit in zip(held[len(model_saw) :], samples[0].loss_mask or [], strict=False) if bit]
            if rendered[: len(model_saw) + len(turn)] != model_saw + turn:
                rerender_breaks += 1
    return {
        "sessions": float(sessions),
        "retokenization_breaks": float(breaks),
        "rerender_proxy_breaks": float(rerender_breaks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sessions")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON here")
    parser.add_argument(
        "--only", choices=WORKLOADS, action="append", metavar="WORKLOAD", help=f"run only these: {', '.join(WORKLOADS)}"
    )
    args = parser.parse_args(argv)
    from fsm_rollout.cli.bench.server import Server
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer
    from tools.bench_gateway_dialects import bench_dialects, bench_lineage_forks, dialect_table

    tokenizer = load_qwen_tokenizer()
    figures: dict[str, dict[str, float]] = {}
    run = set(args.only or WORKLOADS)
    if "per_call" in run:
        server = Server(0.0)
        try:
            figures["per_call"] = asyncio.run(bench_per_call(server.url(), tokenizer, 30 if args.quick else 200))
        finally:
            server.stop()
    if "concurrent" in run:
        server = Server(LATENCY_S)
        try:
            sessions = 200 if args.quick else 1_000
            figures["concurrent"] = asyncio.run(bench_concurrent(server.url(), tokenizer, sessions))
        finally:
            server.stop()
    if "retokenization" in run:
        figures["retokenization"] = asyncio.run(bench_retokenization(tokenizer, 50 if args.quick else 200))
    if "dialects" in run:
        sessions, repeats = (4, 3) if args.quick else (20, 7)
        figures["dialects"] = asyncio.run(bench_dialects(tokenizer, sessions, repeats))
    if "lineage_forks" in run:
        figures["lineage_forks"] = asyncio.run(bench_lineage_forks(tokenizer))
    if "first_event" in run:
        from tools.bench_gateway_first_event import bench_first_event

        figures["first_event"] = asyncio.run(bench_first_event(tokenizer, 10 if args.quick else 50, _gateway))
    for workload, values in figures.items():
        print(workload)
        for name, value in values.items():
            goal = GOALS.get(name)
            met = "" if goal is None else f"  (goal <= {goal:g}: {'met' if value <= goal else 'missed'})"
            print(f"  {name:34s} {value:10.3f}{met}")
    if "dialects" in figures:
        print("\neach dialect beside chat on the same conversation (medians of the repeats)")
        print("\n".join(dialect_table(figures["dialects"])))
    print("\nthe issues' figures, side by side")
    for label, workload, name, goal in SUMMARY:
        if workload not in figures:
            continue
        value = figures[workload][name]
        verdict = "" if goal is None else ("met" if value <= goal else "missed")
        goal_text = "" if goal is None else f"<= {goal:g}"
        print(f"  {label:52s} {value:10.3f}  {goal_text:8s} {verdict}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
