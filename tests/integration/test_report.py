"""``fsm-rollout report`` over a run recorded against the fake vLLM server: the page's data, its escaping, the
command, and the page itself in headless Chromium (the browser tests skip without Chromium, and fail in CI)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_rollout import Sample
from fsm_rollout.cli import main as cli_main
from fsm_rollout.cli.run_report import write_results
from fsm_rollout.recording import TapeWriter, recorded_rollout, tape_path_for
from fsm_rollout.replay import replay
from fsm_rollout.report import build_report, write_report
from fsm_rollout.report.page import json_for_script, render_page
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import Tracer
from tools.chromium import Chromium, find_chromium
from tools.report_synthetic import write_synthetic_run

EOS = "<|im_end|>"
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "stop": ["</tool_call>"], "no_stop_trim": True}
INJECTED_PROMPT = "<script>window.__pwned = 'prompt'</script> What is 6 * 7?"
INJECTED_TURN = (
    '<think>I should call the tool.</think> Calling <tool_call>{"name": "calc", "arguments": '
    '{"x": "<script>window.__pwned = \'tool\'</script>"}}</tool_call>'
)
INJECTED_OBSERVATION = "<img src=x onerror=\"window.__pwned = 'observation'\"> keep going"

# In CI (where .ci/run installs Chromium) a missing browser fails these tests instead of skipping them.
needs_chromium = pytest.mark.skipif(
    find_chromium() is None and not os.environ.get("CI"), reason="Chromium is not installed"
)


@dataclass
class Recorded:
    trace: Path
    tape: Path
    results: Path
    samples: list[Sample]
    tokenizer: Any


async def record_run(
    tmp_path: Path, server: FakeVLLMServer, client: Any, tokenizer: Any, make_config: Callable[..., Any]
) -> Recorded:
    """Five samples in two groups: one with injected markup everywhere (prompt, thinking, a tool call, an
    observation), one cut by max_turns, one failing, and a group of two with the same reward."""
    trace = tmp_path / "run.jsonl"
    tracer = Tracer(trace.open("ab"), owns_stream=True)
    writer = TapeWriter(tape_path_for(trace))
    plans: list[tuple[int, int, str, list[ScriptedTurn], ScriptedEnvFactory, dict[str, Any]]] = [
        (0, 0, INJECTED_PROMPT, [ScriptedTurn(text=INJECTED_TURN), ScriptedTurn(text=f"42{EOS}")],
         ScriptedEnvFactory(steps=[(INJECTED_OBSERVATION, False), ("correct", True)]), {}),
        (0, 1, "What is 2 + 2?", [ScriptedTurn(text="a"), ScriptedTurn(text="b")], ScriptedEnvFactory(),
         {"max_turns": 2}),
        (0, 2, "What is 1 + 1?", [ScriptedTurn(text="first"), ScriptedTurn(status=400)], ScriptedEnvFactory(), {}),
        (1, 0, "Name a colour.", [ScriptedTurn(text=f"red{EOS}")], ScriptedEnvFactory(steps=[("ok", True)]), {}),
        (1, 1, "Name a colour.", [ScriptedTurn(text=f"blue{EOS}")], ScriptedEnvFactory(steps=[("ok", True)]), {}),
    ]  # fmt: skip
    samples = []
    for group, member, prompt, turns, envs, config in plans:
        session = f"s{group}.{member}"
        server.script(turns, session=session)
        sample = Sample(prompt=prompt, index=group, group_index=group, session_id=session,
                        metadata={"group_member": member})  # fmt: skip
        rollout = recorded_rollout(
            sample,
            config=make_config(router_policy="consistent_hash", **config),
            sampling_params=SAMPLING,
            client=client,
            tokenizer=tokenizer,
            env_factory=envs,
            tracer=tracer,
            tape=writer,
            sample_id=f"{group}.{member}",
        )
        await asyncio.gather(rollout.run(), return_exceptions=True)  # the failing one raises its error
        sample.reward = {0: 1.0, 1: 0.0, 2: 0.0}[member] if group == 0 else 0.5
        samples.append(sample)
    writer.close()
    tracer.close()
    results = tmp_path / "results.jsonl"
    write_results(samples, results)
    assert [sample.status.value for sample in samples] == ["completed", "truncated", "failed", "completed",
                                                           "completed"]  # fmt: skip
    return Recorded(trace, tape_path_for(trace), results, samples, tokenizer)


@pytest.fixture
async def recorded(
    tmp_path: Path, fake_vllm: FakeVLLMServer, client: Any, tokenizer: Any, make_config: Callable[..., Any]
) -> Recorded:
    return await record_run(tmp_path, fake_vllm, client, tokenizer, make_config)


def build(recorded: Recorded, **kwargs: Any) -> Any:
    return build_report(recorded.trace, results=recorded.results, tokenizer=recorded.tokenizer, **kwargs)


def expand(runs: list[list[int]]) -> list[int]:
    return [value for value, count in runs for _ in range(count)]


# ---------------------------------------------------------------------------------------------------- the data


async def test_the_summary_counts_the_run_and_flags_zero_variance_groups(recorded: Recorded) -> None:
    data = await asyncio.to_thread(build, recorded)
    summary = data.index["summary"]
    assert summary["runs"] == 5 and summary["unfinished"] == 0
    statuses = {item["status"]: dict(item["reasons"]) for item in summary["statuses"]}
    assert statuses == {"completed": {"env_done": 3}, "truncated": {"max_turns": 1}, "failed": {"error": 1}}
    groups = {group["group"]: group for group in summary["groups"]}
    assert groups["0"]["rewards"] == [1.0, 0.0, 0.0] and not groups["0"]["zero_variance"]
    assert groups["1"]["rewards"] == [0.5, 0.5] and groups["1"]["zero_variance"]
    assert summary["queued"] is None or summary["queued"]["n"] <= 5  # a bare rollout waits for no slot
    assert [row[0] for row in data.index["rows"]] == ["0.0", "0.1", "0.2", "1.0", "1.1"]
    edges = data.index["lifecycle"]["edges"]
    taken = {(edge["src"], edge["trigger"], edge["dst"]): edge["transitions"] for edge in edges if edge["transitions"]}
    assert taken[("pending", "render", "rendered")] == 5


async def test_a_sample_page_has_its_timeline_conversation_and_token_strip(recorded: Recorded) -> None:
    data = await asyncio.to_thread(build, recorded)
    page = data.details[0]
    sample = recorded.samples[0]
    assert page["timeline"][-1]["terminal"] and page["timeline"][-1]["reason"] == "env_done"
    conversation = page["conversation"]
    assert conversation["prompt"][0]["parts"][0]["text"] == INJECTED_PROMPT
    first = conversation["turns"][0]
    assert [part["kind"] for part in first["parts"]] == ["think", "text", "tool_call"]
    assert first["env"] == {"done": False, "observation": INJECTED_OBSERVATION}
    assert conversation["reward"] == 1.0
    strip = page["tokens"]
    assert strip["ids"] == sample.tokens
    prompt_length = len(sample.tokens) - sample.response_length
    assert strip["prompts"] == [[0, prompt_length]]
    assert expand(strip["mask"]) == [0] * prompt_length + sample.loss_mask
    assert strip["logprobs"][prompt_length:] == [round(value, 4) for value in sample.rollout_log_probs]
    # the first turn stops on a stop string: the masked EOS inserted after it is marked
    eos_position = prompt_length + next(i for i, m in enumerate(sample.loss_mask) if m == 0)
    assert strip["eos"][0] == eos_position and strip["texts"][str(sample.tokens[eos_position])] == EOS
    assert all(strip["texts"][str(token)] == recorded.tokenizer.decode([token]) for token in sample.tokens[:5])


async def test_without_results_the_rewards_come_from_the_tape(recorded: Recorded) -> None:
    lines = recorded.tape.read_bytes().splitlines()
    for number, line in enumerate(lines):
        record = orjson.loads(line)
        if record.get("kind") == "sample":
            record["result"]["reward"] = {"1.0": 0.5, "1.1": 0.5}.get(record["sample_id"], 0.0)
            lines[number] = orjson.dumps(record)
    recorded.tape.write_bytes(b"\n".join(lines) + b"\n")
    data = await asyncio.to_thread(build_report, recorded.trace, tokenizer=recorded.tokenizer)
    assert [row[5] for row in data.index["rows"]] == [0.0, 0.0, 0.0, 0.5, 0.5]
    groups = {group["group"]: group["zero_variance"] for group in data.index["summary"]["groups"]}
    assert groups == {"0": True, "1": True}


async def test_without_a_tape_the_trace_still_gives_timelines_reasons_and_counts(recorded: Recorded) -> None:
    recorded.tape.unlink()
    data = await asyncio.to_thread(build_report, recorded.trace)
    assert data.index["meta"]["tape"] is None
    assert any("no tape" in note for note in data.notes)
    assert [row[3] for row in data.index["rows"]] == ["env_done", "max_turns", "error", "env_done", "env_done"]
    assert all(page["timeline"] and page["conversation"] is None for page in data.details)
    with_results = await asyncio.to_thread(build_report, recorded.trace, results=recorded.results)
    (note,) = with_results.notes  # the results file gives each page its prompt, response and tokens
    assert note.startswith("no tape: the sample pages show the results file's prompt, whole response and tokens")
    assert note.endswith("give `--tokenizer` for their text")
    assert all(page["source"] == "results" and page["tokens"] for page in with_results.details)


async def test_the_page_holds_no_markup_from_the_run(recorded: Recorded) -> None:
    data = await asyncio.to_thread(build, recorded)
    html = render_page(data.index, data.details)
    assert "window.__pwned" in html  # the text is there, as data
    assert len(re.findall(r"<script", html, re.IGNORECASE)) == 3 + len(data.details)
    assert "<img" not in html and "<tool_call>" not in html and "<think>" not in html
    assert render_page(data.index, data.details) == html  # the same inputs give the same bytes


def test_json_for_script_escapes_what_could_end_the_element() -> None:
    value = {"text": "</script><script>alert(1)</script> & <!-- <img onerror=x>", "<key>": ["\u2028"]}
    text = json_for_script(value)
    assert not set("<>&") & set(text)
    assert orjson.loads(text) == value


async def test_the_command_writes_the_page_and_refuses_bad_input(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out" / "report.html"
    code = await asyncio.to_thread(
        cli_main, ["report", str(recorded.trace), "--results", str(recorded.results), "-o", str(output)]
    )
    assert code == 0 and output.read_text().startswith("<!DOCTYPE html>")
    assert f"report: {output} (5 sample runs" in capsys.readouterr().out
    assert await asyncio.to_thread(cli_main, ["report", str(tmp_path / "missing.jsonl")]) == 2
    not_results = tmp_path / "not-results.jsonl"
    not_results.write_text('{"a": 1}\n')
    assert await asyncio.to_thread(cli_main, ["report", str(recorded.trace), "--results", str(not_results)]) == 2
    assert "not a results file" in capsys.readouterr().err
    bad_replay = tmp_path / "replay.json"
    bad_replay.write_text("[]")
    assert await asyncio.to_thread(cli_main, ["report", str(recorded.trace), "--replay", str(bad_replay)]) == 2
    assert "replay --json" in capsys.readouterr().err


@pytest.mark.synthetic_paths
def test_forks_and_suspensions_are_counted_from_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    base = {"event": "transition", "schema": 1, "session_id": None}
    path = [
        ("render", "pending", "rendered", {}),
        ("generate", "rendered", "generating", {}),
        ("suspend", "generating", "suspended", {"suspend_reason": "weight_update"}),
        ("resume", "suspended", "generating", {"suspended_ms": 120.0, "weight_version": "2"}),
        ("step", "generating", "stepping", {"generated_tokens": 3}),
        ("observe", "stepping", "observing", {}),
        ("generate", "observing", "generating", {"reason": "history_rewritten"}),
        ("step", "generating", "stepping", {"generated_tokens": 2}),
        ("observe", "stepping", "completed", {"reason": "env_done"}),
    ]
    lines = [{**base, "sample_id": "0", "trigger": t, "src": s, "dst": d, "turn": 0, "ts": 1.0 + i, **extra}
             for i, (t, s, d, extra) in enumerate(path)]  # fmt: skip
    trace.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    summary = build_report(trace).index["summary"]
    assert summary["forks"] == {"reason": "history_rewritten", "transitions": 1, "samples": 1}
    assert summary["suspensions"]["counts"] == {"suspend": 1, "resume": 1}
    assert summary["suspensions"]["suspended_ms"]["max"] == 120.0
    assert build_report(trace).index["rows"][0][-1].split()[:2] == ["fork", "suspended"]


def test_a_sample_is_flagged_queued_only_when_it_waited_a_noticeable_time() -> None:
    from fsm_rollout.replay import TracedPath
    from fsm_rollout.report.model import sample_row

    def flags(queued_ms: float) -> str:
        event = {"trigger": "render", "src": "pending", "dst": "rendered", "queued_ms": queued_ms, "ts": 1.0}
        return str(sample_row(TracedPath(sample_id="0", session_id=None, events=[event]), None, None)[-1])

    assert flags(0.08) == "" and flags(49.0) == ""  # shown, these read "queued 0.0s": noise on every row
    assert flags(50.0) == "queued 0.1s" and flags(13_400.0) == "queued 13.4s"


async def diverged_report(recorded: Recorded, tmp_path: Path) -> Any:
    """The report of the recording with one result token of sample 1.0 changed, and its replay."""
    replacement = recorded.tokenizer.encode(" banana", add_special_tokens=False)[0]
    lines = recorded.tape.read_bytes().splitlines()
    for number, line in enumerate(lines):
        record = orjson.loads(line)
        if record.get("kind") == "sample" and record["sample_id"] == "1.0":
            record["result"]["tokens"]["add"][-2] = replacement
            lines[number] = orjson.dumps(record)
    recorded.tape.write_bytes(b"\n".join(lines) + b"\n")
    report = await asyncio.to_thread(replay, recorded.trace, tokenizer=recorded.tokenizer)
    replay_json = tmp_path / "replay.json"
    replay_json.write_bytes(orjson.dumps(report.to_dict()))
    return await asyncio.to_thread(build, recorded, replay=replay_json)


async def test_a_replay_divergence_is_on_the_sample_page(recorded: Recorded, tmp_path: Path) -> None:
    data = await diverged_report(recorded, tmp_path)
    verdicts = [row[8] for row in data.index["rows"]]
    assert verdicts == ["identical", "identical", "identical", "diverged", "identical"]
    divergence = data.details[3]["replay"]["divergence"]
    assert divergence["kind"] == "tokens" and divergence["context"]["expected"].startswith(" banana")


# ---------------------------------------------------------------------------------------------------- the browser


async def open_report(browser: Chromium, page: Path) -> None:
    await browser.open(page.as_uri())
    await browser.wait_for("document.body.dataset.ready")


@needs_chromium
async def test_the_page_loads_with_no_error_and_no_request(recorded: Recorded, tmp_path: Path) -> None:
    page = write_report(await asyncio.to_thread(build, recorded), tmp_path / "report.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        assert await browser.evaluate("document.querySelectorAll('#rows .vrow').length") == 5
        await browser.evaluate("location.hash = '#s0'")
        await browser.wait_for("document.getElementById('tokens')")
        assert browser.console_errors() == []
        assert browser.requests() and all(
            url == page.as_uri() or url.startswith("data:image/") for url in browser.requests()
        ), browser.requests()


@needs_chromium
async def test_clicking_a_sample_shows_its_token_strip_with_masked_tokens_marked(
    recorded: Recorded, tmp_path: Path
) -> None:
    page = write_report(await asyncio.to_thread(build, recorded), tmp_path / "report.html")
    sample = recorded.samples[0]
    async with Chromium() as browser:
        await open_report(browser, page)
        await browser.evaluate("document.querySelector('#rows .vrow[data-sample=\"0.0\"]').click()")
        await browser.wait_for("document.getElementById('tokens')")
        counts = await browser.evaluate(
            "[...['.tok.trained', '.tok.masked', '.tok.eos'].map((s) => document.querySelectorAll(s).length)]"
        )
        assert counts == [sum(sample.loss_mask), sample.loss_mask.count(0), 1]
        hovered = await browser.evaluate(
            "(() => { const el = document.querySelector('.tok.eos');"
            " el.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));"
            " return document.querySelector('.tokinfo').textContent; })()"
        )
        eos_id = recorded.tokenizer.convert_tokens_to_ids(EOS)
        assert f"id {eos_id}" in hovered and '"<|im_end|>"' in hovered and "masked" in hovered
        assert "inserted EOS" in hovered
        prompt_length = len(sample.tokens) - sample.response_length
        note = await browser.evaluate("document.querySelector('#tokens .strip .note').textContent")
        assert note == f"[{prompt_length} prompt tokens hidden] "
        shown = (
            "(() => { const c = document.querySelector('#tokens input[type=checkbox]'); c.checked = true;"
            " c.dispatchEvent(new Event('change')); return document.querySelectorAll('.tok.prompt').length; })()"
        )
        assert await browser.evaluate(shown) == prompt_length


@needs_chromium
async def test_the_filter_shows_only_matching_samples(recorded: Recorded, tmp_path: Path) -> None:
    page = write_report(await asyncio.to_thread(build, recorded), tmp_path / "report.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        shown = (
            "(() => { const s = document.querySelector('select[data-filter=reason]'); s.value = 'env_done';"
            " s.dispatchEvent(new Event('change')); return [...document.querySelectorAll('#rows .vrow')]"
            ".map((r) => r.dataset.sample); })()"
        )
        assert await browser.evaluate(shown) == ["0.0", "1.0", "1.1"]
        by_reward = (
            "(() => { const i = document.querySelector('input[data-filter=rmin]'); i.value = '0.5';"
            " i.dispatchEvent(new Event('input')); return [...document.querySelectorAll('#rows .vrow')]"
            ".map((r) => r.dataset.sample); })()"
        )
        assert await browser.evaluate(by_reward) == ["0.0", "1.0", "1.1"]
        assert "3 of 5" in await browser.evaluate("document.querySelector('.count').textContent")
        by_reward = (
            "(() => { const i = document.querySelector('input[data-filter=rmin]'); i.value = '';"
            " i.dispatchEvent(new Event('input'));"
            " const s = document.querySelector('select[data-filter=reason]'); s.value = '';"
            " s.dispatchEvent(new Event('change'));"
            " document.querySelectorAll('.vhead span')[5].click();"
            " return [...document.querySelectorAll('#rows .vrow')].map((r) => r.dataset.sample); })()"
        )
        assert await browser.evaluate(by_reward) == ["0.1", "0.2", "1.0", "1.1", "0.0"]  # ties keep the run order


@needs_chromium
async def test_injected_markup_stays_text_and_runs_nothing(recorded: Recorded, tmp_path: Path) -> None:
    page = write_report(await asyncio.to_thread(build, recorded), tmp_path / "report.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        await browser.evaluate("location.hash = '#s0'")
        await browser.wait_for("document.getElementById('tokens')")
        assert await browser.evaluate("typeof window.__pwned") == "undefined"
        text = await browser.evaluate("document.getElementById('sample').textContent")
        assert INJECTED_PROMPT in text and INJECTED_OBSERVATION in text and "window.__pwned = 'tool'" in text
        assert await browser.evaluate("document.querySelectorAll('#sample script, #sample img[onerror]').length") == 0
        assert browser.console_errors() == []


@needs_chromium
async def test_ten_thousand_samples_open_with_a_bounded_page(tmp_path: Path) -> None:
    """The table draws only the rows in view and no sample's data is parsed until it is opened."""
    trace, results = await asyncio.to_thread(write_synthetic_run, tmp_path / "big", 10_000, turn_tokens=20)
    data = await asyncio.to_thread(build_report, trace, results=results)
    page = write_report(data, tmp_path / "big.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        rows = await browser.evaluate("document.querySelectorAll('#rows .vrow').length")
        assert 0 < rows < 100
        assert "10000 of 10000" in await browser.evaluate("document.querySelector('.count').textContent")
        options = await browser.evaluate("[...document.querySelectorAll('select[data-filter=group] option')]"
                                         ".slice(1, 4).map((o) => o.value)")  # fmt: skip
        assert options == ["0", "1", "2"]
        # 2,500 groups: only the zero-variance ones are drawn, up to a limit, so the table stays near the top
        assert 0 < await browser.evaluate("document.querySelectorAll('.group').length") <= 60
        assert await browser.evaluate("document.querySelectorAll('.group:not(.zero)').length") == 0
        await browser.evaluate("const v = document.getElementById('rows'); v.scrollTop = v.scrollHeight")
        last = await browser.wait_for(
            "[...document.querySelectorAll('#rows .vrow')].map((r) => r.dataset.sample).includes('2499.3') && 'yes'"
        )
        assert last == "yes"
        # back to the top, then sorted by group, descending: groups in number order, 2499 first (not "999")
        await browser.evaluate("document.getElementById('rows').scrollTop = 0")
        sort_by_group = "document.querySelectorAll('.vhead span')[1].click()"
        await browser.evaluate(sort_by_group)
        await browser.evaluate(sort_by_group)
        first = await browser.wait_for(
            "(document.querySelector('#rows .vrow') || {dataset: {}}).dataset.sample === '2499.0' && 'yes'"
        )
        assert first == "yes"
        assert browser.console_errors() == []


@needs_chromium
async def test_the_replay_divergence_shows_both_sides_and_marks_the_token(recorded: Recorded, tmp_path: Path) -> None:
    data = await diverged_report(recorded, tmp_path)
    page = write_report(data, tmp_path / "report.html")
    index = data.details[3]["replay"]["divergence"]["index"]
    async with Chromium() as browser:
        await open_report(browser, page)
        await browser.evaluate("location.hash = '#s3'")
        await browser.wait_for("document.getElementById('tokens')")
        box = await browser.evaluate("document.querySelector('.diverge').textContent")
        assert "first divergence: tokens" in box and "banana" in box
        marked = await browser.evaluate(
            "(() => { const m = [...document.querySelectorAll('.mark.div')]; return m.length === 1 &&"
            " Number(m[0].nextElementSibling.dataset.k); })()"
        )
        assert marked == index
        assert browser.console_errors() == []


@needs_chromium
async def test_an_error_today_is_shown_once_with_what_the_recording_did_and_what_followed(
    recorded: Recorded, tmp_path: Path
) -> None:
    """One generated token of sample 1.0 changed on the tape, not its logprob: today's run raises where it parses
    that answer, and the page says so, once, with the recording's outcome and what followed."""
    lines = recorded.tape.read_bytes().splitlines()
    for number, line in enumerate(lines):
        record = orjson.loads(line)
        if record.get("kind") == "sample" and record["sample_id"] == "1.0":
            generate = next(entry for entry in record["io"] if entry["op"] == "generate")
            generate["answer"]["choices"][0]["token_ids"][0] += 1
            lines[number] = orjson.dumps(record)
    recorded.tape.write_bytes(b"\n".join(lines) + b"\n")
    report = await asyncio.to_thread(replay, recorded.trace, tokenizer=recorded.tokenizer)
    replay_json = tmp_path / "replay.json"
    replay_json.write_bytes(orjson.dumps(report.to_dict()))
    data = await asyncio.to_thread(build, recorded, replay=replay_json)
    divergence = data.details[3]["replay"]["divergence"]
    assert divergence["kind"] == "error" and divergence["actual"]["type"] == "GenerationError"
    page = write_report(data, tmp_path / "report.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        await browser.evaluate("location.hash = '#s3'")
        await browser.wait_for("document.querySelector('.diverge')")
        box = await browser.evaluate("[...document.querySelectorAll('.diverge p')].map((p) => p.textContent)")
        assert box[0] == "first divergence: error at turn 0, state generating"
        assert box[1].startswith("today's run raised GenerationError: ")
        assert box[1].endswith("(in state generating, on step)")
        assert box[2] == "the recording did not fail: it ended completed/env_done"
        assert box[3].startswith("what followed: today's rollout calls env.close()")
        assert sum(text.count(divergence["actual"]["message"]) for text in box) == 1
        assert browser.console_errors() == []


# ---------------------------------------------------------------------------------------------------- the strip


def test_a_forked_rollouts_branches_are_sequences_of_the_strip_with_their_boundaries() -> None:
    from fsm_rollout.report.detail import strip_from_results

    branch = {"tokens": [1, 2, 3, 4], "response_length": 2, "loss_mask": [1, 1], "rollout_log_probs": [-0.5, -0.25],
              "metadata": {"weight_version_spans": [{"version": "1", "start": 0, "end": 2}]}}  # fmt: skip
    row = {"tokens": [1, 2, 5, 6, 7], "response_length": 3, "loss_mask": [0, 1, 1],
           "rollout_log_probs": [0.0, -1.0, -2.0], "branches": [branch],
           "metadata": {"weight_version_spans": [{"version": "2", "start": 1, "end": 3}]}}  # fmt: skip
    strip = strip_from_results(row, None)
    assert strip is not None
    assert strip["ids"] == [1, 2, 3, 4, 1, 2, 5, 6, 7]
    assert strip["sequences"] == [[0, 4, "branch 0"], [4, 9, "final sequence"]]
    assert strip["prompts"] == [[0, 2], [4, 6]]
    assert expand(strip["mask"]) == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert strip["logprobs"] == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert strip["versions"] == [[2, 4, "1"], [7, 9, "2"]]


def test_image_spans_run_from_vision_start_to_vision_end() -> None:
    from fsm_rollout.report.detail import image_spans

    texts = {"1": "a", "2": "<|vision_start|>", "3": "<|image_pad|>", "4": "<|vision_end|>"}
    assert image_spans([1, 2, 3, 3, 4, 1, 2, 3, 4], texts) == [[1, 5], [6, 9]]


# ---------------------------------------------------------------------------------------------- training views


def trainer_logprobs(recorded: Recorded, path: Path, shift: float) -> list[Sample]:
    """A trainer logprobs file for the results' training sequences: the rollout's logprobs, those of the first
    sequence's trained tokens moved by ``shift``; step 3 on the first group's lines, 4 on the others."""
    from fsm_rollout import training_sequences

    rows = [Sample.from_dict(orjson.loads(line)) for line in recorded.results.read_bytes().splitlines()]
    sequences = training_sequences(rows)
    lines = []
    for number, sequence in enumerate(sequences):
        values = list(sequence.rollout_log_probs or [0.0] * sequence.response_length)
        if number == 0:
            values = [v + shift if bit else v for v, bit in zip(values, sequence.loss_mask or [], strict=True)]
        lines.append(orjson.dumps({"logprobs": values, "step": 3 if sequence.group_index == 0 else 4}))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return sequences


async def test_the_page_holds_each_group_s_token_tree(recorded: Recorded) -> None:
    trees = (await asyncio.to_thread(build, recorded)).index["trees"]
    assert [tree["name"] for tree in trees] == ["group 0", "group 1"]
    colours = trees[1]  # two samples of one prompt: the prompt's node is shared by both
    assert colours["stats"]["tree_tokens"] < colours["stats"]["flat_tokens"]
    shared = [node for node in colours["nodes"] if node[5] == 2]
    assert shared and shared[0][1] == -1 and shared[0][4] == 0  # a root, nothing generated in it
    assert sum(node[4] for node in colours["nodes"]) == colours["stats"]["generated_tokens"] > 0
    assert [leaf[4] for leaf in colours["leaves"]] == ["completed", "completed"]


async def test_the_mismatch_section_lists_the_shifted_sequence_first(recorded: Recorded, tmp_path: Path) -> None:
    import math

    sequences = trainer_logprobs(recorded, tmp_path / "trainer.jsonl", 0.5)
    data = await asyncio.to_thread(build, recorded, mismatch=tmp_path / "trainer.jsonl")
    section = data.index["mismatch"]
    k3 = math.exp(-0.5) - 1 + 0.5
    worst = section["worst"][0]
    assert (worst["sequence"], worst["row"]) == (0, 0)
    assert worst["k3"] == pytest.approx(k3) and worst["max_abs_delta"] == pytest.approx(0.5)
    assert all(other["k3"] == 0.0 for other in section["worst"][1:])
    steps = {step: (value, count) for step, value, count in section["steps"]}
    assert steps["4"] == (0.0, sum(sum(s.loss_mask or []) for s in sequences if s.group_index == 1))
    assert steps["3"][0] == pytest.approx(k3 * sum(sequences[0].loss_mask or []) / steps["3"][1])
    assert {group["dimension"] for group in section["events"]} >= {"version", "resume", "sequence", "engine"}
    [strip] = data.details[0]["mismatch"]  # sample 0.0 is results row 0
    mask = sequences[0].loss_mask or []
    assert strip["prompt"] == len(sequences[0].tokens) - sequences[0].response_length
    assert strip["delta"] == [pytest.approx(0.5) if bit else -1 for bit in mask]
    assert data.details[3]["mismatch"][0]["delta"] == [0.0 if bit else -1 for bit in sequences[3].loss_mask or []]


async def test_the_command_refuses_a_mismatch_file_that_does_not_fit(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short = tmp_path / "short.jsonl"
    short.write_text("[-1.0]\n")
    args = ["report", str(recorded.trace), "--results", str(recorded.results), "--mismatch", str(short)]
    assert await asyncio.to_thread(cli_main, args) == 2
    assert "does not fit the results file" in capsys.readouterr().err
    trainer_logprobs(recorded, tmp_path / "trainer.jsonl", 0.5)
    alone = ["report", str(recorded.trace), "--mismatch", str(tmp_path / "trainer.jsonl")]
    assert await asyncio.to_thread(cli_main, alone) == 2
    assert "needs the results file" in capsys.readouterr().err
    output = tmp_path / "page.html"
    good = [*args[:-1], str(tmp_path / "trainer.jsonl"), "-o", str(output)]
    assert await asyncio.to_thread(cli_main, good) == 0


@needs_chromium
async def test_the_trees_the_mismatch_and_the_coloured_strip_are_drawn(recorded: Recorded, tmp_path: Path) -> None:
    trainer_logprobs(recorded, tmp_path / "trainer.jsonl", 0.5)
    data = await asyncio.to_thread(build, recorded, mismatch=tmp_path / "trainer.jsonl")
    page = write_report(data, tmp_path / "report.html")
    async with Chromium() as browser:
        await open_report(browser, page)
        assert await browser.evaluate("document.querySelectorAll('#trees details.tree').length") == 2
        assert await browser.evaluate("document.querySelectorAll('#mismatch table').length") == 3
        await browser.evaluate("document.querySelector('#mismatch a[href=\"#s0\"]').click()")
        await browser.wait_for("document.getElementById('tokens')")
        tinted = await browser.evaluate(
            "[...document.querySelectorAll('.tok.trained')].filter((e) => e.style.background).length"
        )
        assert tinted == sum(recorded.samples[0].loss_mask or [])
        hovered = await browser.evaluate(
            "(() => { const el = document.querySelector('.tok.trained');"
            " el.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));"
            " return document.querySelector('.tokinfo').textContent; })()"
        )
        assert "|\u0394logprob| 0.5" in hovered
        assert browser.console_errors() == []
