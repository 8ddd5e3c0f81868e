"""The default-model build's progress line: what it says, and how it is drawn on a terminal and in a log."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from fsm_rollout.cli.build_progress import BuildProgressLine, render_build_progress
from fsm_rollout.engine.local.default_model import BuildProgress


def reports(steps: int) -> list[BuildProgress]:
    """A build's reports: step 0 after 5 s of set-up, then one step a second."""
    made = [BuildProgress(0, steps, None, 5.0, None)]
    made += [BuildProgress(step, steps, 3.0 / step, 5.0 + step, float(steps - step)) for step in range(1, steps + 1)]
    return made


def test_the_line_says_the_step_the_loss_the_time_spent_and_the_time_left() -> None:
    assert render_build_progress(BuildProgress(0, 750, None, 7.4, None)) == (
        "training the default model: step 0/750 (0%), 0:07 elapsed, starting"
    )
    assert render_build_progress(BuildProgress(120, 750, 2.3071, 61.0, 215.2)) == (
        "training the default model: step 120/750 (16%), loss 2.307, 1:01 elapsed, about 3:35 left"
    )
    assert render_build_progress(BuildProgress(750, 750, 0.4123, 290.0, 0.0)) == (
        "training the default model: step 750/750 (100%), loss 0.412, 4:50 elapsed, done"
    )


def test_on_a_terminal_one_line_is_redrawn_and_ended_once() -> None:
    stream = io.StringIO()
    draw = BuildProgressLine(stream, interactive=True)
    for report in reports(4):
        draw(report)
    text = stream.getvalue()
    assert text.count("\r\033[K") == 5 and text.count("\n") == 1
    assert text.endswith("step 4/4 (100%), loss 0.750, 0:09 elapsed, done\n")
    second = text.split("\r\033[K")[2]
    assert second == "training the default model: step 1/4 (25%), loss 3.000, 0:06 elapsed, about 0:03 left"


def test_in_a_log_a_plain_line_is_written_at_each_tenth_and_at_the_end() -> None:
    stream = io.StringIO()
    draw = BuildProgressLine(stream, interactive=False)
    for report in reports(100):
        draw(report)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split(",")[0] for line in lines] == [
        f"training the default model: step {step}/100 ({step}%)" for step in range(0, 101, 10)
    ]
    assert lines[-1].endswith("done")


def test_a_stream_that_is_not_a_terminal_gets_plain_lines() -> None:
    stream = io.StringIO()  # isatty() is False
    draw = BuildProgressLine(stream)
    for report in reports(3):
        draw(report)
    assert "\r" not in stream.getvalue() and len(stream.getvalue().splitlines()) == 4


def test_fsm_rollout_run_draws_the_build_progress_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsm_rollout.cli import main
    from fsm_rollout.engine.local import default_model
    from fsm_rollout.engine.local.errors import ModelLoadError

    def build(cache: Path | None = None, *, log: Any = None, progress: Any = None, **_: Any) -> Path:
        log("training the default model once")
        for report in reports(3):
            progress(report)
        raise ModelLoadError("stopped after the build's reports")

    monkeypatch.setattr(default_model, "default_model_dir", build)
    assert main(["run", "--limit", "1", "--out", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-6:] == [
        "training the default model once",
        "training the default model: step 0/3 (0%), 0:05 elapsed, starting",
        "training the default model: step 1/3 (33%), loss 3.000, 0:06 elapsed, about 0:02 left",
        "training the default model: step 2/3 (66%), loss 1.500, 0:07 elapsed, about 0:01 left",
        "training the default model: step 3/3 (100%), loss 1.000, 0:08 elapsed, done",
        "error: stopped after the build's reports",
    ]


def test_fsm_rollout_serve_draws_the_build_progress_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsm_rollout.cli import main
    from fsm_rollout.engine.local import default_model
    from fsm_rollout.engine.local.errors import ModelLoadError

    def build(cache: Path | None = None, *, log: Any = None, progress: Any = None, **_: Any) -> Path:
        for report in reports(2):
            progress(report)
        raise ModelLoadError("stopped after the build's reports")

    monkeypatch.setattr(default_model, "default_model_dir", build)
    assert main(["serve", "--port", "0"]) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "training the default model: step 2/2 (100%), loss 1.500, 0:07 elapsed, done",
        "fsm-rollout serve: stopped after the build's reports",
    ]


def test_before_the_first_step_the_line_says_what_the_build_does_each_phase_once_in_a_log() -> None:
    import io

    from fsm_rollout.cli.build_progress import BuildProgressLine
    from fsm_rollout.engine.local.default_model import BuildProgress

    log, terminal = io.StringIO(), io.StringIO()
    for sink, interactive in ((log, False), (terminal, True)):
        line = BuildProgressLine(sink, interactive=interactive)
        for second, phase in enumerate(["importing torch", "importing torch", "loading the random model"]):
            line(BuildProgress(0, 0, None, float(second), None, phase=phase))
        line(BuildProgress(0, 750, None, 3.0, None))
    assert log.getvalue().splitlines() == [
        "training the default model: importing torch ..., 0:00 elapsed",
        "training the default model: loading the random model ..., 0:02 elapsed",
        "training the default model: step 0/750 (0%), 0:03 elapsed, starting",
    ]
    assert terminal.getvalue().count("\r\033[K") == 4  # every beat redrawn: the elapsed time moves
    assert "importing torch ..., 0:01 elapsed" in terminal.getvalue()
