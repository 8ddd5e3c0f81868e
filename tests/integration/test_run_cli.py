"""``fsm-rollout run`` end to end in a subprocess against the fake vLLM server: results, trace, summary, exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from process_groups import start_group, stop_group

from fsm_rollout.cli.run import DEMO_SAMPLES_PER_PROMPT
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import qwen_tokenizer_dir


def dataset(path: Path, *records: dict[str, Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


def done_after_one_turn(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "label": "1", "metadata": {"scripted_env": {"steps": [["ok", True]]}}}


async def run_cli(
    server: FakeVLLMServer,
    tmp_path: Path,
    *extra: str,
    interrupt_after: int | None = None,
    engine: tuple[str, ...] | None = None,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``fsm-rollout run`` against ``server``; ``engine`` replaces the engine options (URL, model, tokenizer),
    ``env`` is added to the environment (HF_HUB_OFFLINE=1 and no VLLM_API_KEY unless given)."""
    if engine is None:
        engine = ("--engine-url", server.url, "--model", "fake-model", "--tokenizer", str(qwen_tokenizer_dir()))
    command = [
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "run",
        *engine,
        "--env",
        "fsm_rollout.testing.envs",
        "--out",
        str(tmp_path / "results.jsonl"),
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--max-new-tokens",
        "64",
        *extra,
    ]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(env),
    )
    if interrupt_after is not None:
        # the signal goes only once the run is provably mid-flight: a loaded machine can take long to start it
        try:
            await asyncio.wait_for(
                server.wait_until(lambda: len(server.requests_to(GENERATE_PATH)) >= interrupt_after), timeout=300
            )
        except TimeoutError:
            process.kill()
            raise
        process.send_signal(signal.SIGINT)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, stdout.decode(), stderr.decode()


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_API_KEY"}
    return {**environment, "HF_HUB_OFFLINE": "1", **(extra or {})}


async def run_command(*argv: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(env),
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=300)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def one_error_line(stderr: str) -> str:
    """The command's only stderr line, an ``error: ...`` (no traceback, no progress)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def names_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def results(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (tmp_path / "results.jsonl").read_bytes().splitlines()]


async def test_run_writes_results_trace_and_a_summary(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="one"), ScriptedTurn(text="two"), ScriptedTurn(text="three")])
    data = dataset(tmp_path / "d.jsonl", *(done_after_one_turn(f"q{i}") for i in range(3)))
    code, stdout, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet")
    assert code == 0, stderr
    rows = results(tmp_path)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert {row["status"] for row in rows} == {"completed"}
    assert sorted(row["response"] for row in rows) == ["one", "three", "two"]
    trace = [orjson.loads(line) for line in (tmp_path / "trace.jsonl").read_bytes().splitlines()]
    assert len(trace) == 3 * 4
    assert "3/3 samples" in stdout
    assert "env_done" in stdout
    assert "completed" in stdout


async def test_target_groups_with_oversample_stop_at_the_complete_groups_and_cut_the_surplus(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    # one sample at a time: the first group takes the two answers; a surplus sample that starts before the first
    # group is seen complete hangs, until the cut aborts it
    fake_vllm.script([ScriptedTurn(text="one"), ScriptedTurn(text="two"), *[ScriptedTurn(text="x", hang=True)] * 2])
    data = dataset(tmp_path / "d.jsonl", *(done_after_one_turn(f"q{i}") for i in range(3)))
    options = ("--n-samples-per-prompt", "2", "--concurrency", "1", "--target-groups", "1", "--oversample", "1")
    code, stdout, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", *options)
    assert code == 0, stderr
    rows = results(tmp_path)  # the third prompt's group never started: it is not a result
    assert [(row["index"], row["status"]) for row in rows] == [
        (0, "completed"), (0, "completed"), (1, "aborted"), (1, "aborted")
    ]  # fmt: skip
    assert [row["metadata"]["rollout_reason"] for row in rows[2:]] == ["oversampled"] * 2
    assert [row["metadata"]["group_kept"] for row in rows] == [True, True, False, False]
    assert "2/4 samples finished" in stdout and "2 cut as surplus (oversampled)" in stdout
    assert "groups: 1/1 complete, 1 cut as surplus" in stdout.splitlines()
    assert len(fake_vllm.requests_to(GENERATE_PATH)) <= 3


async def test_turns_stop_at_the_tool_call_with_the_geo3k_environment_unless_told_otherwise(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="no tool call")] * 3)
    geo3k = dataset(tmp_path / "geo3k.jsonl", {"prompt": "q", "label": "5"})
    scripted = dataset(tmp_path / "scripted.jsonl", done_after_one_turn("q"))
    for options in (("--env", "fsm_rollout.envs.geo3k"), ("--env", "fsm_rollout.envs.geo3k", "--stop", "###"), ()):
        data = geo3k if options else scripted
        code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", *options)
        assert code == 0, stderr
    stops = [request.body["sampling_params"].get("stop") for request in fake_vllm.requests_to(GENERATE_PATH)]
    assert stops == [["</tool_call>"], ["###"], None]


async def test_a_bad_dataset_line_exits_2_naming_the_line(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data))
    assert code == 2
    assert f"{data}:2:" in stderr
    assert fake_vllm.requests == []


async def test_skip_bad_runs_the_good_lines_and_counts_the_bad(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="one")])
    data = tmp_path / "d.jsonl"
    data.write_bytes(orjson.dumps(done_after_one_turn("q")) + b"\nnot json\n")
    code, stdout, _ = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--skip-bad", "--quiet")
    assert code == 0
    assert "1 bad dataset line(s) skipped" in stdout
    assert len(results(tmp_path)) == 1


async def test_pacing_and_gc_flags_run_and_a_bad_slice_exits_2(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="one"), ScriptedTurn(text="two")])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q0"), done_after_one_turn("q1"))
    code, _, stderr = await run_cli(
        fake_vllm, tmp_path, "--data", str(data), "--quiet", "--loop-slice-ms", "0", "--no-tune-gc"
    )
    assert code == 0, stderr
    assert {row["status"] for row in results(tmp_path)} == {"completed"}
    code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--loop-slice-ms", "-1")
    assert code == 2
    assert "loop_slice_ms must be a positive number" in stderr
    assert len(fake_vllm.requests_to(GENERATE_PATH)) == 2  # the bad run sent nothing


async def test_a_failed_sample_exits_1(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(status=400)])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, stdout, _ = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet")
    assert code == 1
    assert results(tmp_path)[0]["status"] == "failed"
    assert "failed" in stdout


async def test_ctrl_c_aborts_in_flight_samples_writes_partials_and_exits_130(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="first"), ScriptedTurn(text="never", hang=True)])
    data = dataset(tmp_path / "d.jsonl", {"prompt": "q"})
    code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", interrupt_after=2)
    assert code == 130, stderr
    row = results(tmp_path)[0]
    assert row["status"] == "aborted"
    assert row["response"] == "first"
    assert row["metadata"]["rollout_reason"] == "cancelled"
    assert len(fake_vllm.aborted_request_ids) == 2


async def test_the_demo_runs_on_the_embedded_engine_with_images(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "fsm_rollout.cli",
        "run",
        "--limit",
        "2",
        "--max-new-tokens",
        "16",
        "--quiet",
        "--out",
        str(tmp_path / "results.jsonl"),
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--seed",
        "3",
    ]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=300)
    assert process.returncode == 0, stderr.decode()
    rows = results(tmp_path)
    # the demo rolls each question out as a group, each member with its own seed
    assert [(row["index"], row["group_index"], row["metadata"]["group_member"]) for row in rows] == [
        (index, index, member) for index in (0, 1) for member in range(DEMO_SAMPLES_PER_PROMPT)
    ]
    assert len({row["session_id"] for row in rows}) == len(rows)
    names = {json.loads(line).get("sample_id") for line in (tmp_path / "trace.jsonl").read_text().splitlines()}
    assert {f"{index}.{member}" for index in (0, 1) for member in range(DEMO_SAMPLES_PER_PROMPT)} <= names
    for row in rows:
        assert row["status"] in ("truncated", "completed")
        assert row["response_length"] == len(row["loss_mask"]) == len(row["rollout_log_probs"])
        grid = row["multimodal_train_inputs"]["image_grid_thw"]
        assert grid["shape"] == [1, 3]
        assert row["multimodal_train_inputs"]["pixel_values"]["dtype"] == "float32"
        assert row["multimodal_inputs"]["images"][0].startswith("data:image/png;base64,")
    total = 2 * DEMO_SAMPLES_PER_PROMPT
    assert f"{total}/{total} samples" in stdout.decode()
    assert re.search(rf"reward mean \d\.\d{{3}} over {total} samples; \d+ at 1\.0 \(\d+ completed\)", stdout.decode())


def test_the_former_gc_flag_name_still_parses() -> None:
    from fsm_rollout.cli import build_parser

    assert build_parser().parse_args(["run", "--no-defer-full-gc"]).no_tune_gc is True
    assert build_parser().parse_args(["run"]).no_tune_gc is False


# -------------------------------------------------------------------- checks before anything runs


async def test_a_negative_budget_exits_2_before_the_engine_starts(tmp_path: Path) -> None:
    code, stdout, stderr = await run_command(
        "run", "--max-new-tokens", "-5", "--out", str(tmp_path / "r.jsonl"), "--trace", str(tmp_path / "t.jsonl")
    )
    assert code == 2
    assert one_error_line(stderr) == "error: --max-new-tokens -5: max_new_tokens must be at least 1"
    assert stdout == ""
    assert names_in(tmp_path) == []  # no results, no trace


def closed_port_url() -> str:
    with socket.socket() as probe:  # a port that was free a moment ago, and nothing listens on it now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_nothing_listening_at_the_engine_url_exits_2_with_one_line(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    url = closed_port_url()
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, _, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--data",
        str(data),
        "--quiet",
        engine=(
            "--engine-url",
            fake_vllm.url,
            "--engine-url",
            url,
            "--model",
            "fake-model",
            "--tokenizer",
            str(qwen_tokenizer_dir()),
        ),
    )
    assert code == 2
    line = one_error_line(stderr)
    assert line.startswith(f"error: no engine answers at {url} (GET {url}/health failed: ")
    assert line.endswith("start it or check --engine-url")
    assert not (tmp_path / "results.jsonl").exists()
    assert fake_vllm.requests_to(RENDER_PATH) == []


async def test_failed_samples_print_their_distinct_errors_under_the_summary(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.fail_next(RENDER_PATH, status=400, times=3)
    fake_vllm.script([ScriptedTurn(text="one")])
    data = dataset(tmp_path / "d.jsonl", *(done_after_one_turn(f"q{i}") for i in range(4)))
    code, stdout, _ = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", "--concurrency", "1")
    assert code == 1
    lines = stdout.splitlines()
    errors_at = lines.index("errors (3 failed sample(s), 1 distinct)")
    assert lines[errors_at - 1].split() == ["error", "3"]  # under the reason counts
    assert lines[errors_at + 1 : errors_at + 5] == [
        f"     3 x EngineHTTPError: POST {fake_vllm.url}{RENDER_PATH} answered HTTP 400 (attempt 1): "
        "fake vLLM: injected fault (400)",
        f"results: {tmp_path / 'results.jsonl'}   trace: {tmp_path / 'trace.jsonl'}",
        "history: 0 fork(s), 4 training sequence(s) from 4 sample(s)",  # the forks the run counted
        "next:",  # then the commands that look inside the run
    ]


# -------------------------------------------------------------------- what the engine says


async def test_the_model_name_comes_from_the_engine(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="one")])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, _, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--data",
        str(data),
        "--quiet",
        engine=("--engine-url", fake_vllm.url, "--tokenizer", str(qwen_tokenizer_dir())),
    )
    assert code == 0, stderr
    assert results(tmp_path)[0]["status"] == "completed"
    assert {request.body["model"] for request in fake_vllm.requests_to(RENDER_PATH)} == {"fake-model"}


async def test_a_model_the_engine_does_not_serve_exits_2_naming_what_it_serves(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, _, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--quiet",
        "--data",
        str(data),
        engine=("--engine-url", fake_vllm.url, "--model", "other", "--tokenizer", str(qwen_tokenizer_dir())),
    )
    assert code == 2
    assert one_error_line(stderr) == (
        f"error: --model 'other': the engine at {fake_vllm.url} serves 'fake-model', not 'other'"
    )


async def test_a_tokenizer_that_is_not_local_fails_at_once_naming_the_flag(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    # The fake server's model card names "fake-model" as its model path: no directory, not cached, hub offline.
    data = str(dataset(tmp_path / "d.jsonl", done_after_one_turn("q")))
    code, stdout, stderr = await run_cli(
        fake_vllm, tmp_path, "--quiet", "--data", data, engine=("--engine-url", fake_vllm.url)
    )
    assert code == 2
    assert one_error_line(stderr) == (
        f"error: the model path that {fake_vllm.url} names 'fake-model' is neither a local directory nor in the "
        "Hugging Face cache, and the hub is offline (HF_HUB_OFFLINE): pass --tokenizer DIR"
    )
    assert stdout == ""
    code, _, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--quiet",
        "--data",
        data,
        engine=("--engine-url", fake_vllm.url, "--tokenizer", str(tmp_path / "no-such-dir")),
    )
    assert code == 2
    assert one_error_line(stderr) == (
        f"error: --tokenizer {str(tmp_path / 'no-such-dir')!r} is not a tokenizer directory: pass --tokenizer DIR"
    )


# -------------------------------------------------------------------- the API key

SECRET = "sk-test-9f8e7d6c5b4a"


def files_holding(directory: Path, text: str) -> list[str]:
    return sorted(path.name for path in directory.rglob("*") if path.is_file() and text.encode() in path.read_bytes())


async def test_the_api_key_is_sent_but_never_printed_or_written(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.fail_next(RENDER_PATH, status=401)  # one sample's request is refused
    fake_vllm.script([ScriptedTurn(text="one")])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q0"), done_after_one_turn("q1"))
    code, stdout, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--data",
        str(data),
        "--quiet",
        "--record",
        "--concurrency",
        "1",
        env={"VLLM_API_KEY": SECRET},
    )
    assert code == 1, stderr
    assert sorted(row["status"] for row in results(tmp_path)) == ["completed", "failed"]
    assert "answered HTTP 401" in stdout
    assert {request.headers.get("Authorization") for request in fake_vllm.requests} == {f"Bearer {SECRET}"}
    assert SECRET not in stdout + stderr
    assert names_in(tmp_path) == ["d.jsonl", "results.jsonl", "trace.jsonl", "trace.tape.jsonl"]
    assert files_holding(tmp_path, SECRET) == []


@pytest.fixture(scope="module")
def keyed_serve() -> Iterator[str]:
    """``fsm-rollout serve`` with an API key (from VLLM_API_KEY, as vLLM reads it); yields its URL."""
    process = start_group(
        [sys.executable, "-m", "fsm_rollout.cli", "serve", "--port", "0", "--max-model-len", "2048"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env({"VLLM_API_KEY": SECRET}),
    )  # it dies with the test process, however that ends
    try:
        assert process.stdout is not None
        url = process.stdout.readline().decode().strip()  # printed once the engine answers; empty if it died
        assert url.startswith("http://"), process.stderr.read().decode() if process.stderr else ""
        yield url
    finally:
        stop_group(process, grace_s=30)


async def test_run_against_a_keyed_serve_needs_only_the_url_and_the_key(keyed_serve: str, tmp_path: Path) -> None:
    # The demo has images: the tokenizer and the merge size come from the engine's /v1/models.
    code, stdout, stderr = await run_command(
        "run",
        "--engine-url",
        keyed_serve,
        "--api-key",
        SECRET,
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--quiet",
        "--out",
        str(tmp_path / "results.jsonl"),
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--record",
    )
    assert code == 0, stderr
    rows = results(tmp_path)
    assert {row["status"] for row in rows} <= {"completed", "truncated"}
    assert all(row["multimodal_train_inputs"]["image_grid_thw"]["shape"] == [1, 3] for row in rows)
    total = 2 * DEMO_SAMPLES_PER_PROMPT  # the demo's questions run as groups, against any engine
    assert f"{total}/{total} samples" in stdout
    assert SECRET not in stdout + stderr
    assert files_holding(tmp_path, SECRET) == []


async def test_run_against_a_keyed_serve_without_the_right_key_exits_2_clearly(
    keyed_serve: str, tmp_path: Path
) -> None:
    out = ("--out", str(tmp_path / "results.jsonl"), "--trace", str(tmp_path / "trace.jsonl"), "--quiet")
    code, stdout, stderr = await run_command("run", "--engine-url", keyed_serve, *out)
    assert code == 2
    assert one_error_line(stderr) == (
        f"error: GET {keyed_serve}/v1/models answered HTTP 401: Unauthorized; the engine needs an API key: "
        "pass --api-key or set $VLLM_API_KEY"
    )
    wrong = SECRET[:-1]  # a near miss must not be printed either
    code, stdout, stderr = await run_command("run", "--engine-url", keyed_serve, "--api-key", wrong, *out)
    assert code == 2
    assert one_error_line(stderr).endswith("Unauthorized; the API key was refused: check --api-key (or $VLLM_API_KEY)")
    assert wrong not in stdout + stderr
    assert names_in(tmp_path) == []


async def test_ctrl_c_counts_finished_aborted_mid_way_and_never_started_and_says_which_never_started(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="never", hang=True)])
    data = dataset(tmp_path / "d.jsonl", *(done_after_one_turn(f"q{i}") for i in range(3)))
    code, stdout, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", "--concurrency", "1",
                                         interrupt_after=1)  # fmt: skip
    assert code == 130, stderr
    rows = results(tmp_path)
    assert [(row["status"], row["metadata"]["rollout_reason"]) for row in rows] == [
        ("aborted", "cancelled"),
        ("aborted", "not_started"),
        ("aborted", "not_started"),
    ]
    assert "0/3 samples finished" in stdout
    assert "1 aborted mid-way, 2 never started" in stdout


async def test_a_run_that_generates_nothing_fails_saying_why(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q0"), done_after_one_turn("q1"))
    code, stdout, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", "--max-context-len", "3")
    assert code == 1, stderr
    assert re.search(
        r"error: nothing was generated: all 2 sample\(s\) ended truncated/budget_exhausted before their "
        r"first turn; the prompts \(\d+(-\d+)? tokens\) leave no room for a response under "
        r"--max-context-len 3",
        stderr,
    ), stderr
    assert [(row["status"], row["response_length"]) for row in results(tmp_path)] == [("truncated", 0)] * 2
    assert "2/2 samples" in stdout  # the summary is still printed
    assert fake_vllm.requests_to(GENERATE_PATH) == []

    fake_vllm.script([ScriptedTurn(text="one")])  # one sample with room to answer: the run is fine
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q0"))
    code, _, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", "--max-context-len", "4000")
    assert code == 0, stderr
    assert "nothing was generated" not in stderr


RIGHT_TOOL_CALL = '<tool_call>{"name": "calc_score", "arguments": {"answer": "5"}}</tool_call>'


async def test_the_summary_ends_with_the_next_commands_and_inspect_shows_a_group_with_prompt_label_and_reward(
    fake_vllm: FakeVLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Geo3K grades a right tool call 1.0, then a wrong final answer 0.0: the reward is the episode's best (1.0),
    and inspect shows it after the last observation, which reads "scored 0.0"."""
    from fsm_rollout.cli import main

    fake_vllm.script([ScriptedTurn(text=RIGHT_TOOL_CALL), ScriptedTurn(text="So \\boxed{7}.")] * 2)
    data = dataset(tmp_path / "d.jsonl", {"prompt": "Find x in the triangle.", "label": "5"})
    code, stdout, stderr = await run_cli(
        fake_vllm,
        tmp_path,
        "--data",
        str(data),
        "--quiet",
        "--record",
        "--env",
        "fsm_rollout.envs.geo3k",
        "--n-samples-per-prompt",
        "2",
        "--concurrency",
        "1",
        "--max-new-tokens",
        "512",
    )
    assert code == 0, stderr
    assert [(row["status"], row["reward"]) for row in results(tmp_path)] == [("completed", 1.0)] * 2
    trace = tmp_path / "trace.jsonl"
    assert stdout.rstrip().endswith(
        "\n".join(
            [
                "next:",
                f"  fsm-rollout report {trace} --results {tmp_path / 'results.jsonl'} -o {tmp_path / 'trace.html'}",
                f"  fsm-rollout inspect {trace}",
                f"  fsm-rollout inspect {trace} --sample 0.0",
                f"  fsm-rollout diagram --trace {trace} -o {tmp_path / 'trace.mmd'} --sample 0.0",
                f"  fsm-rollout replay {trace}",
            ]
        )
    ), stdout

    assert await asyncio.to_thread(main, ["inspect", str(trace), "--sample", "0", "--color", "never"]) == 0
    shown = capsys.readouterr().out
    blocks = re.split(r"\n\n(?=sample )", shown.rstrip())  # the group id shows each member
    assert [block.splitlines()[0].split()[:2] for block in blocks] == [["sample", "0.0"], ["sample", "0.1"]]
    for block in blocks:
        lines = block.splitlines()
        assert lines[1:3] == ["  prompt: Find x in the triangle.", "  label: '5'"]
        assert "the final answer 7 scored 0.0" in block
        assert lines[-1] == "  reward 1.0  (completed/env_done)"

    assert await asyncio.to_thread(main, ["inspect", str(trace), "--sample", "3"]) == 2
    assert capsys.readouterr().err == (
        f"error: {trace} has no sample '3'; it has 2 sample id(s): 0.0-0.1; a group id (the part before the last "
        "dot) shows all its members\n"
    )


async def test_without_a_trace_the_summary_says_how_to_look_inside(fake_vllm: FakeVLLMServer, tmp_path: Path) -> None:
    fake_vllm.script([ScriptedTurn(text="one")])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, stdout, stderr = await run_command(
        "run",
        "--engine-url",
        fake_vllm.url,
        "--model",
        "fake-model",
        "--tokenizer",
        str(qwen_tokenizer_dir()),
        "--data",
        str(data),
        "--env",
        "fsm_rollout.testing.envs",
        "--out",
        str(tmp_path / "r.jsonl"),
        "--quiet",
    )
    assert code == 0, stderr
    assert stdout.rstrip().splitlines()[-1] == (
        "next: run with --trace trace.jsonl --record to look inside each "
        "sample (`fsm-rollout report`, `inspect`, `replay`, `diagram --trace`)"
    )


async def test_report_writes_the_run_as_a_page_and_the_summary_points_to_it(
    fake_vllm: FakeVLLMServer, tmp_path: Path
) -> None:
    fake_vllm.script([ScriptedTurn(text="one")])
    data = dataset(tmp_path / "d.jsonl", done_after_one_turn("q"))
    code, stdout, stderr = await run_cli(fake_vllm, tmp_path, "--data", str(data), "--quiet", "--record", "--report")
    assert code == 0, stderr
    page = tmp_path / "trace.html"
    assert f"report: {page}" in stdout.splitlines()
    assert stdout.splitlines()[stdout.splitlines().index("next:") + 1] == f"  open {page}"
    html = page.read_text()
    assert (
        html.startswith("<!DOCTYPE html>") and '"trace":"trace.jsonl"' in html and '"tape":"trace.tape.jsonl"' in html
    )


def test_report_needs_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from fsm_rollout.cli import main

    assert main(["run", "--report"]) == 2
    assert "--report needs --trace" in capsys.readouterr().err
