"""One sample run's page, as JSON-ready data: its timeline, its conversation and its token strip.

The timeline comes from the trace (every sample has one). The conversation and the token strip come from the tape
record when there is one: the messages the render request sent (prompt and images as the model saw them), each
turn's decoded text cut into thinking, tool calls and text, the environment's answer and the observation appended
after it, the reward; and the sequence's tokens with their loss mask, rollout logprobs, weight versions, the
inserted EOS and image spans. Without a tape the results row (``Sample.to_dict()``) gives what it has: prompt,
response, label, reward and the token arrays, with ``sample.branches`` as earlier sequences.

Every string here is data, put in the page as JSON and shown as text by the page's script.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsm_rollout.machine import lifecycle
from fsm_rollout.recording.format import RecordingFormatError, answer_token_ids, expand_run_lengths, expand_tokens

EVENT_DETAIL_KEYS = (
    "prompt_tokens",
    "generated_tokens",
    "finish",
    "eos_inserted",
    "observation_tokens",
    "response_length",
    "remaining_budget",
    *("queued_ms", "admission_ms", "staleness_ms"),
    "suspend_reason",
    "suspended_ms",
    "weight_version",
    "partial_tokens",
    "branch",
    "failed_trigger",
    "error_type",
    "error",
)
"""Transition fields shown beside each step of the timeline, when set."""
_DETAIL_ORDER = {key: position for position, key in enumerate(EVENT_DETAIL_KEYS)}

_PARTS = re.compile(r"(<think>.*?(?:</think>|$)|<tool_call>.*?(?:</tool_call>|$))", re.DOTALL)
_IMAGE_OPEN, _IMAGE_CLOSE = "<|vision_start|>", "<|vision_end|>"
_LOGPROB_DIGITS = 4


def timeline(path: Any) -> list[dict[str, Any]]:
    """The run's transitions: seconds since its first, dwell, the edge, its turn and the fields worth showing."""
    first = next((event["ts"] for event in path.events if isinstance(event.get("ts"), float)), None)
    rows = []
    for event in path.events:
        ts = event.get("ts")
        # the few detail keys an event has, in the order shown (most events have one or two of the many)
        present = sorted(_DETAIL_ORDER.keys() & event.keys(), key=_DETAIL_ORDER.__getitem__)
        shown = [(key, _short(event[key])) for key in present if event[key] not in (None, False)]
        rows.append(
            {
                "at": round(ts - first, 4) if isinstance(ts, float) and first is not None else None,
                "dwell_ms": event.get("dwell_ms"),
                "src": event.get("src"),
                "trigger": event.get("trigger"),
                "dst": event.get("dst"),
                "turn": event.get("turn"),
                "reason": event.get("reason"),
                "terminal": event.get("dst") in lifecycle.TERMINAL,
                "detail": shown,
            }
        )
    return rows


def message_parts(text: str) -> list[dict[str, str]]:
    """A model turn's text cut into ``think``, ``tool_call`` and ``text`` parts, in order."""
    parts = []
    for piece in _PARTS.split(text):
        if not piece:
            continue
        kind = "think" if piece.startswith("<think>") else "tool_call" if piece.startswith("<tool_call>") else "text"
        parts.append({"kind": kind, "text": piece})
    return parts


def content_parts(content: Any) -> list[dict[str, str]]:
    """A chat message's content as ``text`` and ``image`` parts (images only as ``data:image/`` URLs, which load
    nothing from anywhere; any other image is named, not shown)."""
    if isinstance(content, str):
        return [{"kind": "text", "text": content}]
    if not isinstance(content, list):
        return [{"kind": "text", "text": repr(content)}]
    parts = []
    for part in content:
        if not isinstance(part, dict):
            parts.append({"kind": "text", "text": repr(part)})
        elif part.get("type") == "text":
            parts.append({"kind": "text", "text": str(part.get("text", ""))})
        elif part.get("type") in ("image_url", "image"):
            url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else part.get("image")
            parts.append(image_part(url))
        else:
            parts.append({"kind": "text", "text": repr(part)})
    return parts


def image_part(url: Any) -> dict[str, str]:
    """An image as a part: shown when it is inline (``data:image/...``), else named."""
    if isinstance(url, str) and url.startswith("data:image/"):
        return {"kind": "image", "url": url}
    return {"kind": "text", "text": f"[image {str(url)[:120]!s}]"}


def _short(value: Any, limit: int = 300) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "\u2026"
    if isinstance(value, list | dict):
        return _short(repr(value), limit)
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


# ---------------------------------------------------------------------------------------------------- tape


def recorded_tokens(record: Any) -> list[int] | None:
    """The record's final token list (its result's token delta over the last generate request's tokens)."""
    base: list[int] = []
    try:
        for entry in record.io:
            if entry["op"] == "generate" and isinstance(entry.get("tokens"), dict):
                base = expand_tokens(entry["tokens"], base)
            elif entry["op"] == "render":
                ids = answer_token_ids(entry.get("answer"))
                base = list(ids) if ids is not None else base
        tokens = record.result.get("tokens")
        return expand_tokens(tokens, base) if isinstance(tokens, dict) else None
    except RecordingFormatError:
        return None


def conversation_from_tape(record: Any, tape: Any) -> dict[str, Any]:
    """Prompt messages, label, each turn (model text in parts, environment answer, observation) and reward."""
    from fsm_rollout.cli.inspect import response_segments
    from fsm_rollout.replay import revive

    def value(entry: Mapping[str, Any], key: str) -> Any:
        try:
            return revive(tape.resolve(entry.get(key)))
        except KeyError:
            return None

    sample = value({"v": record.sample}, "v") or {}
    render = next((entry for entry in record.io if entry["op"] == "render"), None)
    request = value(render, "request") if render is not None else None
    messages = request.get("messages") if isinstance(request, dict) else None
    if isinstance(messages, list):
        prompt = [{"role": str(message.get("role")), "parts": content_parts(message.get("content"))}
                  for message in messages if isinstance(message, dict)]  # fmt: skip
    else:
        prompt = [{"role": "prompt", "parts": content_parts(sample.get("prompt"))}]
    steps = [entry for entry in record.io if entry["op"] == "step"]
    observations = [entry for entry in record.io if entry["op"] == "format_observation"]
    turns = []
    for index, step in enumerate(steps):
        turn: dict[str, Any] = {"turn": index, "parts": message_parts(_text(step.get("text", "")))}
        if isinstance(step.get("error"), dict):
            turn["env"] = {"error": f"{step['error'].get('type')}: {step['error'].get('message')}"}
        elif isinstance(step.get("result"), dict) and ("done" in step["result"] or "step" in step["result"]):
            outcome = value(step, "result")
            if isinstance(outcome.get("step"), dict):  # tape schema 3: the typed step as the rollout read it
                outcome = outcome["step"]
            turn["env"] = {"done": bool(outcome.get("done")), "observation": _text(outcome.get("observation"))}
        if index < len(observations):
            message = value(observations[index], "message")
            if isinstance(message, dict):
                turn["observation"] = {"role": str(message.get("role")), "parts": content_parts(message.get("content"))}
            elif message is not None:
                turn["observation"] = {"role": "observation", "parts": content_parts(message)}
        turns.append(turn)
    for index, events in turn_events(record.transitions).items():
        if index < len(turns):
            turns[index]["events"] = events
    lengths = [segment for segment in response_segments(record) if segment.kind == "observation"]
    for segment in lengths:
        if segment.turn < len(turns):
            turns[segment.turn]["observation_tokens"] = segment.end - segment.start
    result = record.result
    error = result.get("error")
    return {
        "prompt": prompt,
        "label": None if sample.get("label") is None else _text(sample.get("label")),
        "turns": turns,
        "reward": result.get("reward"),
        "error": _text(error) if error is not None and not isinstance(error, dict) else error,
    }


def turn_events(transitions: Sequence[Mapping[str, Any]]) -> dict[int, list[str]]:
    """What happened to each turn besides generating: the fork that started it (its history rewritten, a new
    training sequence) and the suspensions it waited through, as lines of text by turn."""
    events: dict[int, list[str]] = {}
    for event in transitions:
        turn, trigger = event.get("turn"), event.get("trigger")
        if not isinstance(turn, int):
            continue
        if trigger == "fork" and event.get("dst") == "rendered":
            why = "the agent replaced earlier turns by a summary" if event.get("reason") == "compacted" else ""
            why = why or "the template wrote the history back differently"
            text = (
                f"fork ({event.get('reason')}): {why}, so the conversation was rendered again "
                f"({event.get('prompt_tokens')} prompt tokens) and this turn starts training "
                f"sequence {event.get('branch')}; the tokens before it are kept as an earlier sequence (a branch)"
            )
        elif trigger == "suspend":
            partial = event.get("partial_tokens")
            text = f"suspended ({event.get('suspend_reason')})" + (
                f" after {partial} token(s) of this turn" if isinstance(partial, int) else ""
            )
        elif trigger == "resume":
            version = event.get("weight_version")
            waited = event.get("suspended_ms")
            after = f" after {waited:.1f} ms" if isinstance(waited, int | float) else ""
            text = "resumed" + (f" on weights {version}" if version is not None else "") + after
        elif trigger == "hand_back":
            text = "handed back to the trainer while suspended (resumable)"
        else:
            continue
        events.setdefault(turn, []).append(text)
    return events


def strip_from_tape(record: Any, tokenizer: Any) -> dict[str, Any] | None:
    """The token strip of a tape record (None when the record has no readable tokens): a forked rollout's earlier
    sequences (the result's ``branches``) first, then its last one, with the boundaries between them."""
    tokens = recorded_tokens(record)
    result = record.result
    prompt_length = result.get("prompt_length")
    if tokens is None or not isinstance(prompt_length, int):
        return None
    sequences: list[tuple[list[int], int, list[int]]] = []
    for branch in result.get("branches") or []:
        if isinstance(branch, dict) and isinstance(branch.get("tokens"), list):
            length = branch.get("prompt_length")
            sequences.append((list(branch["tokens"]), length if isinstance(length, int) else 0,
                              expand_run_lengths(branch.get("loss_mask")) or []))  # fmt: skip
    sequences.append((tokens, prompt_length, expand_run_lengths(result.get("loss_mask")) or []))
    starts = list(itertools.accumulate((len(ids) for ids, _, _ in sequences[:-1]), initial=0))
    ids = [token for sequence, _, _ in sequences for token in sequence]
    mask = [bit for sequence, prompt, response in sequences for bit in [0] * prompt + response]
    logprobs: list[float] | None = None
    final_logprobs = result.get("rollout_log_probs")
    if isinstance(final_logprobs, list):
        # the last sequence's are the result's; an earlier sequence's come from its generate answers
        logprobs = [0.0] * starts[-1] + [0.0] * prompt_length + list(final_logprobs)
    versions: list[list[Any]] = []
    position = 0
    for context, turn in generated_turns(record):
        while position < len(sequences) and sequences[position][0][: len(context)] != context:
            position += 1  # a request that does not extend this sequence belongs to a later one
        if position == len(sequences):
            break
        offset = starts[position] + len(context)
        for version, start, stop in turn.meta.weight_version_spans or ():
            versions.append([offset + start, offset + stop, version])
        if logprobs is not None and position < len(sequences) - 1:
            logprobs[offset : offset + len(turn.logprobs)] = turn.logprobs
    segments: list[list[Any]] = []
    eos: list[int] = []
    for number, (pieces, steps) in enumerate(sequence_segments(record.transitions)):
        if number >= len(sequences):
            break
        base = starts[number] + sequences[number][1]
        segments += [[base + piece.start, base + piece.end, piece.kind, piece.turn] for piece in pieces]
        models = [piece for piece in pieces if piece.kind == "model"]
        response = sequences[number][2]
        eos += [
            base + piece.end - 1
            for piece, event in zip(models, steps, strict=False)
            if event.get("eos_inserted") and piece.end - 1 < len(response) and response[piece.end - 1] == 0
        ]
    return build_strip(
        ids,
        mask,
        logprobs,
        tokenizer,
        prompts=[[start, start + prompt] for start, (_, prompt, _) in zip(starts, sequences, strict=True)],
        versions=versions,
        eos=eos,
        segments=segments,
        sequences=_sequence_names(starts, sequences) if len(sequences) > 1 else [],
    )


def _sequence_names(starts: Sequence[int], sequences: Sequence[tuple[list[int], int, list[int]]]) -> list[list[Any]]:
    last = len(sequences) - 1
    return [[start, start + len(ids), "final sequence" if number == last else f"branch {number}"]
            for number, (start, (ids, _, _)) in enumerate(zip(starts, sequences, strict=True))]  # fmt: skip


def generated_turns(record: Any) -> list[tuple[list[int], Any]]:
    """Each generate request the record holds, in order: the tokens it was sent and its parsed answer (a
    :class:`~fsm_rollout.engine.schema.GeneratedTurn`; answers that do not parse are left out)."""
    from fsm_rollout.engine.schema.answers import parse_generate_response
    from fsm_rollout.errors import GenerationError

    turns = []
    base: list[int] = []
    try:
        for entry in record.io:
            if entry["op"] == "render":
                ids = answer_token_ids(entry.get("answer"))
                base = list(ids) if ids is not None else base
            elif entry["op"] == "generate" and isinstance(entry.get("tokens"), dict):
                base = expand_tokens(entry["tokens"], base)
                try:
                    turns.append((base, parse_generate_response(entry.get("answer"), "report")))
                except GenerationError:
                    continue
    except RecordingFormatError:
        return turns
    return turns


def sequence_segments(transitions: Sequence[Mapping[str, Any]]) -> list[tuple[list[Any], list[Mapping[str, Any]]]]:
    """Per training sequence (a fork starts the next): its response side cut into model turns and observations
    (:class:`~fsm_rollout.cli.inspect.Segment`), and its ``step`` transitions."""
    from fsm_rollout.cli.inspect import Segment

    sequences: list[tuple[list[Any], list[Mapping[str, Any]]]] = [([], [])]
    previous = 0
    for event in transitions:
        if event.get("trigger") == "fork" and event.get("dst") == "rendered":
            sequences.append(([], []))
            previous = 0
            continue
        if event.get("trigger") == "step":
            sequences[-1][1].append(event)
        length, turn = event.get("response_length"), event.get("turn")
        if not isinstance(length, int) or not isinstance(turn, int):
            continue
        if length > previous:
            if event.get("trigger") == "step":
                sequences[-1][0].append(Segment(turn, "model", previous, length))
            elif event.get("trigger") == "generate" and event.get("src") == "observing":
                sequences[-1][0].append(Segment(turn - 1, "observation", previous, length))
        previous = length
    return sequences


# ---------------------------------------------------------------------------------------------------- results


def conversation_from_results(row: Mapping[str, Any]) -> dict[str, Any]:
    """What a results row says of the conversation: the prompt, the whole response as one turn, label, reward."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        messages: list[dict[str, Any]] = [{"role": str(m.get("role")), "parts": content_parts(m.get("content"))}
                                          for m in prompt if isinstance(m, dict)]  # fmt: skip
    else:
        messages = [{"role": "prompt", "parts": content_parts(prompt)}]
    inputs = row.get("multimodal_inputs")
    images = inputs.get("images") if isinstance(inputs, dict) else None
    for url in images if isinstance(images, list) else []:
        messages[-1]["parts"].append(image_part(url))
    response = _text(row.get("response", ""))
    metadata = row.get("metadata")
    error = metadata.get("rollout_error") if isinstance(metadata, dict) else None
    return {
        "prompt": messages,
        "label": None if row.get("label") is None else _text(row.get("label")),
        "turns": [{"turn": None, "parts": message_parts(response)}] if response else [],
        "reward": row.get("reward"),
        "error": error,
    }


def strip_from_results(row: Mapping[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    """The token strip of a results row, with its ``branches`` (earlier sequences of a forked rollout) in front."""
    sequences = [branch for branch in row.get("branches") or [] if isinstance(branch, dict)] + [dict(row)]
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[list[Any]] = []
    boundaries: list[list[Any]] = []
    for position, sequence in enumerate(sequences):
        ids = sequence.get("tokens")
        length = sequence.get("response_length")
        if not isinstance(ids, list) or not isinstance(length, int):
            return None
        start = len(tokens)
        seq_prompt = len(ids) - length
        seq_mask = sequence.get("loss_mask") or [1] * length
        seq_logprobs = sequence.get("rollout_log_probs") or [0.0] * length
        tokens.extend(ids)
        mask.extend([0] * seq_prompt + list(seq_mask))  # prompt tokens are never trained
        logprobs.extend([0.0] * seq_prompt + list(seq_logprobs))
        metadata = sequence.get("metadata") if isinstance(sequence.get("metadata"), dict) else {}
        for span in metadata.get("weight_version_spans") or []:
            if isinstance(span, dict):
                offset = start + seq_prompt
                versions.append([offset + int(span["start"]), offset + int(span["end"]), str(span.get("version"))])
        name = "final sequence" if position == len(sequences) - 1 else f"branch {position}"
        boundaries.append([start, start + len(ids), name, seq_prompt])
    return build_strip(
        tokens,
        mask,
        logprobs,
        tokenizer,
        prompts=[[start, start + prompt] for start, _, _, prompt in boundaries],
        versions=versions,
        sequences=[[start, end, name] for start, end, name, _ in boundaries] if len(boundaries) > 1 else [],
    )


# ---------------------------------------------------------------------------------------------------- the strip


def build_strip(
    tokens: Sequence[int],
    mask: Sequence[int],
    logprobs: Sequence[float] | None,
    tokenizer: Any,
    *,
    prompts: Sequence[Sequence[int]] = (),
    versions: Sequence[Sequence[Any]] = (),
    eos: Sequence[int] = (),
    segments: Sequence[Sequence[Any]] = (),
    sequences: Sequence[Sequence[Any]] = (),
) -> dict[str, Any]:
    """The strip's arrays, every position an index into ``ids``: ``mask`` (runs of ``[value, count]``) and
    ``logprobs`` over all tokens (0 on prompt tokens), ``texts`` (id → decoded text for the ids used, when there is
    a tokenizer), ``prompts`` (``[start, end]`` of prompt tokens), ``versions`` (``[start, end, version]``),
    ``eos`` (inserted EOS tokens), ``images`` (``[start, end]`` of tokens between vision markers), ``segments``
    (``[start, end, kind, turn]``: model turns and observations) and ``sequences`` (``[start, end, name]`` of each
    training sequence when a forked rollout has several: the branch boundaries)."""
    ids = list(map(int, tokens))
    texts = decode_each(sorted(set(ids)), tokenizer) if tokenizer is not None else None
    return {
        "ids": ids,
        "mask": _run_lengths(mask),
        "logprobs": None if logprobs is None else round_all(logprobs, _LOGPROB_DIGITS),
        "texts": texts,
        "prompts": [list(span) for span in prompts],
        "versions": [list(span) for span in versions],
        "eos": list(eos),
        "images": image_spans(ids, texts) if texts is not None else [],
        "segments": [list(segment) for segment in segments],
        "sequences": [list(sequence) for sequence in sequences],
    }


def _run_lengths(values: Sequence[int]) -> list[tuple[int, int]]:
    # tuples, written as the same JSON arrays: a tuple of numbers leaves the garbage collector's watch, and a large
    # report holds many of them
    return [(int(value), len(list(run))) for value, run in itertools.groupby(values)]


def round_all(values: Sequence[float], digits: int) -> list[float]:
    """``[round(float(value), digits) for value in values]``, the same floats, computed for whole arrays at once.

    ``rint(value * 10**digits) / 10**digits`` is what ``round`` gives whenever the product is not near a half (the
    product's own rounding error cannot cross one there, and the division is correctly rounded, as ``round``'s
    decimal-to-float step is); the values near a half, very large or not finite go through ``round`` itself.
    """
    import numpy as np

    array = np.asarray(values, dtype=np.float64)
    scale = 10.0**digits
    with np.errstate(invalid="ignore", over="ignore"):  # infinities and NaN are left to round() below
        scaled = array * scale
        result = np.rint(scaled) / scale
        margin = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5)
        unsure = ~(np.isfinite(scaled) & (np.abs(scaled) < 1e9) & (margin > 1e-6))
    rounded: list[float] = result.tolist()
    for position in np.flatnonzero(unsure).tolist():
        rounded[position] = round(float(values[position]), digits)
    return rounded


def decode_each(ids: Sequence[int], tokenizer: Any) -> dict[str, str]:
    """Each id's own decoded text (special tokens kept), keyed by the id as text (JSON object keys)."""
    return {str(token): str(tokenizer.decode([token], skip_special_tokens=False)) for token in ids}


def image_spans(ids: Sequence[int], texts: Mapping[str, str]) -> list[list[int]]:
    """``[start, end]`` of each run of tokens between a vision-start and a vision-end marker (both included)."""
    spans = []
    start = None
    for position, token in enumerate(ids):
        text = texts.get(str(token))
        if text == _IMAGE_OPEN:
            start = position
        elif text == _IMAGE_CLOSE and start is not None:
            spans.append([start, position + 1])
            start = None
    return spans
