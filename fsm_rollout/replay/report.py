"""What a replay found: one :class:`SampleReport` per recorded sample run, gathered in a :class:`ReplayReport`,
which renders as text or JSON and gives the exit code of ``fsm-rollout replay``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from fsm_rollout.recording.format import jsonable
from fsm_rollout.recording.reader import LineProblem
from fsm_rollout.replay.compare import Divergence

Verdict = Literal["identical", "legal", "diverged", "illegal", "unfinished", "damaged"]
VERDICTS: tuple[Verdict, ...] = ("identical", "legal", "diverged", "illegal", "unfinished", "damaged")
"""Per-sample outcomes, from best to worst. ``legal``: checked only (not re-executed)."""
FAILING_VERDICTS = frozenset({"diverged", "illegal", "unfinished", "damaged"})

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_UNUSABLE = 0, 1, 2


@dataclass
class SampleReport:
    """What replay found for one recorded sample run."""

    sample_id: str | None
    session_id: str | None
    status: str | None
    reason: str | None
    verdict: Verdict
    findings: list[str] = field(default_factory=list)
    divergence: Divergence | None = None
    turns: int = 0
    """Turns of the recorded path."""
    turns_replayed: int | None = None
    """Turns today's rollout ran in the re-execution (None: not re-executed); fewer than :attr:`turns` when it
    stopped at a divergence."""
    trace_lines: tuple[int, int] | None = None
    tape_line: int | None = None
    notes: list[str] = field(default_factory=list)
    rollout_uid: str | None = None
    """Unique to the run (None in recordings made before it existed)."""
    label: str = ""
    """The sample id, with ``#N`` for its N-th run when the id ran more than once."""

    @property
    def failing(self) -> bool:
        """Whether this sample makes the replay exit non-zero."""
        return self.verdict in FAILING_VERDICTS


@dataclass
class ReplayReport:
    """Everything one replay found; :attr:`exit_code` is what ``fsm-rollout replay`` exits with."""

    trace: Path | None
    tape: Path | None
    samples: list[SampleReport] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    executed: bool = False
    turns_executed: int = 0
    seconds: float = 0.0
    """Wall time of the re-execution."""
    cpu_seconds: float = 0.0
    """CPU time of the re-execution (this process)."""

    @property
    def exit_code(self) -> int:
        """0 when every sample is identical (or legal, when only checked) and every input line was readable; else 1."""
        failing = self.problems or any(sample.failing for sample in self.samples)
        return EXIT_DIVERGED if failing else EXIT_IDENTICAL

    @property
    def identical(self) -> bool:
        """Whether nothing failed."""
        return self.exit_code == EXIT_IDENTICAL

    def counts(self) -> dict[str, int]:
        """Samples per verdict, in :data:`VERDICTS` order."""
        found = {verdict: 0 for verdict in VERDICTS}
        for sample in self.samples:
            found[sample.verdict] += 1
        return {verdict: count for verdict, count in found.items() if count}

    def sample(self, sample_id: str) -> SampleReport:
        """The report of a run label (``3#2``), else the first of a sample id."""
        for sample in self.samples:
            if sample.label == sample_id:
                return sample
        for sample in self.samples:
            if sample.sample_id == sample_id:
                return sample
        raise KeyError(sample_id)

    @property
    def turns_per_second(self) -> float:
        """Re-executed turns per second of wall time."""
        return self.turns_executed / self.seconds if self.seconds > 0 else 0.0

    @property
    def turns_per_cpu_second(self) -> float:
        """Re-executed turns per CPU second (the speed on one core, whatever else the machine runs)."""
        return self.turns_executed / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-compatible data."""
        data = dataclasses.asdict(self)
        data["trace"] = None if self.trace is None else str(self.trace)
        data["tape"] = None if self.tape is None else str(self.tape)
        data["problems"] = [str(problem) for problem in self.problems]
        data["exit_code"] = self.exit_code
        data["counts"] = self.counts()
        converted: dict[str, Any] = jsonable(data)
        return converted

    def render(self, *, color: bool = False, verbose: bool = False) -> str:
        """The report as text: a summary line, then every sample that is not fine (all with ``verbose``)."""
        paint = _painter(color)
        lines = [self._headline()]
        counts = "  ".join(
            f"{paint(verdict, _VERDICT_COLOR[verdict])} {count}" for verdict, count in self.counts().items()
        )
        lines.append(counts or "no samples matched")
        for sample in self.samples:
            if verbose or sample.failing or sample.notes:
                lines.extend(render_sample(sample, paint, verbose=verbose))
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"    {warning}" for warning in self.warnings)
        if self.problems:
            lines.append("unreadable input lines:")
            lines.extend(f"    {problem}" for problem in self.problems)
        return "\n".join(lines)

    def _headline(self) -> str:
        sources = [str(path) for path in (self.trace, self.tape) if path is not None]
        head = f"replay of {' + '.join(sources)}: {len(self.samples)} sample run(s)"
        if self.executed:
            head += (
                f"; re-executed {self.turns_executed} turns in {self.seconds:.3f}s "
                f"({self.turns_per_cpu_second:,.0f} turns per CPU second)"
            )
        else:
            head += "; checked against today's table (not re-executed)"
        return head


_VERDICT_COLOR = {
    "identical": "32",
    "legal": "32",
    "diverged": "31",
    "illegal": "31",
    "unfinished": "33",
    "damaged": "33",
}


Paint = Callable[[str, str], str]


def _painter(color: bool) -> Paint:
    def paint(text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if color else text

    return paint


def render_sample(sample: SampleReport, paint: Paint, *, verbose: bool) -> list[str]:
    """One sample's lines of the text report: its outcome and verdict, divergence, findings and notes."""
    outcome = f"{sample.status or 'unfinished'}" + (f"/{sample.reason}" if sample.reason else "")
    where = []
    if sample.trace_lines is not None:
        where.append(f"trace lines {sample.trace_lines[0]}-{sample.trace_lines[1]}")
    if sample.tape_line is not None:
        where.append(f"tape line {sample.tape_line}")
    replayed = sample.turns_replayed
    turns = f"{sample.turns} turn(s)" + (f", {replayed} replayed" if replayed not in (None, sample.turns) else "")
    head = (
        f"sample {sample.label or sample.sample_id} [{outcome}, {turns}] "
        f"{paint(sample.verdict.upper(), _VERDICT_COLOR[sample.verdict])}"
    )
    lines = [head + (f"  ({', '.join(where)})" if where else "")]
    if sample.divergence is not None:
        lines.extend(render_divergence(sample.divergence))
    if sample.verdict != "legal" or verbose:
        lines.extend(f"    {finding}" for finding in sample.findings)
    lines.extend(f"    note: {note}" for note in sample.notes)
    return lines


def render_divergence(divergence: Divergence) -> list[str]:
    """A divergence as indented lines: where, what, expected and actual values, and the text around it."""
    at = []
    if divergence.turn is not None:
        at.append(f"turn {divergence.turn}")
    if divergence.state is not None:
        at.append(f"state {divergence.state}")
    if divergence.line is not None:
        at.append(f"line {divergence.line}")
    lines = [f"    {divergence.kind}" + (f" at {', '.join(at)}" if at else "") + f": {divergence.message}"]
    if divergence.expected is not None or divergence.actual is not None:
        lines.append(f"      expected: {_short(divergence.expected)}")
        lines.append(f"      actual:   {_short(divergence.actual)}")
    if divergence.context is not None:
        context = divergence.context
        lines.append(f"      text before: {'…' + repr(context.before)}")
        lines.append(f"      recorded:    {repr(context.expected) + '…'}")
        lines.append(f"      today:       {repr(context.actual) + '…'}")
    return lines


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=repr).decode()
    return text if len(text) <= limit else text[:limit] + "…"


__all__ = [
    "EXIT_DIVERGED",
    "EXIT_IDENTICAL",
    "EXIT_UNUSABLE",
    "FAILING_VERDICTS",
    "VERDICTS",
    "ReplayReport",
    "SampleReport",
    "Verdict",
]
