"""Record a batch against the fake vLLM server, then check and re-execute it offline with ``replay``."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_rollout import Rollout, Sample
from fsm_rollout.cli import main as cli_main
from fsm_rollout.machine import lifecycle
from fsm_rollout.recording import (
    RecordingFormatError,
    SchemaVersionError,
    TapeWriter,
    read_tape,
    recorded_rollout,
    tape_path_for,
)
from fsm_rollout.replay import ReplayReport, replay
from fsm_rollout.rollout import activities as activities_module
from fsm_rollout.rollout import steps as rollout_module
from fsm_rollout.runtime import gc_policy
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir
from fsm_rollout.trace import Tracer

pytestmark = pytest.mark.own_process  # its embedded engines and tokenizers are a lasting step up in the suite's process

EOS = "<|im_end|>"
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
STOP = {**SAMPLING, "stop": ["</answer>"], "no_stop_trim": True}


def png_data_url(seed: int) -> str:
    """A PNG that does not compress well, so its data URL is long enough to be stored as a blob."""
    from PIL import Image

    pixels = bytes((index * 7 + seed * 13 + (index // 97) ** 2) % 256 for index in range(48 * 48 * 3))
    buffer = io.BytesIO()
    Image.frombytes("RGB", (48, 48), pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class AbortingEnv:
    """Asks its rollout to abort from inside ``step`` (as an environment that hits a deadline would)."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    def reset(self) -> None:
        pass

    def step(self, text: str) -> tuple[str, bool, dict[str, Any]]:
        self.rollout.request_abort("env_deadline")
        return "late", False, {}

    def format_observation(self, observation: str) -> dict[str, str]:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        pass


@dataclass
class AbortingEnvFactory:
    """Builds :class:`AbortingEnv` for the rollout it is told about."""

    rollout: Rollout | None = None

    def __call__(self, **_: Any) -> AbortingEnv:
        assert self.rollout is not None
        return AbortingEnv(self.rollout)


@dataclass
class Case:
    """One recorded sample: its script, settings, what it must end as, and how it is driven."""

    index: int
    turns: list[ScriptedTurn]
    status: str
    reason: str
    sampling: dict[str, Any] = field(default_factory=lambda: dict(SAMPLING))
    config: dict[str, Any] = field(default_factory=dict)
    envs: Any = None
    prompt: Any = "What is 6 * 7?"
    images: list[str] | None = None
    session: bool = True
    interrupt: str | None = None
    """``abort`` (a caller's abort) or ``cancel`` (the task is cancelled) at the last scripted generate, or
    ``before start`` (aborted before it runs)."""


def cases(tokenizer: Any) -> list[Case]:
    stop_text = "x </answer>"
    stop_tokens = len(tokenizer.encode(stop_text, add_special_tokens=False))
    think = f"thinking{EOS}"
    think_tokens = len(tokenizer.encode(think, add_special_tokens=False))
    return [
        Case(
            0,
            [ScriptedTurn(text="Let me think."), ScriptedTurn(text=f"42{EOS}")],
            "completed",
            "env_done",
            envs=ScriptedEnvFactory(steps=[("Continue.", False), ("correct", True)]),
        ),
        Case(1, [], "truncated", "budget_exhausted", sampling={**SAMPLING, "max_new_tokens": 0}),
        Case(
            2,
            [ScriptedTurn(text="a"), ScriptedTurn(text="one two three four five six seven eight nine")],
            "truncated",
            "length",
            sampling={**SAMPLING, "max_new_tokens": 20},
        ),
        Case(3, [ScriptedTurn(text="a"), ScriptedTurn(text="b")], "truncated", "max_turns", config={"max_turns": 2}),
        Case(
            4,
            [ScriptedTurn(text=stop_text)],
            "truncated",
            "insufficient_budget_for_stop_eos",
            sampling={**STOP, "max_new_tokens": stop_tokens},
        ),
        Case(
            5,
            [ScriptedTurn(text=think)],
            "truncated",
            "insufficient_budget_for_next_turn",
            sampling={**SAMPLING, "max_new_tokens": think_tokens + 3},
        ),
        Case(6, [ScriptedTurn(text="first"), ScriptedTurn(text="partial", finish="abort")], "aborted", "server_abort"),
        Case(
            7,
            [ScriptedTurn(text="a"), ScriptedTurn(text="never", hang=True)],
            "aborted",
            "weight_update",
            interrupt="abort",
        ),
        Case(8, [ScriptedTurn(text="first"), ScriptedTurn(status=400)], "failed", "error"),
        Case(
            9,
            [ScriptedTurn(text="thinking"), ScriptedTurn(text="x = 1 </answer> tail"), ScriptedTurn(text="ok")],
            "truncated",
            "max_turns",
            sampling=dict(STOP),
        ),
        Case(
            10,
            [ScriptedTurn(text="a")],
            "failed",
            "error",
            envs=ScriptedEnvFactory(raise_in={"step": ValueError("the checker crashed")}),
        ),
        Case(11, [ScriptedTurn(text="never", hang=True)], "aborted", "cancelled", interrupt="cancel"),
        Case(
            12,
            [
                ScriptedTurn(
                    raw={
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "token_ids": [9707, 11],
                                "logprobs": {"content": [{"token_id": 9707, "logprob": -0.5}]},
                            }
                        ]
                    }
                )
            ],
            "failed",
            "error",
        ),
        Case(13, [ScriptedTurn(text="a")], "aborted", "env_deadline", envs=AbortingEnvFactory()),
        Case(
            14,
            [ScriptedTurn(text="a"), ScriptedTurn(text="b")],
            "truncated",
            "max_turns",
            config={"max_turns": 2},
            session=False,
        ),
        Case(15, [], "failed", "error", images=[png_data_url(1)]),
        Case(16, [], "failed", "error", images=[png_data_url(1)], prompt="<image> Same image again."),
        Case(17, [], "aborted", "shutdown", interrupt="before start"),
    ]


@dataclass
class Recording:
    trace: Path
    tape: Path
    samples: dict[int, Sample]
    tokenizer: Any

    def replay(self, **kwargs: Any) -> ReplayReport:
        return replay(self.trace, tokenizer=self.tokenizer, **kwargs)


async def wait_for_generates(server: FakeVLLMServer, session: str, count: int) -> None:
    for _ in range(24000):  # up to 120 s: a loaded machine can be slow to get there
        arrived = [r for r in server.requests_to(GENERATE_PATH) if r.headers.get("x-session-id") == session]
        if len(arrived) >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"session {session}: generate #{count} never arrived")


async def record(
    tmp_path: Path,
    server: FakeVLLMServer,
    client: Any,
    tokenizer: Any,
    make_config: Callable[..., Any],
    batch: list[Case],
) -> Recording:
    trace = tmp_path / "run.jsonl"
    tracer = Tracer(trace.open("ab"), owns_stream=True)
    writer = TapeWriter(tape_path_for(trace))
    samples: dict[int, Sample] = {}

    def build(case: Case) -> Rollout:
        session = f"s{case.index}" if case.session else None
        if session is not None:
            server.script(case.turns, session=session)
        else:
            server.script(case.turns)
        sample = Sample(
            prompt=case.prompt,
            index=case.index,
            session_id=session,
            multimodal_inputs={"images": case.images} if case.images else None,
        )
        config = make_config(**({"router_policy": "consistent_hash"} if session else {}), **case.config)
        rollout = recorded_rollout(
            sample,
            config=config,
            sampling_params=case.sampling,
            client=client,
            tokenizer=tokenizer,
            env_factory=case.envs or ScriptedEnvFactory(),
            tracer=tracer,
            tape=writer,
        )
        samples[case.index] = sample
        if isinstance(case.envs, AbortingEnvFactory):
            case.envs.rollout = rollout
        return rollout

    async def drive(case: Case, rollout: Rollout) -> None:
        if case.interrupt == "before start":
            await rollout.abort("shutdown")
        task = asyncio.ensure_future(rollout.run())
        if case.interrupt in ("abort", "cancel"):
            await wait_for_generates(server, f"s{case.index}", len(case.turns))
            if case.interrupt == "abort":
                await rollout.abort("weight_update")
            else:
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    concurrent = [case for case in batch if case.session]
    await asyncio.gather(*(drive(case, build(case)) for case in concurrent))
    for case in batch:
        if not case.session:
            await drive(case, build(case))
    writer.close()
    tracer.close()
    for case in batch:
        sample = samples[case.index]
        assert (sample.status.value, sample.metadata["rollout_reason"]) == (case.status, case.reason), case.index
    return Recording(trace, tape_path_for(trace), samples, tokenizer)


@pytest.fixture
async def recording(
    tmp_path: Path, fake_vllm: FakeVLLMServer, client: Any, tokenizer: Any, make_config: Callable[..., Any]
) -> Recording:
    return await record(tmp_path, fake_vllm, client, tokenizer, make_config, cases(tokenizer))


def run_replay_in_thread(recording: Recording, **kwargs: Any) -> Awaitable[ReplayReport]:
    return asyncio.to_thread(recording.replay, **kwargs)


# --------------------------------------------------------------------------- recording


async def test_the_batch_covers_every_terminal_reason(recording: Recording) -> None:
    reasons = {sample.metadata["rollout_reason"] for sample in recording.samples.values()}
    assert {
        "env_done",
        "budget_exhausted",
        "length",
        "max_turns",
        "insufficient_budget_for_stop_eos",
        "insufficient_budget_for_next_turn",
        "server_abort",
        "weight_update",
        "cancelled",
        "shutdown",
        "env_deadline",
        "error",
    } <= reasons


async def test_every_recorded_sample_replays_identically(recording: Recording) -> None:
    report = await run_replay_in_thread(recording)
    assert report.exit_code == 0, report.render(verbose=True)
    assert report.counts() == {"identical": len(recording.samples)}
    early = report.sample("17")  # aborted before it started: traced with its sample_id all the same
    assert early.tape_line is not None and early.trace_lines is not None
    assert report.executed
    assert report.turns_executed > 10


async def test_an_image_is_stored_once_however_often_it_is_sent(recording: Recording) -> None:
    lines = [orjson.loads(line) for line in recording.tape.read_bytes().splitlines()]
    blobs = [line for line in lines if line["kind"] == "blob" and line["data"].startswith("data:image/png")]
    assert len(blobs) == 1
    assert b"data:image/png" not in b"".join(
        line for line in recording.tape.read_bytes().splitlines() if b'"kind":"sample"' in line
    )


async def test_the_tape_sits_beside_the_trace_and_names_its_schema(recording: Recording) -> None:
    tape = read_tape(recording.tape)
    assert recording.tape.name == "run.tape.jsonl"
    assert len(tape.samples) == len(recording.samples)
    assert tape.problems == []
    first = orjson.loads(recording.tape.read_bytes().splitlines()[0])
    assert first["kind"] == "header"
    assert first["schema"] == 3  # schema 3: a step is recorded as its typed StepResult


# --------------------------------------------------------------------------- divergences


async def test_a_changed_eos_rule_is_reported_at_the_sample_and_turn_where_it_matters(
    recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(activities_module, "stop_string_eos_due", lambda *args, **kwargs: False)
    report = await run_replay_in_thread(recording)
    assert report.exit_code == 1
    diverged = {sample.sample_id: sample for sample in report.samples if sample.verdict == "diverged"}
    assert set(diverged) == {"4", "9"}
    divergence = diverged["9"].divergence
    assert divergence is not None
    assert divergence.kind == "transition"
    assert (divergence.turn, divergence.state) == (1, "generating")
    assert "eos_inserted True → False" in divergence.message
    assert divergence.line is not None
    traced = orjson.loads(recording.trace.read_bytes().splitlines()[divergence.line - 1])
    assert (traced["sample_id"], traced["trigger"], traced["turn"]) == ("9", "step", 1)
    assert diverged["4"].divergence is not None and diverged["4"].divergence.turn == 0


async def test_a_changed_guard_is_reported_at_the_last_turn(
    recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    guards = {**rollout_module.GUARDS, "turn_limit_reached": lambda rollout: False}
    monkeypatch.setattr(rollout_module, "MACHINE", lifecycle.build_machine(guards, rollout_module.ACTIONS))
    report = await run_replay_in_thread(recording, sample_ids=["3"])
    sample = report.sample("3")
    assert sample.verdict == "diverged"
    assert sample.divergence is not None
    assert (sample.divergence.turn, sample.divergence.state) == (1, "stepping")
    assert "recorded stepping --observe--> truncated, today stepping --observe--> observing" in (
        sample.divergence.message
    )


def tamper(tape: Path, sample_id: str, edit: Callable[[dict[str, Any]], None]) -> None:
    lines = tape.read_bytes().splitlines()
    for number, line in enumerate(lines):
        record = orjson.loads(line)
        if record.get("kind") == "sample" and record["sample_id"] == sample_id:
            edit(record)
            lines[number] = orjson.dumps(record)
    tape.write_bytes(b"\n".join(lines) + b"\n")


async def test_a_tampered_generated_token_is_reported_at_its_turn(recording: Recording, tokenizer: Any) -> None:
    replacement = tokenizer.encode(" banana", add_special_tokens=False)[0]

    def edit(record: dict[str, Any]) -> None:
        generates = [entry for entry in record["io"] if entry["op"] == "generate"]
        choice = generates[1]["answer"]["choices"][0]
        choice["token_ids"][0] = replacement
        choice["logprobs"]["content"][0]["token_id"] = replacement

    tamper(recording.tape, "0", edit)
    report = await run_replay_in_thread(recording)
    sample = report.sample("0")
    assert sample.verdict == "diverged"
    assert sample.divergence is not None
    assert sample.divergence.turn == 1
    assert sample.divergence.kind == "request"
    assert "env.step gets different text" in sample.divergence.message
    assert sample.divergence.context is not None
    assert sample.divergence.context.actual.startswith(" banana")
    assert [other.verdict for other in report.samples if other.sample_id != "0"] == ["identical"] * 17


async def test_an_error_todays_rollout_raises_is_reported_first_with_the_recorded_turns(
    recording: Recording, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A generated token changed and its logprob entry left as it was: today's client refuses the answer, and the
    rollout fails and closes its environment where the recording stepped it. The refusal is what is reported."""
    replacement = tokenizer.encode(" banana", add_special_tokens=False)[0]

    def edit(record: dict[str, Any]) -> None:
        generates = [entry for entry in record["io"] if entry["op"] == "generate"]
        generates[1]["answer"]["choices"][0]["token_ids"][0] = replacement

    tamper(recording.tape, "0", edit)
    report = await run_replay_in_thread(recording)
    sample = report.sample("0")
    assert (sample.verdict, sample.turns, sample.turns_replayed) == ("diverged", 2, 1)
    divergence = sample.divergence
    assert divergence is not None and divergence.kind == "error" and divergence.turn == 1
    assert divergence.expected is None  # the recorded sample did not fail
    error = divergence.actual
    assert isinstance(error, dict) and error["type"] and str(replacement) in error["message"], error
    assert divergence.message.startswith(f"today's rollout failed in state {error['state']}")
    assert f"{error['type']}: {error['message']}" in divergence.message
    assert "the recording did not fail: it ended completed/env_done" in divergence.message
    assert (
        "after it, today's rollout calls env.close(), but the recording's next call is env.step()" in divergence.message
    )
    as_json = next(item for item in report.to_dict()["samples"] if item["sample_id"] == "0")
    assert as_json["divergence"]["actual"] == error and as_json["turns"] == 2

    assert (
        await asyncio.to_thread(
            cli, "replay", str(recording.trace), "--tokenizer", str(qwen_tokenizer_dir()), "--sample", "0"
        )
        == 1
    )
    text = capsys.readouterr().out
    assert "sample 0 [completed/env_done, 2 turn(s), 1 replayed] DIVERGED" in text
    assert f"    error at turn 1, state {divergence.state}: today's rollout failed" in text
    assert error["type"] in text


async def test_a_tampered_result_token_is_reported_with_its_index_and_text(
    recording: Recording, tokenizer: Any
) -> None:
    replacement = tokenizer.encode(" banana", add_special_tokens=False)[0]

    def edit(record: dict[str, Any]) -> None:
        record["result"]["tokens"]["add"][-1] = replacement

    tamper(recording.tape, "3", edit)
    report = await run_replay_in_thread(recording, sample_ids=["3"])
    divergence = report.sample("3").divergence
    assert divergence is not None
    assert divergence.kind == "tokens"
    assert divergence.turn == 1
    final = recording.samples[3].tokens
    assert divergence.index == len(final) - 1
    assert "' banana'" in divergence.message
    assert divergence.context is not None and divergence.context.expected == " banana"


async def test_another_error_of_a_failed_sample_is_a_divergence(recording: Recording) -> None:
    def edit(record: dict[str, Any]) -> None:
        assert record["result"]["error"]["message"] == "the checker crashed"
        record["result"]["error"]["message"] = "the checker crashed differently"

    tamper(recording.tape, "10", edit)
    report = await run_replay_in_thread(recording, sample_ids=["10"])
    divergence = report.sample("10").divergence
    assert divergence is not None and divergence.kind == "error"
    assert (divergence.expected["message"], divergence.actual["message"]) == (
        "the checker crashed differently",
        "the checker crashed",
    )


async def test_a_request_the_tape_does_not_have_is_a_divergence_not_a_crash(
    recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    guards = {**rollout_module.GUARDS, "turn_limit_reached": lambda rollout: False}
    monkeypatch.setattr(rollout_module, "MACHINE", lifecycle.build_machine(guards, rollout_module.ACTIONS))
    report = await run_replay_in_thread(recording, sample_ids=["9"])
    sample = report.sample("9")
    assert sample.verdict == "diverged"
    assert sample.divergence is not None
    assert sample.divergence.kind == "transition"


async def test_missing_answer_is_reported_when_the_tape_ends_early(recording: Recording) -> None:
    def edit(record: dict[str, Any]) -> None:
        record["io"] = [entry for entry in record["io"] if entry["op"] not in ("close",)][:-1]

    tamper(recording.tape, "3", edit)
    report = await run_replay_in_thread(recording, sample_ids=["3"])
    divergence = report.sample("3").divergence
    assert divergence is not None
    assert divergence.kind == "missing answer"
    assert "the recording has no more calls" in divergence.message


# --------------------------------------------------------------------------- damaged input


def cut_last_line(trace: Path) -> bytes:
    """Keep only the first 30 bytes of the last line (before its sample_id), as a crash while writing would."""
    data = trace.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    trace.write_bytes(data[: start + 30])
    return data


async def test_a_trace_cut_off_mid_line_is_reported_and_the_rest_replays(recording: Recording) -> None:
    data = cut_last_line(recording.trace)
    report = await run_replay_in_thread(recording)
    last_line = data.count(b"\n")
    assert [problem.line for problem in report.problems] == [last_line]
    assert "cut off mid-line" in report.problems[0].message
    assert report.exit_code == 1
    assert report.counts() == {"identical": len(recording.samples)}
    cut = report.sample("14")  # the last sample to finish: its final event is the cut line
    assert any("the trace is unfinished here; the tape's copy of the path was used" in note for note in cut.notes)


async def test_a_cut_off_trace_without_its_tape_reports_the_unfinished_sample(recording: Recording) -> None:
    cut_last_line(recording.trace)
    recording.tape.unlink()
    report = await run_replay_in_thread(recording)
    assert report.exit_code == 1
    assert report.sample("14").verdict == "unfinished"
    assert report.sample("14").findings[-1].startswith("unfinished: the last transition (line")


async def test_a_corrupted_line_damages_only_its_sample(recording: Recording) -> None:
    lines = recording.trace.read_bytes().splitlines()
    victim = next(number for number, line in enumerate(lines) if b'"sample_id":"0"' in line and b'"step"' in line)
    lines[victim] = lines[victim][:30] + b"\x00garbage" + lines[victim][30:]
    recording.trace.write_bytes(b"\n".join(lines) + b"\n")
    report = await run_replay_in_thread(recording)
    assert [problem.line for problem in report.problems] == [victim + 1]
    assert report.exit_code == 1
    assert report.sample("0").verdict == "identical"  # the tape holds the whole sample
    assert any(f"line {victim + 1}" in note for note in report.sample("0").notes)
    assert [s.verdict for s in report.samples if s.sample_id != "0"] == ["identical"] * 17
    recording.tape.unlink()
    report = await run_replay_in_thread(recording)
    assert report.sample("0").verdict == "damaged"
    assert any(f"line {victim + 1}" in finding for finding in report.sample("0").findings)


async def test_a_trace_of_another_schema_version_is_a_clear_error(recording: Recording) -> None:
    lines = recording.trace.read_bytes().splitlines()
    event = orjson.loads(lines[0])
    event["schema"] = 2
    lines[0] = orjson.dumps(event)
    recording.trace.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(SchemaVersionError, match="transition schema 2, but this fsm-rollout reads trace schema 1"):
        await run_replay_in_thread(recording)


async def test_a_tape_of_another_schema_version_is_a_clear_error(recording: Recording) -> None:
    lines = recording.tape.read_bytes().splitlines()
    lines[0] = lines[0].replace(b'"schema":3', b'"schema":7')
    recording.tape.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(SchemaVersionError, match="tape schema 7"):
        await run_replay_in_thread(recording)


async def test_a_tape_from_before_a_config_rename_replays_and_names_only_unknown_fields(
    recording: Recording,
) -> None:
    tape = recording.tape.read_bytes()
    assert tape.count(b'"tune_gc":false') == len(recording.samples)
    recording.tape.write_bytes(tape.replace(b'"tune_gc":false', b'"defer_full_gc":false,"from_the_future":1'))
    report = await run_replay_in_thread(recording)
    assert report.counts() == {"identical": len(recording.samples)}, report.render(verbose=True)
    for sample in report.samples:
        assert "config fields unknown today were ignored: from_the_future" in sample.notes


async def test_a_tape_whose_results_keep_no_error_replays(recording: Recording) -> None:
    lines = [orjson.loads(line) for line in recording.tape.read_bytes().splitlines()]
    for line in lines:
        if line["kind"] == "sample":
            del line["result"]["error"]
    recording.tape.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    report = await run_replay_in_thread(recording)
    assert report.counts() == {"identical": len(recording.samples)}, report.render(verbose=True)


async def test_replay_leaves_what_the_process_froze_frozen(recording: Recording) -> None:
    gc.freeze()  # as a forked trainer does for copy-on-write
    try:
        report = await run_replay_in_thread(recording)
        assert report.counts() == {"identical": len(recording.samples)}
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


async def test_check_finds_an_illegal_transition_with_its_line(recording: Recording) -> None:
    lines = recording.trace.read_bytes().splitlines()
    number = next(n for n, line in enumerate(lines) if b'"sample_id":"3"' in line and b'"observe"' in line)
    event = orjson.loads(lines[number])
    event["dst"] = "completed"
    lines[number] = orjson.dumps(event)
    recording.trace.write_bytes(b"\n".join(lines) + b"\n")
    report = await run_replay_in_thread(recording, execute=False)
    sample = report.sample("3")
    assert sample.verdict == "illegal"
    assert any(finding.startswith(f"line {number + 1}: ") for finding in sample.findings)


async def test_with_a_tape_the_trace_is_checked_and_the_tape_re_executed(recording: Recording) -> None:
    lines = recording.trace.read_bytes().splitlines()
    number = next(n for n, line in enumerate(lines) if b'"sample_id":"3"' in line and b'"observe"' in line)
    event = orjson.loads(lines[number])
    event["dst"] = "completed"
    lines[number] = orjson.dumps(event)
    step = next(n for n, line in enumerate(lines) if b'"sample_id":"0"' in line and b'"step"' in line)
    summary = orjson.loads(lines[step])
    summary["generated_tokens"] += 100  # the trace's own summary is not what re-execution compares with
    lines[step] = orjson.dumps(summary)
    recording.trace.write_bytes(b"\n".join(lines) + b"\n")
    report = await run_replay_in_thread(recording)
    assert report.exit_code == 1
    sample = report.sample("3")
    assert sample.verdict == "illegal"
    assert sample.findings[0].startswith(f"trace: line {number + 1}: ")
    assert sample.divergence is None and sample.turns == 2  # re-executed from its tape record all the same
    assert len(report.samples) == len(recording.samples)
    assert [other.verdict for other in report.samples if other.sample_id != "3"] == ["identical"] * 17


async def test_a_recording_made_with_collector_tuning_replays_without_tuning_it(
    recording: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    tape = recording.tape.read_bytes()
    recording.tape.write_bytes(tape.replace(b'"tune_gc":false', b'"tune_gc":true'))
    calls: list[str] = []
    monkeypatch.setattr(gc_policy, "rollout_started", lambda: calls.append("started"))
    report = await run_replay_in_thread(recording)
    assert report.counts() == {"identical": len(recording.samples)}, report.render(verbose=True)
    assert calls == []


async def test_check_only_needs_no_tape(recording: Recording) -> None:
    recording.tape.unlink()
    report = await run_replay_in_thread(recording)
    assert not report.executed
    assert report.counts() == {"legal": len(recording.samples)}
    assert report.exit_code == 0
    assert any("no tape" in warning for warning in report.warnings)


async def test_filters_select_samples_by_id_and_status(recording: Recording) -> None:
    report = await run_replay_in_thread(recording, statuses=["failed"])
    assert {sample.sample_id for sample in report.samples} == {"8", "10", "12", "15", "16"}
    report = await run_replay_in_thread(recording, sample_ids=["6", "7"])
    assert [sample.sample_id for sample in report.samples] == ["6", "7"]


async def test_the_tape_alone_can_be_replayed(recording: Recording) -> None:
    report = await asyncio.to_thread(replay, recording.tape, tokenizer=recording.tokenizer)
    assert report.counts() == {"identical": len(recording.samples)}


# --------------------------------------------------------------------------- command line


def cli(*argv: str) -> int:
    return cli_main(list(argv))


async def test_replay_cli_exits_0_when_identical(recording: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(cli, "replay", str(recording.trace), "--tokenizer", str(qwen_tokenizer_dir()))
    assert code == 0
    assert "identical 18" in capsys.readouterr().out


async def test_replay_cli_exits_1_on_a_divergence(recording: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    tamper(recording.tape, "3", lambda record: record["result"]["rollout_log_probs"].__setitem__(0, -9.0))
    code = await asyncio.to_thread(cli, "replay", str(recording.trace), "--tokenizer", str(qwen_tokenizer_dir()))
    out = capsys.readouterr().out
    assert code == 1
    assert "sample 3 [truncated/max_turns, 2 turn(s)] DIVERGED" in out
    assert "rollout_log_probs[0]" in out


async def test_replay_cli_exits_2_on_unusable_input(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(cli, "replay", str(tmp_path / "missing.jsonl")) == 2
    (tmp_path / "empty.jsonl").write_text("not json\n")
    assert await asyncio.to_thread(cli, "replay", str(tmp_path / "empty.jsonl")) == 2
    assert "error:" in capsys.readouterr().err


async def test_replay_cli_json_report(recording: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(
        cli, "replay", str(recording.trace), "--tokenizer", str(qwen_tokenizer_dir()), "--json", "--sample", "0"
    )
    report = orjson.loads(capsys.readouterr().out)
    assert code == 0
    assert report["counts"] == {"identical": 1}
    assert report["samples"][0]["sample_id"] == "0"


async def test_inspect_summarises_the_batch(recording: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(cli, "inspect", str(recording.trace))
    out = capsys.readouterr().out
    assert code == 0
    assert "18 sample run(s)" in out
    for text in ("completed", "env_done", "server_abort", "turns per sample", "dwell", "p95"):
        assert text in out


async def test_inspect_timeline_marks_masked_tokens_when_piped(
    recording: Recording, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await asyncio.to_thread(
        cli, "inspect", str(recording.trace), "--sample", "9", "--tokenizer", str(qwen_tokenizer_dir())
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "\033[" not in out
    assert "turn 1" in out
    assert "x = 1 </answer>" in out
    assert f"⟦{EOS}⟧" in out  # the masked EOS after the stop string
    assert "Continue the reasoning." in out
    assert "generating --step--> stepping" in out


async def test_inspect_timeline_colours_on_request(recording: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(
        cli,
        "inspect",
        str(recording.trace),
        "--sample",
        "9",
        "--color",
        "always",
        "--tokenizer",
        str(qwen_tokenizer_dir()),
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "\033[32m" in out and "\033[2m" in out
    assert "⟦" not in out


async def test_inspect_of_an_unknown_sample_is_unusable_input(
    recording: Recording, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(cli, "inspect", str(recording.trace), "--sample", "nope") == 2


async def test_record_without_a_trace_file_is_refused(make_config: Callable[..., Any]) -> None:
    from fsm_rollout.errors import ConfigError

    with pytest.raises(ConfigError, match="record=True needs a trace file"):
        make_config(record=True)


def test_unusable_trace_raises_a_recording_format_error(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"event": "something else"}\n')
    with pytest.raises(RecordingFormatError, match="no transition events"):
        replay(tmp_path / "x.jsonl")


async def test_render_failure_and_unheaded_samples_replay(
    tmp_path: Path, fake_vllm: FakeVLLMServer, client: Any, tokenizer: Any, make_config: Callable[..., Any]
) -> None:
    fake_vllm.fail_next(RENDER_PATH, status=400)
    batch = [Case(20, [], "failed", "error", session=False)]
    recorded = await record(tmp_path, fake_vllm, client, tokenizer, make_config, batch)
    report = await run_replay_in_thread(recorded)
    assert report.counts() == {"identical": 1}


async def test_run_record_then_replay_from_the_command_line(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    from tests.integration.test_run_cli import dataset, run_cli

    fake_vllm.script([ScriptedTurn(text=f"t{i}") for i in range(6)])
    data = dataset(tmp_path / "d.jsonl", *({"prompt": f"q{i}", "label": "1"} for i in range(3)))
    code, stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--data", str(data), "--quiet", "--record", "--max-turns", "2"
    )
    assert code == 0, stderr
    assert f"tape: {tmp_path / 'trace.tape.jsonl'}" in stdout
    report = await asyncio.to_thread(replay, tmp_path / "trace.jsonl")  # the recorded tokenizer path is loaded
    assert report.counts() == {"identical": 3}, report.render()
    assert report.turns_executed == 6


async def test_run_refuses_record_without_trace(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    import sys

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "run",
        "--engine-url",
        fake_vllm.url,
        "--model",
        "fake-model",
        "--record",
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    _, stderr = await process.communicate()
    assert process.returncode == 2
    assert b"--record needs --trace" in stderr


@pytest.mark.parametrize(("fixture_name", "samples"), [("schema1", 3), ("schema1-unbounded", 2)])
async def test_a_schema_1_recording_made_before_the_transport_seam_still_replays_identically(
    tokenizer: Any, tmp_path: Path, fixture_name: str, samples: int
) -> None:
    """tests/fixtures/tapes/schema1*: multi-turn samples recorded by fsm-rollout before recording moved to the
    transport seam and tapes to schema 2 (their config still has pacing and collector tuning on by default). The
    unbounded ones were generated without ``max_tokens``, which the library now sends as null."""
    fixture = Path(__file__).parents[1] / "fixtures" / "tapes" / fixture_name
    for name in ("run.jsonl", "run.tape.jsonl"):
        (tmp_path / name).write_bytes((fixture / name).read_bytes())
    assert b'"schema":1' in (tmp_path / "run.tape.jsonl").read_bytes().splitlines()[0]
    before = gc.get_threshold()
    report = await asyncio.to_thread(replay, tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.counts() == {"identical": samples}, report.render(verbose=True)
    assert gc.get_threshold() == before


@pytest.mark.parametrize(
    ("fixture_name", "samples"), [("schema2-env", 1), ("schema2-gateway", 1), ("schema2-gateway-idle", 1)]
)
async def test_a_schema_2_recording_made_before_the_typed_step_still_replays_identically(
    tokenizer: Any, tmp_path: Path, fixture_name: str, samples: int
) -> None:
    """tests/fixtures/tapes/schema2-*: recorded before ``env.step`` returned a typed ``StepResult``: an
    environment whose info carried ``reward`` and ``truncated``, and gateway sessions whose observations were
    dicts with the agent's call, its rewrite and its end under magic keys (a tool call, a ``max_tokens`` cut, a
    rewritten history that forked, a close with a reward; an agent idle past its limit)."""
    fixture = Path(__file__).parents[1] / "fixtures" / "tapes" / fixture_name
    for name in ("run.jsonl", "run.tape.jsonl"):
        (tmp_path / name).write_bytes((fixture / name).read_bytes())
    assert b'"schema":2' in (tmp_path / "run.tape.jsonl").read_bytes().splitlines()[0]
    report = await asyncio.to_thread(replay, tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.counts() == {"identical": samples}, report.render(verbose=True)


async def test_a_sample_index_reused_across_steps_keeps_each_runs_own_timeline_tokens_and_counts(
    fake_vllm: FakeVLLMServer,
    tokenizer: Any,
    make_config: Callable[..., Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A trainer loop that builds ``Sample(index=i)`` again each step: inspect names the runs ``0#1``, ``0#2``,
    shows each with its own tokens, and the overlay counts two runs."""
    from fsm_rollout import RolloutRunner, get_tracer
    from fsm_rollout.machine.diagrams import build_overlay, read_trace

    trace = tmp_path / "run.jsonl"
    config = make_config(max_turns=2, trace=str(trace), record=True)
    envs = ScriptedEnvFactory(steps=[("again", False), ("ok", True)])
    sampling = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0}
    async with RolloutRunner(config, sampling_params=sampling, tokenizer=tokenizer, env_factory=envs) as runner:
        for step in ("alpha", "bravo"):
            fake_vllm.script([ScriptedTurn(text=f"{step} one"), ScriptedTurn(text=f"{step} two")])
            (sample,) = await runner.run_batch([Sample(prompt="What is 6 * 7?", index=0)])
            assert sample.status.value == "completed"

    assert await asyncio.to_thread(cli, "inspect", str(trace), "--sample", "0", "--color", "never") == 0
    both = capsys.readouterr().out
    first, second = both.split("sample 0#2")
    assert "sample 0#1" in first and "alpha one" in first and "bravo" not in first
    assert "bravo one" in second and "alpha" not in second
    assert await asyncio.to_thread(cli, "inspect", str(trace), "--sample", "0#2", "--color", "never") == 0
    only = capsys.readouterr().out
    assert "sample 0#2" in only and "bravo two" in only and "alpha" not in only and "0#1" not in only

    overlay = build_overlay(read_trace(trace))
    assert overlay.total_samples == 2
    render_edge = next(
        usage for usage, edge in zip(overlay.edges, lifecycle.TRANSITIONS, strict=True) if edge.trigger == "render"
    )
    assert render_edge.samples == render_edge.transitions == 2
    report = await asyncio.to_thread(replay, trace, tokenizer=tokenizer)
    assert report.counts() == {"identical": 2}, report.render(verbose=True)
    assert [sample.label for sample in report.samples] == ["0#1", "0#2"]
    assert report.sample("0#2") is report.samples[1] and report.samples[1].rollout_uid is not None
    assert "sample 0#2 [" in report.render(verbose=True)
    get_tracer(str(trace)).close()
