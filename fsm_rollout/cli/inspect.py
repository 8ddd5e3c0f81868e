"""``fsm-rollout inspect``: what a recorded run did — a batch summary, or one sample's timeline.

What the command shows and its exit codes are in :data:`EPILOG` (printed by ``--help`` and in the README). The
summarising and rendering below serve only this command, so they live here rather than in the library.

Why this module is long: the batch summary and the timeline (its transitions, turns, observations and, for a rollout
that forked, its earlier sequences) share one tape reading and one painter, and serve only this command.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsm_rollout.cli.common import use_color

if TYPE_CHECKING:
    from fsm_rollout.recording import LineProblem, TapeFile, TapeSample
    from fsm_rollout.replay import TracedPath

EXIT_OK, EXIT_UNUSABLE = 0, 2

EPILOG = """\
Without --sample it summarises the trace: samples per status and reason, a histogram of turns per sample, token
statistics, and how long samples dwelt in each state (p50/p95). --sample ID shows that sample's timeline: every
transition with its time and dwell, and, when the run was recorded with a tape, per turn the model's decoded text,
the environment's answer and the observation appended after it, with the sample's prompt, label and the reward it
ended with (an environment's answer to one turn is not the reward: Geo3K's reward is the episode's best score).
A group id (7) shows each of its members (7.0, 7.1, ...); an unknown id lists the ids there are. Trainable tokens
(loss mask 1) are shown apart from masked ones: green and dim in a terminal, masked text in ⟦…⟧ when the output
is piped. A rollout that forked shows its earlier training sequences (branches) first, then its last one.
--tree RESULTS (no TRACE) prints the token tree of a results file instead: its tokens against flat rows, the
provenance splits by cause and each node's positions and sharing (--share group, all or none).

Exit codes: 0 shown; 2 unusable input (missing file, not a trace, another schema version, unknown sample)."""
MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
_GREEN, _DIM, _BOLD, _RESET = "\033[32m", "\033[2m", "\033[1m", "\033[0m"
_BAR_WIDTH = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fsm-rollout inspect``."""
    parser.epilog = EPILOG
    parser.add_argument("trace", type=Path, nargs="?", metavar="TRACE", help="the transition trace (JSONL), or a tape")
    parser.add_argument(
        "--tree",
        type=Path,
        metavar="RESULTS",
        help="instead, print the token tree of a results file (Sample.to_dict() per line): node spans, sharing "
        "and provenance splits",
    )
    parser.add_argument(
        "--share", choices=["group", "all", "none"], default="group", help="with --tree: what may share a prefix"
    )
    parser.add_argument(
        "--tape", type=Path, metavar="FILE", help="the I/O tape (default: beside the trace), for decoded text"
    )
    parser.add_argument(
        "--sample",
        metavar="ID",
        help="show this sample's timeline instead of the batch summary; a sample id that ran "
        "more than once shows every run, named ID#1, ID#2, ... (give ID#N for one of them); "
        "a group id (7) shows its members (7.0, 7.1, ...)",
    )
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer for decoding text (default: the one the recording used)"
    )
    parser.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour trainable/masked text (default: when printing to a terminal)",
    )


# ---------------------------------------------------------------------------------------------------- summary


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` in [0, 1]) of non-empty ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass
class BatchSummary:
    """What a trace says about its samples, in aggregate."""

    runs: int = 0
    unfinished: int = 0
    transitions: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    turns: Counter[int] = field(default_factory=Counter)
    prompt_tokens: list[float] = field(default_factory=list)
    generated_tokens: list[float] = field(default_factory=list)
    response_tokens: list[float] = field(default_factory=list)
    dwell_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    queued_ms: list[float] = field(default_factory=list)
    """How long samples waited for a concurrency slot before their rollout started (``queued_ms`` of their first
    transition): apart from the ``pending`` dwell, which is the rollout's own work."""
    admission_ms: list[float] = field(default_factory=list)
    """How long each admission wait of adaptive admission took (``admission_ms`` of the transition it delayed: a
    new sample's first, or an edge into ``generating``), apart from ``queued_ms`` and included in the dwell."""
    staleness_ms: list[float] = field(default_factory=list)
    """How long staleness pacing (``max_staleness``) held samples back before they queued (first transition's)."""
    forks: int = 0
    """``fork`` edges taken: training sequences closed because the history was rewritten."""
    forked_runs: int = 0
    """Sample runs that forked at least once."""
    lineages: list[dict[str, Any]] | None = None
    """Gateway sessions with several lineages, each lineage's sequences and fork reasons (``lineage_groups``)."""


def summarize(paths: Sequence[TracedPath]) -> BatchSummary:
    """Aggregate the paths of a trace (see :class:`BatchSummary`)."""
    from fsm_rollout.replay.paths import lineage_groups

    summary = BatchSummary(runs=len(paths), lineages=lineage_groups(paths))
    for path in paths:
        summary.transitions += len(path.events)
        if path.status is None:
            summary.unfinished += 1
        else:
            summary.statuses[path.status] += 1
            summary.reasons[path.status][path.reason or "-"] += 1
        summary.turns[path.turns] += 1
        generated = 0
        forks = sum(1 for event in path.events if event.get("trigger") == "fork" and event.get("dst") == "rendered")
        summary.forks += forks
        summary.forked_runs += forks > 0
        for event in path.events:
            if event.get("trigger") == "render" and isinstance(event.get("prompt_tokens"), int):
                summary.prompt_tokens.append(event["prompt_tokens"])
            if isinstance(event.get("generated_tokens"), int):
                generated += event["generated_tokens"]
            dwell = event.get("dwell_ms")
            if isinstance(dwell, int | float) and isinstance(event.get("src"), str):
                summary.dwell_ms[event["src"]].append(float(dwell))
            queued = event.get("queued_ms")
            if isinstance(queued, int | float) and not isinstance(queued, bool):
                summary.queued_ms.append(float(queued))
            admitted = event.get("admission_ms")
            if isinstance(admitted, int | float) and not isinstance(admitted, bool):
                summary.admission_ms.append(float(admitted))
            paced = event.get("staleness_ms")
            if isinstance(paced, int | float) and not isinstance(paced, bool):
                summary.staleness_ms.append(float(paced))
        summary.generated_tokens.append(generated)
        if path.events and isinstance(path.events[-1].get("response_length"), int):
            summary.response_tokens.append(path.events[-1]["response_length"])
    return summary


def render_summary(name: str, summary: BatchSummary, problems: Sequence[LineProblem], orphans: int = 0) -> str:
    """The batch summary as text (``orphans``: transitions without a sample id, counted in no sample)."""
    lines = [
        f"{name}: {summary.runs} sample run(s) ({summary.runs - summary.unfinished} finished, "
        f"{summary.unfinished} unfinished), {summary.transitions} transitions, "
        f"{sum(turns * count for turns, count in summary.turns.items())} turns, {summary.forks} fork(s) in "
        f"{summary.forked_runs} sample run(s) ({summary.runs + summary.forks} training sequences)",
        "",
        f"{'status':<12}{'count':>6}   reasons",
    ]
    for status, count in summary.statuses.most_common():
        reasons = ", ".join(f"{reason} {n}" for reason, n in summary.reasons[status].most_common())
        lines.append(f"{status:<12}{count:>6}   {reasons}")
    if summary.unfinished:
        lines.append(f"{'unfinished':<12}{summary.unfinished:>6}")
    lines += ["", "turns per sample"]
    widest = max(summary.turns.values(), default=1)
    for turns in sorted(summary.turns):
        count = summary.turns[turns]
        bar = "█" * max(1, round(count / widest * _BAR_WIDTH))
        lines.append(f"{turns:>6} │{bar} {count}")
    lines += ["", f"{'tokens per sample':<20}{'mean':>9}{'p50':>9}{'p95':>9}{'max':>9}"]
    for label, values in (
        ("prompt", summary.prompt_tokens),
        ("generated", summary.generated_tokens),
        ("response side", summary.response_tokens),
    ):
        if values:
            lines.append(
                f"  {label:<18}{sum(values) / len(values):>9.1f}{percentile(values, 0.5):>9.0f}"
                f"{percentile(values, 0.95):>9.0f}{max(values):>9.0f}"
            )
    lines += ["", f"{'dwell per state (ms)':<20}{'n':>7}{'p50':>10}{'p95':>10}"]
    from fsm_rollout.machine.lifecycle import STATE_BY_NAME

    order = list(STATE_BY_NAME)
    for state in sorted(summary.dwell_ms, key=lambda name: (order.index(name) if name in order else len(order), name)):
        values = summary.dwell_ms[state]
        lines.append(f"  {state:<18}{len(values):>7}{percentile(values, 0.5):>10.2f}{percentile(values, 0.95):>10.2f}")
    if summary.queued_ms:
        values = summary.queued_ms
        lines.append(
            f"  {'queued for a slot':<18}{len(values):>7}{percentile(values, 0.5):>10.2f}"
            f"{percentile(values, 0.95):>10.2f}   (before pending: waiting for a concurrency slot)"
        )
    for name, values, why in (
        ("admission wait", summary.admission_ms, "adaptive admission: waiting for the engine to take a request"),
        ("staleness wait", summary.staleness_ms, "max_staleness: waiting for the trainer to consume"),
    ):
        if values:
            lines.append(f"  {name:<18}{len(values):>7}{percentile(values, 0.5):>10.2f}"
                         f"{percentile(values, 0.95):>10.2f}   ({why})")  # fmt: skip
    for group in summary.lineages or ():
        shown = "; ".join(
            f"lineage {each['lineage']} {each['sequences']} sequence(s)"
            + (f" ({', '.join(f'{reason} {n}' for reason, n in each['forks'].items())})" if each["forks"] else "")
            for each in group["lineages"]
        )
        lines += ["", f"gateway session {group['session']}: {shown}"]
    if orphans:
        lines += [
            "",
            f"{orphans} transition(s) without sample_id (samples aborted before they started) are not counted above",
        ]
    if problems:
        lines += ["", "unreadable lines (skipped):"]
        lines.extend(f"    {problem}" for problem in problems)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Segment:
    """A stretch of one sample's response side: the model's turn, or what was appended after it."""

    turn: int
    kind: str
    """``model`` (a generated turn, with a masked EOS when one was appended) or ``observation``."""
    start: int
    end: int


def response_segments(record: TapeSample) -> list[Segment]:
    """The last sequence's response side cut into turns and observations, from the response length after each
    transition (a fork starts a new sequence: the segments before it are a branch's)."""
    segments: list[Segment] = []
    previous = 0
    for event in record.transitions:
        length = event.get("response_length")
        turn = event.get("turn")
        if event.get("trigger") == "fork" and event.get("dst") == "rendered":
            segments, previous = [], 0  # what came before is an earlier sequence's (a branch's)
            continue
        if not isinstance(length, int) or not isinstance(turn, int):
            continue
        if length > previous:
            if event.get("trigger") == "step":
                segments.append(Segment(turn, "model", previous, length))
            elif event.get("trigger") == "generate" and event.get("src") == "observing":
                segments.append(Segment(turn - 1, "observation", previous, length))
        previous = length
    return segments


class Painter:
    """Renders token runs: trainable plain or green, masked in ``⟦…⟧`` or dim."""

    def __init__(self, color: bool) -> None:
        self.color = color

    def trainable(self, text: str) -> str:
        return f"{_GREEN}{text}{_RESET}" if self.color else text

    def masked(self, text: str) -> str:
        return f"{_DIM}{text}{_RESET}" if self.color else f"{MASK_OPEN}{text}{MASK_CLOSE}"

    def bold(self, text: str) -> str:
        return f"{_BOLD}{text}{_RESET}" if self.color else text


def render_tokens(
    tokens: Sequence[int], mask: Sequence[int], tokenizer: Any, painter: Painter, *, image_token: int | None = None
) -> str:
    """Decoded text of ``tokens``, with each run of equal loss mask painted as trainable or masked; a run of the
    image placeholder ``image_token`` is marked as one ``[image: N tokens]`` span instead of N placeholders."""
    parts: list[str] = []
    start = 0
    while start < len(tokens):
        end = start
        image = image_token is not None and tokens[start] == image_token
        while end < len(tokens) and mask[end] == mask[start] and (tokens[end] == image_token) == image:
            end += 1
        if image:
            text = painter.bold(f"[image: {end - start} tokens]")
        else:
            text = str(tokenizer.decode(list(tokens[start:end]), skip_special_tokens=False)).replace("\n", "\n      ")
        parts.append(painter.trainable(text) if mask[start] else painter.masked(text))
        start = end
    return "".join(parts)


def render_timeline(
    path: TracedPath,
    record: TapeSample | None,
    tape: TapeFile | None,
    tokenizer: Any,
    painter: Painter,
    *,
    from_trace: bool,
) -> str:
    """One sample run: its transitions with times, then per turn the decoded text (when the tape has it)."""
    outcome = f"{path.status}/{path.reason}" if path.status else "unfinished"
    where = f"trace lines {path.lines[0]}-{path.lines[-1]}" if from_trace and path.lines else "from the tape"
    lines = [
        painter.bold(f"sample {path.label or path.sample_id}") + f"  {outcome}, {path.turns} turn(s), "
        f"{len(path.events)} transitions ({where})"
    ]
    if path.session_id:
        from fsm_rollout.replay.paths import lineage_of

        run, lineage = lineage_of(path.sample_id)
        of = f", lineage {lineage} of {run} (lineage l0)" if run != str(path.sample_id) else ""
        lines.append(f"  session {path.session_id}{of}")
    first_ts = path.events[0].get("ts") if path.events else None
    for event in path.events:
        ts = event.get("ts")
        at = f"+{ts - first_ts:8.3f}s" if isinstance(ts, float) and isinstance(first_ts, float) else " " * 10
        dwell = event.get("dwell_ms")
        dwell_text = f"{dwell:9.2f} ms" if isinstance(dwell, int | float) else " " * 12
        arrow = f"{event.get('src')} --{event.get('trigger')}--> {event.get('dst')}"
        lines.append(f"  {at} {dwell_text}  turn {event.get('turn')}  {arrow:<40} {_event_summary(event)}")
    if record is None or tape is None:
        lines.append("  (no tape for this sample: record with `fsm-rollout run --record` to see the text)")
        return "\n".join(lines)
    lines[1:1] = _sample_lines(record, tape)
    lines.extend(_turn_lines(record, tape, tokenizer, painter))
    lines.append(painter.bold(f"  reward {_reward(record)}") + f"  ({outcome})")
    return "\n".join(lines)


def _sample_lines(record: TapeSample, tape: TapeFile) -> list[str]:
    """The sample's prompt and label, as the tape recorded the sample at its start."""
    from fsm_rollout.replay import revive

    sample = revive(tape.resolve(record.sample))
    if not isinstance(sample, dict):
        return []
    prompt = sample.get("prompt")
    for entry in record.io:  # an adapted environment gives the prompt when it is built (its first observation)
        if entry.get("op") == "env_build" and "sample_prompt" in entry:
            prompt = revive(tape.resolve(entry["sample_prompt"]))
    return [f"  prompt: {_clip(_prompt_text(prompt), 400)}", f"  label: {sample.get('label')!r}"]


def _prompt_text(prompt: Any) -> str:
    """A prompt (a string, or chat messages whose content is text or parts) as one line of text."""
    if isinstance(prompt, str):
        return prompt.replace("\n", " ")
    if not isinstance(prompt, list):
        return repr(prompt)
    parts = []
    for message in prompt:
        if not isinstance(message, dict):
            parts.append(repr(message))
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) if isinstance(part, dict) and part.get("type") == "text"
                               else f"<{part.get('type', 'part')}>" if isinstance(part, dict) else str(part)
                               for part in content)  # fmt: skip
        parts.append(f"[{message.get('role')}] {content}".replace("\n", " "))
    return " ".join(parts)


def _reward(record: TapeSample) -> str:
    """The reward the sample ended with (the environment's, or ``reward_fn``'s), as the tape's result holds it."""
    if "reward" not in record.result:
        return "not recorded (a tape from before rewards were kept)"
    return repr(record.result["reward"])


def _event_summary(event: dict[str, Any]) -> str:
    keys = (
        "prompt_tokens",
        "generated_tokens",
        "finish",
        "eos_inserted",
        "observation_tokens",
        "response_length",
        "remaining_budget",
        "reason",
        "branch",
        "error_type",
        "error",
    )
    return "  ".join(f"{key}={event[key]}" for key in keys if event.get(key) not in (None, False, []))


def _turn_lines(record: TapeSample, tape: TapeFile, tokenizer: Any, painter: Painter) -> list[str]:
    from fsm_rollout.recording.format import RecordingFormatError, answer_token_ids, expand_run_lengths, expand_tokens
    from fsm_rollout.replay import revive

    base: list[int] = []
    steps: list[dict[str, Any]] = []
    observations: list[dict[str, Any]] = []
    for entry in record.io:
        if entry["op"] == "generate" and isinstance(entry.get("tokens"), dict):
            base = expand_tokens(entry["tokens"], base)
        elif entry["op"] == "render":
            ids = answer_token_ids(entry.get("answer"))
            base = list(ids) if ids is not None else base
        elif entry["op"] == "step":
            steps.append(entry)
        elif entry["op"] == "format_observation":
            observations.append(entry)
    result = record.result
    try:
        tokens = expand_tokens(result["tokens"], base)
    except (RecordingFormatError, KeyError, TypeError):
        return ["  (the tape's result has no readable tokens)"]
    mask = expand_run_lengths(result.get("loss_mask")) or []
    prompt_length = result.get("prompt_length") if isinstance(result.get("prompt_length"), int) else None
    if prompt_length is None:
        return ["  (the sample ended before its prompt was rendered: no response)"]
    response = tokens[prompt_length:]
    legend = (
        "trainable text is green, masked (loss mask 0) text is dim"
        if painter.color
        else f"masked (loss mask 0) text is in {MASK_OPEN}…{MASK_CLOSE}; the rest is trainable"
    )
    lines = _branch_lines(result, tokenizer, painter)
    lines += [
        "",
        f"  prompt: {prompt_length} tokens; response side: {len(response)} tokens "
        f"({sum(mask)} trainable, {len(mask) - sum(mask)} masked) — {legend}",
    ]
    from fsm_rollout.multimodal import IMAGE_PAD_TOKEN, image_pad_token_id, without_image_data

    placeholder = record.config.get("image_placeholder_token") or IMAGE_PAD_TOKEN
    image_token = image_pad_token_id(tokenizer, placeholder) if tokenizer is not None else None
    for segment in response_segments(record):
        ids = response[segment.start : segment.end]
        seg_mask = mask[segment.start : segment.end]
        text = (
            render_tokens(ids, seg_mask, tokenizer, painter, image_token=image_token)
            if tokenizer is not None
            else f"{len(ids)} tokens"
        )
        if segment.kind == "model":
            lines += [
                "",
                painter.bold(f"  turn {segment.turn}"),
                f"    model ({sum(seg_mask)} trainable, {len(seg_mask) - sum(seg_mask)} masked): {text}",
            ]
            if segment.turn < len(steps):
                step = steps[segment.turn]
                outcome = step.get("result") or {}
                if isinstance(outcome.get("step"), dict):  # tape schema 3 wraps the typed step
                    outcome = outcome["step"]
                if "error" in step:
                    lines.append(f"    env.step raised {step['error'].get('type')}: {step['error'].get('message')}")
                elif "done" in outcome:
                    observation = revive(tape.resolve(outcome.get("observation")))
                    lines.append(f"    env.step → done={outcome['done']}, observation {_clip(repr(observation))}")
        else:
            message = ""
            if segment.turn < len(observations):
                content = without_image_data(revive(tape.resolve(observations[segment.turn].get("message"))))
                message = f" from {_clip(repr(content))}"
            lines.append(f"    observation ({len(ids)} masked){message}: {text}")
    return lines


def _branch_lines(result: dict[str, Any], tokenizer: Any, painter: Painter) -> list[str]:
    """The earlier training sequences of a rollout that forked (``sample.branches``), oldest first."""
    from fsm_rollout.recording.format import expand_run_lengths

    lines: list[str] = []
    for number, branch in enumerate(result.get("branches") or ()):
        tokens = branch.get("tokens") or []
        prompt_length = branch.get("prompt_length") or 0
        mask = expand_run_lengths(branch.get("loss_mask")) or []
        response = tokens[prompt_length:]
        text = render_tokens(response, mask, tokenizer, painter) if tokenizer is not None else f"{len(response)} tokens"
        lines += [
            "",
            painter.bold(f"  branch {number}")
            + f" (an earlier sequence, closed by a fork): prompt {prompt_length} tokens; response side "
            f"{len(response)} tokens ({sum(mask)} trainable, {len(mask) - sum(mask)} masked)",
            f"    {text}",
        ]
    if lines:
        lines += ["", painter.bold(f"  sequence {len(result['branches'])} (the sample itself)")]
    return lines


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


# ---------------------------------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> int:
    """Run ``fsm-rollout inspect``."""
    from fsm_rollout.errors import RolloutError
    from fsm_rollout.replay import load_recording, paths_from_tape

    if args.tree is not None:
        from fsm_rollout.cli.inspect_tree import show_tree

        return show_tree(args.tree, args.share, limit=200)
    if args.trace is None:
        print("error: give a TRACE (or --tree RESULTS)", file=sys.stderr)
        return EXIT_UNUSABLE
    try:
        path, trace, tape = load_recording(args.trace, args.tape, tape_wanted=args.sample is not None)
    except RolloutError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    paths = trace.paths if trace is not None else paths_from_tape(tape) if tape is not None else []
    problems = [*(trace.problems if trace is not None else []), *(tape.problems if tape is not None else [])]
    if args.sample is None:
        orphans = len(trace.orphans) if trace is not None else 0
        print(render_summary(path.name, summarize(paths), problems, orphans))
        return EXIT_OK
    chosen = select_samples(paths, args.sample)
    if not chosen:
        print(f"error: {path} has no sample {args.sample!r}; {id_listing(paths)}", file=sys.stderr)
        return EXIT_UNUSABLE
    wanted_ids = {item.sample_id for item in chosen}
    records = [record for record in tape.samples if record.sample_id in wanted_ids] if tape is not None else []
    tokenizer = _tokenizer(args.tokenizer, records) if records else None
    painter = Painter(use_color(args.color))
    blocks = []
    for index, item in enumerate(chosen):
        record = _record_for(item, records, index)
        blocks.append(render_timeline(item, record, tape, tokenizer, painter, from_trace=trace is not None))
    print("\n\n".join(blocks))
    return EXIT_OK


def _group_member(sample_id: str | None, group: str) -> bool:
    """Whether ``sample_id`` names a member of group ``group`` (``7.0`` … ``7.3`` of ``7``)."""
    if sample_id is None or not sample_id.startswith(group + "."):
        return False
    return sample_id[len(group) + 1 :].isdigit()


def select_samples(paths: Sequence[TracedPath], wanted: str) -> list[TracedPath]:
    """The runs ``wanted`` names: a run label (``7.2#2``), a sample id (every run of it), else a group id (its
    members, ``7`` for ``7.0`` … ``7.3``)."""
    exact = [item for item in paths if wanted in (item.label, item.sample_id)]
    return exact or [item for item in paths if _group_member(item.sample_id, wanted)]


def _natural(sample_id: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in sample_id.split("."))


def id_listing(paths: Sequence[TracedPath], limit: int = 12) -> str:
    """The sample ids a recording has, groups of members shortened (``7.0-7.3``), for an unknown ``--sample``."""
    ids = sorted({item.sample_id for item in paths if item.sample_id is not None}, key=_natural)
    if not ids:
        return "it names no sample"
    groups: dict[str, list[str]] = {}
    for sample_id in ids:
        head, _, member = sample_id.rpartition(".")
        groups.setdefault(head if head and member.isdigit() else sample_id, []).append(sample_id)
    shown = [members[0] if len(members) == 1 else f"{members[0]}-{members[-1]}" for members in groups.values()]
    more = f", … ({len(shown) - limit} more)" if len(shown) > limit else ""
    grouped = any(len(members) > 1 for members in groups.values())
    hint = "; a group id (the part before the last dot) shows all its members" if grouped else ""
    return f"it has {len(ids)} sample id(s): {', '.join(shown[:limit])}{more}{hint}"


def _record_for(path: TracedPath, records: Sequence[TapeSample], index: int) -> TapeSample | None:
    if path.rollout_uid is not None:  # the exact record of this run
        return next((record for record in records if record.rollout_uid == path.rollout_uid), None)
    triples = path.triples()
    for record in records:
        if [(e.get("src"), e.get("trigger"), e.get("dst")) for e in record.transitions] == triples:
            return record
    return records[index] if index < len(records) else None


def _tokenizer(explicit: str | None, records: Sequence[TapeSample]) -> Any:
    from fsm_rollout.recording import RecordingFormatError
    from fsm_rollout.replay import load_recorded_tokenizer

    try:
        return load_recorded_tokenizer(records, explicit)
    except RecordingFormatError as error:
        print(f"note: {error}; showing token counts only", file=sys.stderr)
        return None
