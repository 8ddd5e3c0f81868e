"""The command line's layering: argument parsing only in fsm_rollout/cli, cheap to import, explicit settings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout.cli import SUBCOMMANDS, build_parser, main
from fsm_rollout.cli.bench import settings as bench_settings
from fsm_rollout.cli.bench.params import Settings
from fsm_rollout.cli.run import DEMO_SAMPLES_PER_PROMPT, _groups, build_config, error_lines, reward_lines
from fsm_rollout.recording import tape_path_for
from fsm_rollout.sample import Sample, Status

PACKAGE = Path(__file__).resolve().parents[2] / "fsm_rollout"


def test_only_the_cli_package_parses_arguments() -> None:
    parsing = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(import argparse|from argparse import)", path.read_text(), re.MULTILINE)
    )
    # examples/ are programs a user writes, with their own command lines; the library itself parses nothing
    assert parsing and all(name.startswith(("cli/", "examples/")) for name in parsing), parsing


def test_building_the_parser_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys\n"
        "from fsm_rollout.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_every_subcommand_lives_in_the_cli_package() -> None:
    assert set(SUBCOMMANDS) == {"run", "replay", "inspect", "report", "diagram", "serve", "bench", "gateway"}
    assert all(module.startswith("fsm_rollout.cli.") for module, _help in SUBCOMMANDS.values())


def run_config(*argv: str) -> tuple[float | None, bool]:
    args = build_parser().parse_args(["run", *argv])
    config = build_config(args, "http://127.0.0.1:1", "m", None, None)
    return config.loop_slice_ms, config.tune_gc


@pytest.mark.parametrize(("argv", "policy"), [((), "auto"), (("--history-policy", "per_turn"), "per_turn")])
def test_run_passes_the_history_policy_on_and_defaults_to_auto(argv: tuple[str, ...], policy: str) -> None:
    args = build_parser().parse_args(["run", *argv])
    assert build_config(args, "http://127.0.0.1:1", "m", None, None).history_policy == policy


@pytest.mark.parametrize(
    ("argv", "staleness"), [((), None), (("--max-staleness", "2"), 2), (("--max-staleness", "0"), 0)]
)
def test_run_passes_max_staleness_on_and_paces_nothing_by_default(argv: tuple[str, ...], staleness: int | None) -> None:
    args = build_parser().parse_args(["run", *argv])
    assert build_config(args, "http://127.0.0.1:1", "m", None, None).max_staleness == staleness


def test_run_refuses_an_unknown_history_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["run", "--history-policy", "branch"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'branch'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "switches"),
    [((), None), (("--chat-template-kwargs", '{"enable_thinking": false}'), {"enable_thinking": False})],
)
def test_run_passes_chat_template_switches_on(argv: tuple[str, ...], switches: Any) -> None:
    args = build_parser().parse_args(["run", *argv])
    assert build_config(args, "http://127.0.0.1:1", "m", None, None).apply_chat_template_kwargs == switches


@pytest.mark.parametrize(("value", "problem"), [("{enable", "not JSON"), ("[1]", "must be a JSON object, got list")])
def test_run_refuses_chat_template_switches_that_are_not_a_json_object(
    value: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["run", "--chat-template-kwargs", value])
    assert exit_info.value.code == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), (5.0, True)),
        (("--loop-slice-ms", "0"), (None, True)),
        (("--loop-slice-ms", "2.5", "--no-tune-gc"), (2.5, False)),
        (("--no-defer-full-gc",), (5.0, False)),
    ],
)
def test_run_turns_the_process_wide_settings_on_unless_told_not_to(
    argv: tuple[str, ...], expected: tuple[float | None, bool]
) -> None:
    assert run_config(*argv) == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [((), Settings(5.0, True)), (("--loop-slice-ms", "0", "--no-tune-gc"), Settings(None, False))],
)
def test_bench_turns_the_process_wide_settings_on_unless_told_not_to(argv: tuple[str, ...], expected: Settings) -> None:
    assert bench_settings(build_parser().parse_args(["bench", *argv])) == expected


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_shows_defaults_but_not_empty_ones(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one line per option, so no default is wrapped apart
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out
    expected = {
        "run": [
            "--max-turns N         turns per sample at most (default: 3)",
            "(default: results.jsonl)",
            "run only the first N prompts of the dataset (each as --n-samples-per-prompt samples)",
            "needs --data unless it brings samples of its own (default with",
            "response budget over all turns (default: 176)",
            f"(default: {DEMO_SAMPLES_PER_PROMPT} with the demo, else 1)",
            "(default: 5.0)",
            "Exit codes:",
        ],
        "bench": ["(default: 5.0)"],
        "serve": ["(default: 8000)", "(default: 127.0.0.1, loopback only)"],
        "gateway": ["(default: 127.0.0.1)", "(default: 8300)", "(default: auto)", "Exit codes:"],
        "replay": ["Exit codes:"],
        "inspect": ["Exit codes:"],
        "report": ["Exit codes:"],
        "diagram": ["Exit codes:"],
    }[command]
    for text in expected:
        assert text in out, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--max-new-tokens", "-5"), "--max-new-tokens -5: max_new_tokens must be at least 1"),
        (("--max-new-tokens", "0"), "--max-new-tokens 0: max_new_tokens must be at least 1"),
        (("--max-turns", "0"), "--max-turns 0: max_turns must be at least 1"),
        (("--n-samples-per-prompt", "0"), "--n-samples-per-prompt 0: n_samples_per_prompt must be at least 1"),
        (("--max-context-len", "-1"), "--max-context-len -1: max_context_len must be at least 1"),
        (("--concurrency", "0"), "--concurrency 0: concurrency must be at least 1"),
        (("--target-groups", "0"), "--target-groups 0: target_groups must be at least 1"),
        (("--target-groups", "2", "--oversample", "-1"), "--oversample -1: oversample must be 0 or more"),
        (("--max-staleness", "-1"), "--max-staleness -1: max_staleness must be 0 or more"),
        (
            (
                "--oversample",
                "2",
            ),
            "--oversample needs --target-groups (the number of complete groups wanted)",
        ),
        (("--limit", "-2"), "--limit -2: limit must be 0 or more"),
        (("--temperature", "-0.5"), "--temperature -0.5: temperature must be a number >= 0"),
        (("--temperature", "inf"), "--temperature inf: temperature must be a number >= 0"),
        (("--top-p", "0"), "--top-p 0: top_p must be in (0, 1]"),
        (("--top-p", "1.5"), "--top-p 1.5: top_p must be in (0, 1]"),
        (("--top-p", "nan"), "--top-p nan: top_p must be in (0, 1]"),
        (("--image-merge-size", "0"), "--image-merge-size 0: image_merge_size must be at least 1"),
        (
            ("--loop-slice-ms", "-1"),
            "--loop-slice-ms -1: loop_slice_ms must be a positive number of milliseconds, or 0 to turn pacing off",
        ),
        (
            ("--engine-url", "localhost:8000"),
            "--engine-url localhost:8000: engine_url must be an http(s) URL such as http://127.0.0.1:8000",
        ),
        (("--record",), "--record needs --trace (the tape is written beside the trace)"),
        (
            ("--data", "d.jsonl"),
            "--data needs --env: the environment that runs and grades your dataset (the demo's "
            "is --env fsm_rollout.envs.geo3k)",
        ),
    ],
)
def test_run_refuses_a_bad_option_in_one_line_before_starting_anything(
    argv: tuple[str, ...],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def started(args: Any) -> int:
        raise AssertionError("the run started")

    monkeypatch.setattr("fsm_rollout.cli.run._run", started)
    assert main(["run", *argv, "--out", str(tmp_path / "r.jsonl")]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def failed(kind: str, message: str) -> Sample:
    sample = Sample(prompt="q", status=Status.FAILED)
    sample.metadata = {"rollout_error": {"type": kind, "message": message, "state": None, "trigger": None}}
    return sample


def test_the_error_lines_count_distinct_errors_most_frequent_first() -> None:
    samples = [
        failed("EngineHTTPError", "HTTP 500\ndetails"),
        Sample(prompt="q", status=Status.COMPLETED),
        failed("ConfigError", "bad"),
        failed("EngineHTTPError", "HTTP 500\nother details"),
    ]
    assert error_lines(samples) == [
        "errors (3 failed sample(s), 2 distinct)",
        "     2 x EngineHTTPError: HTTP 500",
        "     1 x ConfigError: bad",
    ]
    many = [failed("E", f"message {number}") for number in range(7)]
    lines = error_lines(many, limit=5)
    assert len(lines) == 7 and lines[-1].startswith("  ... 2 more distinct error(s)")
    assert error_lines([Sample(prompt="q", status=Status.TRUNCATED)]) == []


def test_the_demo_runs_groups_and_a_dataset_one_sample_a_prompt_unless_told() -> None:
    prompts = [Sample(index=0, prompt="a"), Sample(index=1, prompt="b")]
    demo = build_parser().parse_args(["run"])
    members, names, seeds = _groups(prompts, demo)
    assert [(member.index, member.group_index, member.metadata["group_member"]) for member in members] == [
        (index, index, member) for index in (0, 1) for member in range(DEMO_SAMPLES_PER_PROMPT)
    ]
    assert names == [f"{index}.{member}" for index in (0, 1) for member in range(DEMO_SAMPLES_PER_PROMPT)]
    assert seeds == [] and len({member.session_id for member in members}) == len(members)
    assert all(prompt.group_index is None for prompt in prompts)  # the dataset's samples are copied, not changed

    _, _, seeded = _groups(prompts, build_parser().parse_args(["run", "--seed", "7", "--n-samples-per-prompt", "3"]))
    assert seeded == [7, 8, 9, 7, 8, 9]  # member m sends seed + m: reproducible, and the members still differ

    dataset = build_parser().parse_args(["run", "--data", "d.jsonl"])
    assert _groups(prompts, dataset) == (prompts, [], [])
    two = build_parser().parse_args(["run", "--data", "d.jsonl", "--n-samples-per-prompt", "2"])
    assert len(_groups(prompts, two)[0]) == 4


def test_the_reward_line_counts_right_answers_and_which_of_them_completed() -> None:
    def rewarded(reward: object, status: Status) -> Sample:
        return Sample(prompt="q", reward=reward, status=status)  # type: ignore[arg-type]

    samples = [
        rewarded(1.0, Status.COMPLETED),
        rewarded(1.0, Status.TRUNCATED),
        rewarded(0.0, Status.TRUNCATED),
        rewarded(0.0, Status.COMPLETED),
        rewarded(None, Status.FAILED),
        rewarded(True, Status.COMPLETED),
    ]
    assert reward_lines(samples) == ["reward mean 0.500 over 4 samples; 2 at 1.0 (1 completed)"]
    assert reward_lines([rewarded(None, Status.COMPLETED)]) == []


def test_what_the_readme_commands_write_in_the_checkout_is_ignored_by_git() -> None:
    root = PACKAGE.parent
    readme = "\n".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    traces = set(re.findall(r"fsm-rollout run[^\n`]*--trace ([\w.-]+\.jsonl)", readme))
    assert "trace.jsonl" in traces and "run.jsonl" in traces, traces
    written = {
        str(build_parser().parse_args(["run"]).out),
        *traces,
        *(str(tape_path_for(name)) for name in traces),
        *re.findall(r"fsm-rollout bench --json (\S+?)`", readme),
    }
    assert "results.jsonl" in written and "bench.json" in written, written
    for name in sorted(written):
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", name], cwd=root, check=False)
        assert ignored.returncode == 0, f"{name} is written in the checkout and not ignored by git"
    kept = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", "tests/fixtures/tapes/schema1/run.jsonl"], cwd=root, check=False
    )
    assert kept.returncode == 1  # only the checkout's top level: the fixtures of the same names stay tracked
