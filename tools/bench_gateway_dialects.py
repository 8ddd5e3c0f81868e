"""The gateway's figures for the coding harnesses' dialects (:mod:`tools.bench_gateway`'s ``dialects`` and
``lineage_forks`` workloads), on the requests Claude Code and Codex really sent (``tests/fixtures/harness/``).

* ``dialects``: the gateway's CPU per call, template excluded, for the Anthropic Messages API on Claude Code's first
  request (about 49 KB) and the OpenAI Responses API on Codex's (about 39 KB), each beside chat completions on the
  same conversation (the dialect's own reading of the request, sent as a chat body). A session is the harness's two
  calls: the first request, then the continuation a harness sends (the first answer echoed, the recorded tool output
  after it), so the history comparison runs too; both streamed, as the harnesses stream. The engine (in a child
  process, :mod:`tools.bench_gateway_engine`) answers every call with the harness's shell tool call, and the
  harness's calls are made from another child process (:mod:`tools.bench_gateway_dialect_agent`), so the CPU read
  here is the gateway's alone: this process's CPU over the sessions (opened and closed through the Python API, the
  two calls each over HTTP), less the time in the chat template (the observation encoder, timed around each call).
  Beside them, the HTTP floor of each dialect's conversation (:mod:`tools.bench_gateway_floor`): a relay doing the
  same traffic, the harness's requests in and the engine's requests out, with no rollout work. The six
  configurations run interleaved, ``repeats`` times: medians and ranges. A session that forks counts in ``forks``
  (the continuation did not continue the answer).
* ``lineage_forks``: one Claude Code session through ``/v1/messages`` with one subagent (another system prompt and
  tool set, while the main chain goes on) and one compaction (a summary request, then the summary in place of the
  earlier turns), against the scripted fake engine: the sequences it exports and why each one ended.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]
FIXTURES = CHECKOUT / "tests" / "fixtures" / "harness"
CLAUDE_CALL = {"name": "Bash", "arguments": {"command": "echo harness-was-here > out.txt", "description": "Write it"}}
CODEX_CALL = {"name": "exec_command", "arguments": {"cmd": "echo harness-was-here > out.txt"}}
ID = re.compile(rb'"(?:id|call_id)"\s*:\s*"((?:toolu|call|fc)_[^"]+)"')
"""An id the answer gives its tool call (Messages' tool_use id; Responses' item id and call id; chat's call id)."""
GOAL_MS = 1.0


def recorded(name: str) -> dict[str, Any]:
    """A recorded harness request: ``method``, ``path``, ``headers``, ``body``, ... (see /work/captures)."""
    value: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return value


def _tool_text(text: str) -> str:
    return f"<tool_call>\n{text}\n</tool_call>"


@dataclass
class Conversation:
    """One harness session's two calls in one dialect: the first body, and the continuation with a placeholder for
    each id the first answer gives its tool call (in the order the answer names them)."""

    label: str
    path: str
    first: bytes
    second: bytes
    placeholders: list[bytes]

    def continuation(self, answer: bytes) -> bytes:
        found = list(dict.fromkeys(match.group(1) for match in ID.finditer(answer)))
        if len(found) != len(self.placeholders):
            raise RuntimeError(f"bench: {self.label}: the answer names {found}, not {len(self.placeholders)} ids")
        body = self.second
        for placeholder, value in zip(self.placeholders, found, strict=True):
            body = body.replace(placeholder, value)
        return body


def _placeholders(echo: Any, ids: list[str]) -> tuple[str, list[bytes]]:
    """``echo`` (JSON text) with each id replaced by a placeholder."""
    text = json.dumps(echo, ensure_ascii=False)
    marks = []
    for index, value in enumerate(ids):
        mark = f"@@id{index}@@"
        text = text.replace(value, mark)
        marks.append(mark.encode())
    return text, marks


def messages_conversation(answer: dict[str, Any]) -> Conversation:
    """Claude Code's session in the Messages dialect; ``answer`` is the gateway's (whole) answer to its first call."""
    first = recorded("claude-request-1")["body"]
    result = recorded("claude-request-2")["body"]["messages"][-1]  # the tool_result Claude Code sent back
    ids = [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": answer["content"]}]}
    result = copy.deepcopy(result)
    result["content"][0]["tool_use_id"] = ids[0]
    second["messages"].append(result)
    text, marks = _placeholders(second, ids)
    return Conversation("messages", "messages", json.dumps(first).encode(), text.encode(), marks)


def responses_conversation(answer: dict[str, Any]) -> Conversation:
    """Codex's session in the Responses dialect; ``answer`` is the gateway's (whole) answer to its first call."""
    first = recorded("codex-request-1")["body"]
    output = copy.deepcopy(recorded("codex-request-2")["body"]["input"][-1])  # the function_call_output
    items = answer["output"]
    calls = [item for item in items if item["type"] == "function_call"]
    ids = [calls[0]["id"], calls[0]["call_id"]]
    output["call_id"] = calls[0]["call_id"]
    second = {**first, "input": [*first["input"], *items, output]}
    text, marks = _placeholders(second, ids)
    return Conversation("responses", "responses", json.dumps(first).encode(), text.encode(), marks)


def chat_twin(label: str, chat: Any, result: str, answer: dict[str, Any]) -> Conversation:
    """The same conversation as a chat completions session: ``chat`` is the dialect's reading of the first request
    (a :class:`~fsm_rollout.gateway.openai_wire.ChatCall`), ``result`` the tool output sent back."""
    first: dict[str, Any] = {"model": "fake-model", "messages": chat.messages, "stream": True}
    if chat.tools:
        first["tools"] = chat.tools
    message = answer["choices"][0]["message"]
    ids = [call["id"] for call in message["tool_calls"]]
    echo = {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]}
    second = {**first, "messages": [*chat.messages, echo, {"role": "tool", "tool_call_id": ids[0], "content": result}]}
    text, marks = _placeholders(second, ids)
    return Conversation(label, "chat/completions", json.dumps(first).encode(), text.encode(), marks)


def _gateway(url: str, tokenizer: Any) -> Any:
    from fsm_rollout import RolloutConfig, RolloutRunner
    from fsm_rollout.gateway import AgentGateway

    config = RolloutConfig(engine_url=url, model="fake-model", max_turns=16, loop_slice_ms=5.0, tune_gc=True)
    runner = RolloutRunner(
        config, sampling_params={"max_new_tokens": None, "temperature": 1.0, "top_p": 1.0}, tokenizer=tokenizer
    )
    return AgentGateway(runner)


def timed_encoder(gateway: Any) -> Callable[[], float]:
    """CPU time spent in the observation encoder (the chat template), read as a running total."""
    encoder = gateway.runner.encoder
    spent = [0.0]
    encode = encoder.encode

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return encode(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - started

    encoder.encode = timed
    return lambda: spent[0]


HEADERS = {"content-type": "application/json"}


async def post(http: Any, url: str, body: bytes) -> bytes:
    """POST a JSON body; the answer's bytes (an error status raises, with the answer's start)."""
    async with http.post(url, data=body, headers=HEADERS) as response:
        answer: bytes = await response.read()
        if response.status != 200:
            raise RuntimeError(f"bench: {url} answered {response.status}: {answer[:300]!r}")
    return answer


async def _whole(http: Any, url: str, body: bytes) -> dict[str, Any]:
    """A first call answered whole (``stream: false``), to learn the answer's shape."""
    value: dict[str, Any] = json.loads(await post(http, url, body.replace(b'"stream": true', b'"stream": false')))
    return value


async def _conversations(
    gateways: dict[str, Any], http: Any
) -> tuple[list[tuple[Any, Conversation]], dict[str, dict[str, Any]]]:
    """Each dialect's conversation and its chat twin, with the gateway that runs them; and each dialect's request as
    chat messages and tools (the relay's render body)."""
    from fsm_rollout.gateway.messages_wire import parse_messages_request
    from fsm_rollout.gateway.responses_wire import parse_responses_request

    out: list[tuple[Any, Conversation]] = []
    chats: dict[str, dict[str, Any]] = {}
    for dialect, gateway in gateways.items():
        session = await gateway.open_session()
        if dialect == "messages":
            body = recorded("claude-request-1")["body"]
            answer = await _whole(http, f"{session.base_url}/messages", json.dumps(body).encode())
            conversation = messages_conversation(answer)
            chat = parse_messages_request(body).call
            result = recorded("claude-request-2")["body"]["messages"][-1]["content"][0]["content"]
        else:
            body = recorded("codex-request-1")["body"]
            answer = await _whole(http, f"{session.base_url}/responses", json.dumps(body).encode())
            conversation = responses_conversation(answer)
            chat = parse_responses_request(body).chat_call()
            result = recorded("codex-request-2")["body"]["input"][-1]["output"]
        await session.close()
        session = await gateway.open_session()
        twin_body = json.dumps({"model": "fake-model", "messages": chat.messages, "tools": chat.tools}).encode()
        twin_answer = await _whole(http, f"{session.base_url}/chat/completions", twin_body)
        await session.close()
        out.append((gateway, conversation))
        out.append((gateway, chat_twin(f"chat_{dialect}", chat, result, twin_answer)))
        chats[dialect] = {"messages": chat.messages, "tools": chat.tools}
    return out, chats


class Agent:
    """The harness side, in a child process (:mod:`tools.bench_gateway_dialect_agent`): it makes the calls of the
    sessions it is given and says when it is done, so this process's CPU over a job is the gateway's."""

    def __init__(self, process: Any) -> None:
        self._process = process

    @classmethod
    async def start(cls) -> Agent:
        import asyncio
        import sys

        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tools.bench_gateway_dialect_agent",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=CHECKOUT,
        )
        return cls(process)

    async def run(self, conversation: Conversation, base_urls: list[str]) -> None:
        job = {
            "path": conversation.path,
            "first": conversation.first.decode(),
            "second": conversation.second.decode(),
            "placeholders": [mark.decode() for mark in conversation.placeholders],
            "base_urls": base_urls,
        }
        self._process.stdin.write(json.dumps(job).encode() + b"\n")
        await self._process.stdin.drain()
        line = await self._process.stdout.readline()
        done = json.loads(line) if line else {"error": f"the agent's process exited ({self._process.returncode})"}
        if "error" in done:
            raise RuntimeError(f"bench: {conversation.label}: {done['error']}")

    async def stop(self) -> None:
        self._process.stdin.close()
        await self._process.wait()


async def _sessions(gateway: Any, agent: Agent, conversation: Conversation, count: int) -> int:
    """``count`` harness sessions of two calls, made by ``agent``; returns the forks (sequences beyond one each)."""
    sessions = [await gateway.open_session() for _ in range(count)]
    await agent.run(conversation, [session.base_url for session in sessions])
    return sum([len(await session.close()) - 1 for session in sessions])


async def bench_dialects(tokenizer: Any, sessions: int, repeats: int) -> dict[str, float]:
    """Gateway CPU per call, template excluded, for each dialect and chat on the same conversation, and the HTTP floor
    under them (:mod:`tools.bench_gateway_floor`'s relay, on the dialect's requests); see the module docstring.
    ``sessions`` sessions per configuration per repeat."""
    import itertools

    import aiohttp

    from tools.bench_gateway_engine import Engine
    from tools.bench_gateway_floor import Relay

    engines = {
        "messages": Engine(_tool_text(json.dumps(CLAUDE_CALL)), CHECKOUT),
        "responses": Engine(_tool_text(json.dumps(CODEX_CALL)), CHECKOUT),
    }
    agent: Agent | None = None
    numbers = itertools.count()
    try:
        gateways = {dialect: _gateway(engine.url, tokenizer) for dialect, engine in engines.items()}
        async with gateways["messages"], gateways["responses"], aiohttp.ClientSession() as http:
            clocks = {id(gateway): timed_encoder(gateway) for gateway in gateways.values()}
            runs, chats = await _conversations(gateways, http)
            relays = {
                dialect: Relay(engines[dialect].url, chats[dialect], len(conversation.placeholders))
                for dialect, conversation in (("messages", runs[0][1]), ("responses", runs[2][1]))
            }
            async with relays["messages"], relays["responses"]:
                # label, conversation, sessions' runner (returns the forks), template clock
                configs: list[tuple[str, Conversation, Callable[[int], Any], Callable[[], float]]] = []
                agent = await Agent.start()
                for gateway, conversation in runs:

                    async def served(count: int, g: Any = gateway, c: Conversation = conversation) -> int:
                        assert agent is not None
                        return await _sessions(g, agent, c, count)

                    configs.append((conversation.label, conversation, served, clocks[id(gateway)]))
                for dialect, relay in relays.items():
                    conversation = runs[0][1] if dialect == "messages" else runs[2][1]

                    async def relayed(count: int, r: Relay = relay, c: Conversation = conversation) -> int:
                        assert agent is not None
                        await agent.run(c, [r.base_url(next(numbers)) for _ in range(count)])
                        return 0

                    configs.append((f"relay_{dialect}", conversation, relayed, lambda: 0.0))
                for _, _, run, _ in configs:  # warm up: imports, connection pools, the encoders' prefixes
                    await run(1)
                per_call: dict[str, list[float]] = {label: [] for label, *_ in configs}
                forks = {label: 0 for label, *_ in configs}
                for repeat in range(repeats):
                    for label, _, run, template in configs if repeat % 2 == 0 else configs[::-1]:  # drift spread
                        cpu, template_before = time.process_time(), template()
                        forks[label] += await run(sessions)
                        cpu = time.process_time() - cpu - (template() - template_before)
                        per_call[label].append(max(0.0, cpu) / (sessions * 2) * 1e3)
    finally:
        if agent is not None:
            await agent.stop()
        for engine in engines.values():
            engine.stop()
    figures: dict[str, float] = {
        "calls_per_configuration": float(sessions * 2 * repeats),
        "messages_request_kb": len(runs[0][1].first) / 1000,
        "responses_request_kb": len(runs[2][1].first) / 1000,
    }
    for name, values in per_call.items():
        figures[f"{name}_cpu_ms_per_call"] = statistics.median(values)
        figures[f"{name}_cpu_ms_min"] = min(values)
        figures[f"{name}_cpu_ms_max"] = max(values)
        figures[f"{name}_forks"] = float(forks[name])
    for dialect in ("messages", "responses"):
        dialect_ms, chat_ms = figures[f"{dialect}_cpu_ms_per_call"], figures[f"chat_{dialect}_cpu_ms_per_call"]
        figures[f"{dialect}_over_chat"] = dialect_ms / chat_ms if chat_ms else float("nan")
        figures[f"{dialect}_minus_chat_ms"] = dialect_ms - chat_ms
        figures[f"{dialect}_minus_floor_ms"] = dialect_ms - figures[f"relay_{dialect}_cpu_ms_per_call"]
    return figures


SUMMARY = "Summary: the user asked for out.txt; a subagent found where it goes; the Bash call wrote it."
COMPACT_ASK = "Your task is to create a detailed summary of the conversation so far. Reply with the summary only."
CONTINUED = (
    "This session is being continued from a previous conversation that ran out of context. The summary below "
    "covers the earlier portion of the conversation.\n\n"
)
SUBAGENT_TASK = "Where should out.txt go?"
AGENT_CALL = {"name": "Agent", "arguments": {"description": "Find the place", "prompt": SUBAGENT_TASK}}
SUBAGENT_PROMPT = "You are an agent for Claude Code. Given the user's message, use the tools to answer it, then report."


def _results(answer: dict[str, Any], text: str) -> dict[str, Any]:
    """The user message Claude Code sends back after running the answer's tool call."""
    (call,) = [block for block in answer["content"] if block["type"] == "tool_use"]
    return {"role": "user", "content": [{"tool_use_id": call["id"], "type": "tool_result", "content": text}]}


async def bench_lineage_forks(tokenizer: Any) -> dict[str, float]:
    """Claude Code's session with one subagent and one compaction, through ``/v1/messages`` (see the module
    docstring): the sequences the session exports, its lineages, and why each sequence ended."""
    import aiohttp

    from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
    from tools.bench_gateway_engine import MAX_MODEL_LEN

    texts = [
        _tool_text(json.dumps(AGENT_CALL)),  # main: spawn the subagent
        "out.txt goes in the working directory.",  # the subagent
        _tool_text(json.dumps(CLAUDE_CALL)),  # main, with the subagent's report: the shell call
        "Done: out.txt is written.",  # main, with the shell's output
        SUMMARY,  # main, asked to compact
        "Continuing from the summary: nothing is left to do.",  # main, after the compaction
    ]
    first = recorded("claude-request-1")["body"] | {"stream": False}
    shell_output = recorded("claude-request-2")["body"]["messages"][-1]["content"][0]["content"]
    async with (
        FakeVLLMServer(tokenizer, model="fake-model", max_model_len=MAX_MODEL_LEN) as server,
        _gateway(server.url, tokenizer) as gateway,
        aiohttp.ClientSession() as http,
    ):
        session = await gateway.open_session()
        server.script([ScriptedTurn(text=text + "<|im_end|>") for text in texts], session=session.session_id)
        url = f"{session.base_url}/messages"

        async def call(body: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = json.loads(await post(http, url, json.dumps(body).encode()))
            return answer

        main = list(first["messages"])
        spawn = await call(first)
        sub_system = [*first["system"][:2], {"type": "text", "text": SUBAGENT_PROMPT}]
        sub_tools = [tool for tool in first["tools"] if tool["name"] != "Agent"]
        sub_messages = [{"role": "user", "content": [{"type": "text", "text": SUBAGENT_TASK}]}]
        report = await call({**first, "system": sub_system, "tools": sub_tools, "messages": sub_messages})
        main += [{"role": "assistant", "content": spawn["content"]}, _results(spawn, report["content"][0]["text"])]
        shell = await call({**first, "messages": main})
        main += [{"role": "assistant", "content": shell["content"]}, _results(shell, shell_output)]
        done = await call({**first, "messages": main})
        main += [{"role": "assistant", "content": done["content"]}, {"role": "user", "content": COMPACT_ASK}]
        summary = await call({**first, "messages": main})
        compacted = [
            {"role": "user", "content": [{"type": "text", "text": CONTINUED + summary["content"][0]["text"]}]},
            first["messages"][1],  # the environment's system message, as the first request had it
        ]
        await call({**first, "messages": compacted})
        samples = await session.close(reward=1.0)
    return {
        "calls": float(len(texts)),
        "sequences": float(len(samples)),
        "lineages": float(len({sample.metadata.get("lineage") for sample in samples})),
        "history_rewritten": float(sum("history_rewritten" in sample.metadata for sample in samples)),
        "compacted": float(sum("compacted" in sample.metadata for sample in samples)),
        "compaction_summary_marked": float(sum(bool(sample.metadata.get("compaction_summary")) for sample in samples)),
    }


def dialect_table(figures: dict[str, float]) -> list[str]:
    """The ``dialects`` figures side by side: each dialect beside chat on the same conversation and the HTTP floor."""
    lines = [f"  {'CPU per call, template excluded (ms)':40s} {'median':>8s} {'range':>15s}  vs chat"]
    for dialect, request in (("messages", "Claude Code"), ("responses", "Codex")):
        size = figures[f"{dialect}_request_kb"]
        rows = (
            (dialect, f"{dialect}, {request} ({size:.0f} KB)"),
            (f"chat_{dialect}", "  chat, same"),
            (f"relay_{dialect}", "  HTTP floor (relay), same"),
        )
        for name, label in rows:
            low, high = figures[f"{name}_cpu_ms_min"], figures[f"{name}_cpu_ms_max"]
            ratio = f"x{figures[f'{dialect}_over_chat']:.2f}" if name == dialect else ""
            median = figures[f"{name}_cpu_ms_per_call"]
            lines.append(f"  {label:40s} {median:8.3f} {low:7.3f}-{high:<7.3f}  {ratio}".rstrip())
    return lines
