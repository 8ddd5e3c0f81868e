"""The report of a real run that forks and is suspended by a weight update: a runner against the fake vLLM server,
whose template strips the thinking of earlier turns (so every user observation forks under ``history_policy=
"fork"``), with each rollout's second turn held at the server until a weight update cuts it. The page's data is
checked against the run's own samples, and the page in headless Chromium."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, get_tracer
from fsm_rollout.cli.run_report import write_results
from fsm_rollout.recording import tape_path_for
from fsm_rollout.replay import replay
from fsm_rollout.report import build_report, write_report
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.templates import THINK_STRIPPING_CHAT_TEMPLATE, qwen_tokenizer_with_template
from tools.chromium import Chromium, find_chromium

EOS = "<|im_end|>"
THINKING = [
    f"<think>\nSix sevens.\n</think>\n\nIt is 42.{EOS}",
    f"<think>\nCheck again.\n</think>\n\nStill 42.{EOS}",
    f"<think>\nOnce more.\n</think>\n\nYes, 42.{EOS}",
]
HELD_AFTER = 4
"""Tokens of the second turn generated under the old weights before the weight update cuts it."""

needs_chromium = pytest.mark.skipif(
    find_chromium() is None and not os.environ.get("CI"), reason="Chromium is not installed"
)


@dataclass
class Run:
    trace: Path
    results: Path
    samples: list[Sample]
    tokenizer: Any


@pytest.fixture(scope="module")
def stripping_tokenizer() -> Any:
    return qwen_tokenizer_with_template(THINK_STRIPPING_CHAT_TEMPLATE)


@pytest.fixture
async def run(tmp_path: Path, stripping_tokenizer: Any) -> Run:
    trace = tmp_path / "run.jsonl"
    async with FakeVLLMServer(stripping_tokenizer, model="fake-model") as server:
        for session in ("a", "b"):
            turns = [ScriptedTurn(text=text) for text in THINKING]
            turns[1] = ScriptedTurn(text=THINKING[1], hang=True, held_after=HELD_AFTER)
            server.script(turns, session=session)
        config = RolloutConfig(
            engine_url=server.url,
            model="fake-model",
            max_turns=3,
            check_invariants=True,
            history_policy="fork",
            router_policy="consistent_hash",
            trace=str(trace),
            record=True,
        )
        sampling = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
        batch = [
            Sample(prompt="What is 6 * 7?", index=i, group_index=0, session_id=session, metadata={"group_member": i})
            for i, session in enumerate("ab")
        ]
        async with RolloutRunner(
            config, sampling_params=sampling, tokenizer=stripping_tokenizer, env_factory=ScriptedEnvFactory()
        ) as runner:
            running = asyncio.ensure_future(runner.run_batch(batch))
            await server.wait_until_waiting(2)  # both second turns are held, HELD_AFTER tokens in
            async with runner.weight_update(version="v2"):
                pass
            samples = await running
    get_tracer(str(trace)).close()  # the sink is shared per path: close it before reading
    for sample, reward in zip(samples, (1.0, 0.0), strict=True):
        sample.reward = reward
    write_results(samples, tmp_path / "results.jsonl")
    assert [len(sample.branches) for sample in samples] == [2, 2]
    return Run(trace, tmp_path / "results.jsonl", samples, stripping_tokenizer)


def build(run: Run, **kwargs: Any) -> Any:
    return build_report(run.trace, results=run.results, tokenizer=run.tokenizer, **kwargs)


def expand(runs: list[list[int]]) -> list[int]:
    return [value for value, count in runs for _ in range(count)]


async def test_the_summary_and_rows_show_the_forks_and_suspensions(run: Run) -> None:
    data = await asyncio.to_thread(build, run)
    summary = data.index["summary"]
    assert summary["forks"] == {"reason": "history_rewritten", "transitions": 4, "samples": 2}
    assert summary["suspensions"]["counts"] == {"suspend": 2, "resume": 2}
    assert summary["suspensions"]["samples"] == 2
    assert [row[-1].split()[:2] for row in data.index["rows"]] == [["fork", "suspended"]] * 2
    fork_edges = [edge for edge in data.index["lifecycle"]["edges"] if edge["trigger"] == "fork"]
    assert sum(edge["transitions"] for edge in fork_edges) == 4


async def test_the_conversation_says_where_a_turn_forked_and_waited_for_the_weight_update(run: Run) -> None:
    data = await asyncio.to_thread(build, run)
    conversation = data.details[0]["conversation"]
    assert conversation["label"] is None  # the samples have none: nothing to show, not the text "None"
    events = [turn.get("events", []) for turn in conversation["turns"]]
    assert events[0] == []
    fork, suspended, resumed = events[1]
    assert fork.startswith("fork (history_rewritten)") and "training sequence 1" in fork
    assert suspended == f"suspended (weight_update) after {HELD_AFTER} token(s) of this turn"
    assert resumed.startswith("resumed on weights v2 after ")
    assert len(events[2]) == 1 and "training sequence 2" in events[2][0]
    fields = {key for step in data.details[0]["timeline"] for key, _ in step["detail"]}
    assert {"branch", "partial_tokens", "suspend_reason", "weight_version"} <= fields


async def test_the_tape_strip_runs_every_sequence_with_its_boundaries_and_weight_versions(run: Run) -> None:
    data = await asyncio.to_thread(build, run)
    for detail, sample in zip(data.details, run.samples, strict=True):
        assert detail["source"] == "tape"
        strip = detail["tokens"]
        sequences = [*sample.branches, sample]
        assert strip["ids"] == [token for sequence in sequences for token in sequence.tokens]
        lengths = [len(sequence.tokens) for sequence in sequences]
        starts = [sum(lengths[:number]) for number in range(len(lengths))]
        assert strip["sequences"] == [[starts[0], starts[1], "branch 0"], [starts[1], starts[2], "branch 1"],
                                      [starts[2], sum(lengths), "final sequence"]]  # fmt: skip
        prompts = [len(sequence.tokens) - sequence.response_length for sequence in sequences]
        assert strip["prompts"] == [[start, start + prompt] for start, prompt in zip(starts, prompts, strict=True)]
        masks = [[0] * prompt + (sequence.loss_mask or []) for sequence, prompt in zip(sequences, prompts, strict=True)]
        assert expand(strip["mask"]) == [bit for mask in masks for bit in mask]
        # the second turn (branch 1) is HELD_AFTER tokens of the old weights, the rest of the new ones
        second = starts[1] + prompts[1]
        assert [second, second + HELD_AFTER, "default"] in strip["versions"]
        assert [second + HELD_AFTER, starts[2], "v2"] in strip["versions"]
        assert strip["versions"][-1] == [starts[2] + prompts[2], sum(lengths), "v2"]
        assert [segment[2:] for segment in strip["segments"]] == [["model", 0], ["model", 1], ["model", 2]]
        # the same strip as the results file gives (Sample.to_dict() with its branches)
        from_results = detail_from_results(run, sample)
        for key in ("ids", "mask", "prompts", "versions", "sequences", "logprobs"):
            assert strip[key] == from_results[key], key


def detail_from_results(run: Run, sample: Sample) -> dict[str, Any]:
    from fsm_rollout.report.detail import strip_from_results

    strip = strip_from_results(sample.to_dict(), run.tokenizer)
    assert strip is not None
    return strip


async def test_a_changed_branch_token_is_marked_where_that_branch_runs_in_the_strip(run: Run, tmp_path: Path) -> None:
    tape = tape_path_for(run.trace)
    lines = tape.read_bytes().splitlines()
    changed = 20
    for number, line in enumerate(lines):
        record = orjson.loads(line)
        if record.get("kind") == "sample" and record["session_id"] == "b":
            record["result"]["branches"][1]["tokens"][changed] += 1
            lines[number] = orjson.dumps(record)
    tape.write_bytes(b"\n".join(lines) + b"\n")
    report = await asyncio.to_thread(replay, run.trace, tokenizer=run.tokenizer)
    replay_json = tmp_path / "replay.json"
    replay_json.write_bytes(orjson.dumps(report.to_dict()))
    data = await asyncio.to_thread(build, run, replay=replay_json)
    divergence = data.details[1]["replay"]["divergence"]
    assert divergence["message"].startswith(f"branch 1 tokens[{changed}]")
    branch_start = data.details[1]["tokens"]["sequences"][1][0]
    assert divergence["strip_index"] == branch_start + changed
    assert data.details[0]["replay"]["verdict"] == "identical"


@needs_chromium
async def test_the_page_shows_the_forks_suspensions_and_branch_boundaries(run: Run, tmp_path: Path) -> None:
    page = write_report(await asyncio.to_thread(build, run), tmp_path / "report.html")
    async with Chromium() as browser:
        await browser.open(page.as_uri())
        await browser.wait_for("document.body.dataset.ready")
        summary = await browser.evaluate("document.getElementById('app').textContent")
        assert "history_rewritten" in summary and "suspend" in summary
        flags = await browser.evaluate("[...document.querySelectorAll('#rows .vrow')].map((r) => r.textContent)")
        assert len(flags) == 2 and all("fork" in row and "suspended" in row for row in flags)
        await browser.evaluate("document.querySelector('#rows .vrow[data-sample=\"0\"]').click()")
        await browser.wait_for("document.getElementById('tokens')")
        texts = "[...document.querySelectorAll('#tokens .mark.{}')].map((m) => m.textContent)"
        marks = await browser.evaluate(texts.format("seq"))
        assert marks == ["\u2503 branch 0", "\u2503 branch 1", "\u2503 final sequence"]
        assert await browser.evaluate(texts.format("ver")) == ["weights default", "weights v2"]
        timeline = await browser.evaluate("document.getElementById('sample').textContent")
        assert "suspend" in timeline and "resume" in timeline and "fork" in timeline
        lines = await browser.evaluate("[...document.querySelectorAll('.msg.event')].map((m) => m.textContent)")
        assert len(lines) == 4 and "resumed on weights v2" in lines[2]
        roles = await browser.evaluate("[...document.querySelectorAll('.msg .role')].map((m) => m.textContent)")
        assert "label" not in roles
        sample = run.samples[0]
        trained = await browser.evaluate("document.querySelectorAll('#tokens .tok.trained').length")
        assert trained == sum(sum(sequence.loss_mask) for sequence in [*sample.branches, sample])
        assert browser.console_errors() == []
