"""Lineages and compaction in gateway sessions: a subagent or side request is a chain of its own, run as its own
rollout beside the main one (calls in flight on both at once), and a compaction ends a sequence ``compacted`` with its
summary call marked. Over real HTTP (the ``openai`` SDK) and through the session API with a harness's hints, against
the scripted fake engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest

from fsm_rollout import Sample, training_sequences
from fsm_rollout.gateway import AgentGateway, GatewaySession
from fsm_rollout.gateway.openai_wire import parse_chat_request
from fsm_rollout.report import build_report
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from tests.integration.test_gateway import TOOLS, runner_for

MAIN_SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools."}
SUB_SYSTEM = {"role": "system", "content": "You are a subagent: answer the one question you are given."}
SUMMARY = "SUMMARY: the bug in foo.py is an off-by-one in the loop over the lines."


@pytest.fixture
async def gateway(fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any) -> AsyncIterator[AgentGateway]:
    runner = runner_for(fake_vllm, tokenizer, trace=str(tmp_path / "trace.jsonl"), record=True)
    async with AgentGateway(runner) as gateway:
        yield gateway


def generated_by_request(server: FakeVLLMServer, session_id: str, texts: Sequence[str], tokenizer: Any) -> list[Any]:
    """The session's generate requests in arrival order, each with the tokens its scripted turn generated."""
    requests = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session_id]
    assert len(requests) == len(texts)
    return [
        (r.body["token_ids"], tokenizer.encode(text, add_special_tokens=False))
        for r, text in zip(requests, texts, strict=True)
    ]


def check_token_exact(sequences: Sequence[Sample], generated: Sequence[Any]) -> None:
    """Each generate request continued exactly one sequence: its prompt is a prefix of that sequence's tokens and what
    it generated follows there with mask 1; every other token of every sequence has mask 0."""
    used = set()
    for sequence in sequences:
        assert sequence.loss_mask is not None
        prompt_length = len(sequence.tokens) - sequence.response_length
        expected = [0] * sequence.response_length
        for number, (sent, tokens) in enumerate(generated):
            if len(sent) >= prompt_length and sequence.tokens[: len(sent)] == sent:
                assert sequence.tokens[len(sent) : len(sent) + len(tokens)] == tokens
                for position in range(len(sent), len(sent) + len(tokens)):
                    expected[position - prompt_length] = 1
                assert number not in used, "a generated turn is trained in two sequences"
                used.add(number)
        assert list(sequence.loss_mask) == expected
    assert used == set(range(len(generated))), "a generated turn is trained in no sequence"


def fork_reasons(trace: Any) -> list[str]:
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    return [row.get("reason") for row in rows if row.get("trigger") == "fork" and row.get("dst") == "rendered"]


async def test_a_subagent_runs_as_its_own_lineage_concurrently_and_a_compaction_ends_its_sequence_compacted(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any
) -> None:
    session = await gateway.open_session()
    texts = [
        "I will ask a subagent about foo.py.<|im_end|>",  # main, held until the subagent has answered
        "foo.py loops one line too far.<|im_end|>",  # subagent
        "Thanks; now I know where the bug is.<|im_end|>",  # main
        "It is the range(len(lines) + 1).<|im_end|>",  # subagent, asked again
        SUMMARY + "<|im_end|>",  # main, asked for a summary of the conversation
        "Fixed the loop in foo.py.<|im_end|>",  # main, after the compaction
    ]
    fake_vllm.script(
        [ScriptedTurn(text=texts[0], hang=True), *(ScriptedTurn(text=text) for text in texts[1:])],
        session=session.session_id,
    )
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
    main: list[Any] = [MAIN_SYSTEM, {"role": "user", "content": "Fix the bug in foo.py."}]
    sub: list[Any] = [SUB_SYSTEM, {"role": "user", "content": "Where does foo.py go wrong?"}]

    held = asyncio.ensure_future(client.chat.completions.create(model="m", messages=main, tools=TOOLS))
    await fake_vllm.wait_until_waiting(1)
    # the main chain's call is in flight: the subagent's call (another system prompt, no tools) is no 409
    sub_answer = await client.chat.completions.create(model="m", messages=sub)
    assert sub_answer.choices[0].message.content == "foo.py loops one line too far."
    assert session.status()["lineages"][0]["session_state"] == "answering"
    fake_vllm.release(fake_vllm.held_request_ids[0])
    first = await held
    assert first.choices[0].message.content == "I will ask a subagent about foo.py."
    # the chains interleave: each call continues its own lineage
    main += [{"role": "assistant", "content": first.choices[0].message.content}]
    main += [{"role": "user", "content": "The subagent says: " + str(sub_answer.choices[0].message.content)}]
    second = await client.chat.completions.create(model="m", messages=main, tools=TOOLS)
    sub += [{"role": "assistant", "content": sub_answer.choices[0].message.content}]
    sub += [{"role": "user", "content": "Which expression exactly?"}]
    assert (await client.chat.completions.create(model="m", messages=sub)).choices[0].message.content
    # the main agent compacts: a summary request on its chain, then the summary replaces the earlier turns
    main += [{"role": "assistant", "content": second.choices[0].message.content}]
    main += [{"role": "user", "content": "Summarize the conversation so far."}]
    summary = await client.chat.completions.create(model="m", messages=main, tools=TOOLS)
    assert summary.choices[0].message.content == SUMMARY
    compacted = [MAIN_SYSTEM, {"role": "user", "content": f"Earlier work, summarized:\n{SUMMARY}\nGo on."}]
    last = await client.chat.completions.create(model="m", messages=compacted, tools=TOOLS)
    assert last.choices[0].message.content == "Fixed the loop in foo.py."
    status = session.status()
    assert [(each["lineage"], each["sequences"], each["calls"]) for each in status["lineages"]] == [
        ("l0", 2, 4),
        ("l1", 1, 2),
    ]
    assert status["sequences"] == 3 and status["calls"] == 6

    samples = await session.close(reward=1.0)
    # the main lineage's last sequence is the session's sample; every other sequence is one of its branches
    assert samples[-1].branches == samples[:-1] and len(samples) == 3
    assert training_sequences([samples[-1]]) == samples
    assert [s.metadata["lineage"] for s in samples] == ["l0", "l1", "l0"]
    assert [s.metadata["parent_lineage"] for s in samples] == [None, None, None]
    assert [s.metadata["branch"] for s in samples] == [0, 1, 2]
    assert all(s.reward == 1.0 and s.rollout_id == samples[-1].rollout_id for s in samples)
    assert all(s.index == samples[-1].index and s.group_index == samples[-1].group_index for s in samples)
    # one compaction and no history_rewritten fork: the subagent is a lineage, not a fork of the main chain
    assert samples[0].metadata["compacted"].startswith("messages[1] (user) differs")
    assert not any("history_rewritten" in s.metadata for s in samples)
    assert fork_reasons(tmp_path / "trace.jsonl") == ["compacted"]
    # the summary call is marked on the sequence holding it, with its response span
    marked = [s for s in samples if s.metadata.get("compaction_summary")]
    assert marked == [samples[0]]
    (span,) = samples[0].metadata["compaction_summary_spans"]
    start = len(samples[0].tokens) - samples[0].response_length
    summary_tokens = tokenizer.encode(SUMMARY + "<|im_end|>", add_special_tokens=False)
    assert samples[0].tokens[start + span["start"] : start + span["end"]] == summary_tokens
    assert samples[0].loss_mask is not None and set(samples[0].loss_mask[span["start"] : span["end"]]) == {1}
    # token-exact per lineage: trained tokens are exactly the generated ones, in exactly one sequence
    check_token_exact(samples, generated_by_request(fake_vllm, session.session_id, texts, tokenizer))


async def _call(session: GatewaySession, messages: list[Any], tools: Any = None, **hints: Any) -> str | None:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    call = dataclasses.replace(parse_chat_request(body), hints=hints)
    return (await session.chat(call)).content


async def test_harness_hints_name_lineages_their_parents_and_a_compaction(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any
) -> None:
    session = await gateway.open_session()
    texts = [
        "Spawning a helper.<|im_end|>",
        "Helper: done.<|im_end|>",
        "Here is my summary of the task so far.<|im_end|>",
        "Continuing in the new window.<|im_end|>",
    ]
    fake_vllm.script([ScriptedTurn(text=text) for text in texts], session=session.session_id)
    main: list[Any] = [MAIN_SYSTEM, {"role": "user", "content": "Do the task."}]
    assert await _call(session, main, TOOLS, lineage_key="thread-a", window="thread-a:0") == "Spawning a helper."
    # the helper has the main agent's system prompt and tools: only the harness's keys tell it apart from a fork
    helper = [MAIN_SYSTEM, {"role": "user", "content": "Check the tests."}]
    assert await _call(session, helper, TOOLS, lineage_key="thread-b", parent_lineage_key="thread-a") == (
        "Helper: done."
    )
    main += [{"role": "assistant", "content": "Spawning a helper."}, {"role": "user", "content": "Compact."}]
    summary = await _call(session, main, TOOLS, lineage_key="thread-a", window="thread-a:0", request_kind="compact")
    assert summary == "Here is my summary of the task so far."
    # a new window on the same thread is a compaction, though its text holds no earlier answer
    compacted = [MAIN_SYSTEM, {"role": "user", "content": "(context compacted)"}]
    assert await _call(session, compacted, TOOLS, lineage_key="thread-a", window="thread-a:1") == (
        "Continuing in the new window."
    )
    samples = await session.close(reward=0.5)
    assert [(s.metadata["lineage"], s.metadata["parent_lineage"]) for s in samples] == [
        ("l0", None),
        ("l1", "l0"),
        ("l0", None),
    ]
    assert [s.metadata.get("lineage_key") for s in samples] == ["thread-a", "thread-b", "thread-a"]
    assert samples[0].metadata["compacted"] and not any("history_rewritten" in s.metadata for s in samples)
    assert [bool(s.metadata.get("compaction_summary")) for s in samples] == [True, False, False]
    assert fork_reasons(tmp_path / "trace.jsonl") == ["compacted"]
    check_token_exact(samples, generated_by_request(fake_vllm, session.session_id, texts, tokenizer))


async def test_a_rewrite_with_the_same_system_prompt_and_tools_still_forks_and_the_window_hint_decides(
    gateway: AgentGateway, fake_vllm: FakeVLLMServer, tmp_path: Any
) -> None:
    session = await gateway.open_session()
    long_answer = "A long enough answer that a summary could quote it.<|im_end|>"
    fake_vllm.script(
        [ScriptedTurn(text=long_answer), ScriptedTurn(text="Two.<|im_end|>"), ScriptedTurn(text="Three.<|im_end|>")],
        session=session.session_id,
    )
    first = [MAIN_SYSTEM, {"role": "user", "content": "One?"}]
    answer = await _call(session, first, TOOLS, window="w0")
    # the same system prompt and tools, another first question: the chain's rewrite, a fork as before lineages
    assert await _call(session, [MAIN_SYSTEM, {"role": "user", "content": "Two?"}], TOOLS, window="w0") == "Two."
    # the harness's unchanged window says no compaction, though the prompt quotes an earlier answer
    quoted = [MAIN_SYSTEM, {"role": "user", "content": f"Recall: {answer}"}]
    assert await _call(session, quoted, TOOLS, window="w0") == "Three."
    samples = await session.close()
    assert [s.metadata["lineage"] for s in samples] == ["l0", "l0", "l0"]
    assert all("history_rewritten" in s.metadata for s in samples[:2])
    assert fork_reasons(tmp_path / "trace.jsonl") == ["history_rewritten", "history_rewritten"]
    assert not any(s.metadata.get("compaction_summary") for s in samples)


async def test_a_recorded_session_with_lineages_and_a_compaction_replays_identically(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Any, capsys: Any
) -> None:
    trace = tmp_path / "gateway.jsonl"
    async with AgentGateway(runner_for(fake_vllm, tokenizer, trace=str(trace), record=True)) as gateway:
        session = await gateway.open_session()
        texts = ["Main one.<|im_end|>", "Sub one.<|im_end|>", SUMMARY + "<|im_end|>", "Main after.<|im_end|>"]
        fake_vllm.script([ScriptedTurn(text=text) for text in texts], session=session.session_id)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        main: list[Any] = [MAIN_SYSTEM, {"role": "user", "content": "Go."}]
        await client.chat.completions.create(model="m", messages=main, tools=TOOLS, temperature=0.5)  # type: ignore[arg-type]
        await client.chat.completions.create(model="m", messages=[SUB_SYSTEM, {"role": "user", "content": "Q?"}])
        main += [{"role": "assistant", "content": "Main one."}, {"role": "user", "content": "Summarize."}]
        await client.chat.completions.create(model="m", messages=main, tools=TOOLS)  # type: ignore[arg-type]
        compacted = [MAIN_SYSTEM, {"role": "user", "content": SUMMARY}]
        await client.chat.completions.create(model="m", messages=compacted, tools=TOOLS, top_p=0.5)  # type: ignore[arg-type]
        samples = await session.close(reward=1.0)
        assert [s.metadata["lineage"] for s in samples] == ["l0", "l1", "l0"]
    from fsm_rollout.cli import main as cli

    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["replay", str(trace)]) == 0, capsys.readouterr()
    replayed = capsys.readouterr().out
    assert "re-executed 4 turns" in replayed and "identical 2" in replayed, replayed
    assert await asyncio.to_thread(cli, ["inspect", str(trace)]) == 0
    shown = capsys.readouterr().out
    assert "lineage l0 2 sequence(s) (compacted 1); lineage l1 1 sequence(s)" in shown, shown
    assert await asyncio.to_thread(cli, ["inspect", str(trace), "--sample", "0.0.l1"]) == 0
    assert "lineage l1 of 0.0" in capsys.readouterr().out
    # the report groups the session's runs by lineage and counts the compaction apart from history rewrites
    summary = (await asyncio.to_thread(build_report, trace, tokenizer=tokenizer)).index["summary"]
    assert summary["compactions"] == {"reason": "compacted", "transitions": 1, "samples": 1}
    assert summary["forks"] is None
    assert [(each["lineage"], each["sequences"]) for each in summary["lineages"][0]["lineages"]] == [
        ("l0", 2),
        ("l1", 1),
    ]
