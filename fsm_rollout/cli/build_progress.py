"""Internal: the CLI's one-line progress display for a default-model build (steps, loss, elapsed and time left).

The builder (:func:`fsm_rollout.engine.local.default_model.default_model_dir`) prints nothing; it hands each
:class:`~fsm_rollout.engine.local.default_model.BuildProgress` to a callback, and the commands that build the model
pass a :class:`BuildProgressLine`. On a terminal the line is redrawn in place (carriage return); otherwise, so that a
log stays readable, a plain line is printed at the start, at every tenth of the steps and at the end. Before the
first step the line says what the build does (each phase once in a log; redrawn every second on a terminal).
"""

from __future__ import annotations

from typing import Final, TextIO

from fsm_rollout.engine.local.default_model import BuildProgress

__all__ = ["BuildProgressLine", "render_build_progress"]

_LOG_EVERY: Final = 10
"""A non-terminal stream gets a line at every 1/_LOG_EVERY of the steps."""


def _clock(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def render_build_progress(progress: BuildProgress) -> str:
    """One line: the step of the total and its share, the step's loss, time elapsed and the estimate left (before
    the first step: what the build is doing and the time elapsed)."""
    if progress.phase is not None:
        return f"training the default model: {progress.phase} ..., {_clock(progress.elapsed_s)} elapsed"
    head = f"training the default model: step {progress.step}/{progress.steps}"
    if progress.steps > 0:
        head += f" ({100 * progress.step // progress.steps}%)"
    parts = [head]
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.3f}")
    parts.append(f"{_clock(progress.elapsed_s)} elapsed")
    if progress.step >= progress.steps:
        parts.append("done")
    elif progress.remaining_s is not None:
        parts.append(f"about {_clock(progress.remaining_s)} left")
    else:
        parts.append("starting")
    return ", ".join(parts)


class BuildProgressLine:
    """A progress callback that draws :func:`render_build_progress` on ``stream``.

    ``interactive`` (default: ``stream.isatty()``) redraws one line with a carriage return and ends it with a
    newline at the last step; otherwise plain lines are written at step 0, whenever another tenth of the steps is
    done, and at the last step.
    """

    def __init__(self, stream: TextIO, *, interactive: bool | None = None) -> None:
        self._stream = stream
        self._interactive = stream.isatty() if interactive is None else interactive
        self._logged_tenth = -1
        self._phase: str | None = None

    def __call__(self, progress: BuildProgress) -> None:
        line = render_build_progress(progress)
        if progress.phase is not None:  # a terminal redraws each beat; a log gets each phase once
            if self._interactive:
                self._stream.write("\r\033[K" + line)
            elif progress.phase != self._phase:
                self._stream.write(line + "\n")
            self._phase = progress.phase
            self._stream.flush()
            return
        done = progress.step >= progress.steps
        if self._interactive:
            self._stream.write("\r\033[K" + line + ("\n" if done else ""))
            self._stream.flush()
            return
        tenth = _LOG_EVERY * progress.step // progress.steps if progress.steps > 0 else _LOG_EVERY
        if tenth > self._logged_tenth or done:
            self._logged_tenth = tenth
            self._stream.write(line + "\n")
            self._stream.flush()
