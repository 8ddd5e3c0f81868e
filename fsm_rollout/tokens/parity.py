"""Template parity: does the chat template render a finished sample's whole conversation as the sample's tokens?

A rollout never re-renders: it appends each generated turn and each observation's boundary tokens
(:mod:`fsm_rollout.tokens.chat`) to the tokens so far. That is exact only when the template is append-only for the
conversations the rollout produces. :func:`check_template_parity` checks one sample: it rebuilds the conversation
and compares the template's rendering of all of it with ``sample.tokens``, reporting the first differing token
with decoded context on both sides.

The conversation is rebuilt from the sample alone:

* the prompt messages as the rollout sends them to render (:func:`~fsm_rollout.multimodal.build_initial_messages`,
  then :func:`~fsm_rollout.multimodal.prepare_render_messages`);
* the observations from ``sample.metadata["observations"]``, which the rollout writes when it appends one: the
  messages ``format_observation`` returned and the response-side token span they occupy. Recording them is what
  makes the rebuild exact whatever the template: decoding the masked tokens back into messages would mean parsing
  each template's framing, and an empty generated turn would make two observations' tokens adjacent;
* each assistant turn between them as the decoded text of its tokens (loss mask 1), without the EOS that closes it,
  whether the model generated that EOS or the stop-string rule appended it (loss mask 0): the template renders it.

The rendering ends with the generation prompt when the sample ends with an observation. When it ends with an
assistant turn, the rendering may go on past the sample's last token (the template closes that turn; a turn cut
by the length limit has no EOS in the sample). Runs of the image placeholder token compare as one unit: the
local template writes one placeholder per image where vLLM's render expanded it to the image's token count.

This module also holds what a sample records of its observations (:data:`OBSERVATIONS_KEY`,
:func:`record_observation`) and the token ids a template renders (:func:`template_token_ids`): the observation
encoder (:mod:`fsm_rollout.tokens.chat`) writes them and builds its start-up probe on the check, so it imports this
module, never the other way round.

A difference inside an assistant turn can also mean the model's tokens were not the canonical tokenization of
their text (re-encoding the decoded text gives other ids); the report names the segment the difference is in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from fsm_rollout.errors import ParityInputError, TemplateError
from fsm_rollout.multimodal import IMAGE_PAD_TOKEN, build_initial_messages, image_pad_token_id, prepare_render_messages
from fsm_rollout.sample import Sample
from fsm_rollout.tokens.chat_messages import template_messages
from fsm_rollout.types import TokenIds

__all__ = [
    "OBSERVATIONS_KEY",
    "Conversation",
    "ParityReport",
    "Segment",
    "check_template_parity",
    "rebuild_conversation",
    "record_observation",
    "template_token_ids",
]

CONTEXT_TOKENS = 12
"""Tokens decoded on each side of a difference."""

OBSERVATIONS_KEY: Final = "observations"
"""``sample.metadata`` key of the observation records: ``{"start", "end", "messages"}`` per appended observation,
``start``/``end`` being response-side token offsets (half-open) and ``messages`` what ``format_observation``
returned, as a list."""


def template_token_ids(value: Any, *, what: str) -> TokenIds:
    """Token ids from ``apply_chat_template(tokenize=True)``: a flat int list, or a mapping with ``input_ids``."""
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        value = value.get("input_ids")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not all(type(token) is int for token in value):
        raise TemplateError(f"{what}: apply_chat_template must return a flat list of integer token ids")
    return value


def record_observation(
    metadata: dict[str, Any], messages: Sequence[Mapping[str, Any]], *, start: int, end: int
) -> None:
    """Note in a sample's metadata that response tokens ``[start, end)`` are the observation ``messages``.

    The list is replaced rather than appended to, so a list shared with the caller's metadata is not changed.
    """
    record = {"start": start, "end": end, "messages": [dict(message) for message in messages]}
    metadata[OBSERVATIONS_KEY] = [*metadata.get(OBSERVATIONS_KEY, ()), record]


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of ``sample.tokens``: the prompt, an assistant turn or an observation (``index`` counts turns and
    observations separately, from 0)."""

    kind: Literal["prompt", "turn", "observation"]
    index: int
    start: int
    end: int

    @property
    def label(self) -> str:
        """``the prompt``, ``assistant turn N`` or ``observation N``."""
        if self.kind == "prompt":
            return "the prompt"
        return f"assistant turn {self.index}" if self.kind == "turn" else f"observation {self.index}"


@dataclass(frozen=True, slots=True)
class Conversation:
    """A sample as chat messages, where each part lies in its tokens, and whether its rendering ends with the
    generation prompt."""

    messages: list[dict[str, Any]]
    segments: tuple[Segment, ...]
    add_generation_prompt: bool


@dataclass(frozen=True, slots=True)
class ParityReport:
    """The outcome of :func:`check_template_parity`: ok, or the first differing token and what is around it."""

    ok: bool
    sample_length: int
    rendered_length: int
    position: int | None = None
    """Index in ``sample.tokens`` of the first difference (``sample_length`` when the sample ends first)."""
    rendered_position: int | None = None
    """Index of the same place in the rendering (they differ after expanded image placeholders)."""
    segment: str | None = None
    """Where the difference is: ``the prompt``, ``assistant turn N``, ``observation N`` or ``the end``."""
    sample_token: int | None = None
    rendered_token: int | None = None
    before: str = ""
    """Decoded tokens just before the difference (the same on both sides)."""
    sample_text: str = ""
    """Decoded sample tokens from the difference on."""
    rendered_text: str = ""
    """Decoded rendered tokens from the difference on."""
    trailing: int = 0
    """Rendered tokens after the sample's end that close its last assistant turn (not a difference)."""

    def describe(self) -> str:
        """One sentence: the match, or the first difference with its context."""
        if self.ok:
            return f"the template renders the conversation as the sample's {self.sample_length} tokens"
        return (
            f"first difference at token {self.position} of {self.sample_length} (in {self.segment}): after "
            f"{self.before!r} the sample has {self.sample_text!r} where the template renders {self.rendered_text!r}"
        )

    def __str__(self) -> str:
        return self.describe()


def check_template_parity(
    sample: Sample,
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    image_placeholder_token: str = IMAGE_PAD_TOKEN,
) -> ParityReport:
    """Compare the template's rendering of the sample's whole conversation with ``sample.tokens``.

    ``tools`` default to ``sample.metadata["tools"]`` (what the rollout renders with); ``template_kwargs`` are
    the rollout's ``apply_chat_template_kwargs``. Raises :class:`~fsm_rollout.errors.ParityInputError` when
    the sample cannot be rebuilt (see :func:`rebuild_conversation`); a difference is reported, not raised.
    """
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    if tools is None:
        tools = metadata.get("tools")
    conversation = rebuild_conversation(sample, tokenizer)
    rendered = template_token_ids(
        tokenizer.apply_chat_template(
            template_messages(conversation.messages),  # tool-call arguments decoded, as vLLM hands them over
            tools=tools,
            tokenize=True,
            add_generation_prompt=conversation.add_generation_prompt,
            **dict(template_kwargs or {}),
        ),
        what="conversation template",
    )
    tokens = list(sample.tokens)
    pad = (
        image_pad_token_id(tokenizer, image_placeholder_token) if hasattr(tokenizer, "convert_tokens_to_ids") else None
    )
    difference = _first_difference(tokens, rendered, pad)
    if difference is None:
        return ParityReport(ok=True, sample_length=len(tokens), rendered_length=len(rendered))
    position, rendered_position = difference
    if position == len(tokens) and conversation.segments[-1].kind == "turn":
        return ParityReport(
            ok=True,
            sample_length=len(tokens),
            rendered_length=len(rendered),
            trailing=len(rendered) - rendered_position,
        )

    def decode(ids: Sequence[int]) -> str:
        text: str = tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    segment = next((part.label for part in conversation.segments if part.start <= position < part.end), "the end")
    return ParityReport(
        ok=False,
        sample_length=len(tokens),
        rendered_length=len(rendered),
        position=position,
        rendered_position=rendered_position,
        segment=segment,
        sample_token=tokens[position] if position < len(tokens) else None,
        rendered_token=rendered[rendered_position] if rendered_position < len(rendered) else None,
        before=decode(tokens[max(0, position - CONTEXT_TOKENS) : position]),
        sample_text=decode(tokens[position : position + CONTEXT_TOKENS]),
        rendered_text=decode(rendered[rendered_position : rendered_position + CONTEXT_TOKENS]),
    )


def rebuild_conversation(sample: Sample, tokenizer: Any) -> Conversation:
    """The sample's conversation: prompt messages, then each assistant turn and observation in order.

    Raises :class:`~fsm_rollout.errors.ParityInputError` when the observation records
    (``sample.metadata["observations"]``) are malformed, overlap or leave the response, or when masked tokens
    other than a turn's closing EOS lie outside them (a sample from a rollout that did not record observations).
    """
    tokens = list(sample.tokens)
    response_length = sample.response_length
    prompt_length = len(tokens) - response_length
    if response_length < 0 or prompt_length <= 0:
        raise ParityInputError(
            f"sample {sample.index!r}: {len(tokens)} tokens and response_length={response_length} leave no prompt"
        )
    loss_mask = sample.loss_mask if sample.loss_mask is not None else [1] * response_length
    if len(loss_mask) != response_length:
        raise ParityInputError(
            f"sample {sample.index!r}: loss_mask has {len(loss_mask)} entries for {response_length} response tokens"
        )
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    images = (sample.multimodal_inputs or {}).get("images")
    messages = prepare_render_messages(build_initial_messages(sample.prompt, images), sample_id=sample.index).messages
    segments = [Segment("prompt", 0, 0, prompt_length)]
    eos = getattr(tokenizer, "eos_token_id", None)

    def add_turn(start: int, end: int) -> None:
        ids = tokens[prompt_length + start : prompt_length + end]
        mask = loss_mask[start:end]
        closing = 1 if ids and type(eos) is int and ids[-1] == eos else 0
        if 0 in mask[: len(mask) - closing]:
            first = start + mask.index(0)
            raise ParityInputError(
                f"sample {sample.index!r}: masked response token {first} is neither a turn's closing EOS nor in a "
                f"recorded observation (metadata[{OBSERVATIONS_KEY!r}] is missing or incomplete)"
            )
        text: str = tokenizer.decode(ids[: len(ids) - closing], skip_special_tokens=False)
        turn_index = sum(1 for part in segments if part.kind == "turn")
        segments.append(Segment("turn", turn_index, prompt_length + start, prompt_length + end))
        messages.append({"role": "assistant", "content": text})

    cursor = 0
    for number, (start, end, observed) in enumerate(_observation_records(metadata, response_length, sample.index)):
        if start < cursor:
            raise ParityInputError(
                f"sample {sample.index!r}: observation record {number} starts at {start}, inside the one before it"
            )
        add_turn(cursor, start)  # a turn precedes every observation, even an empty one
        if 1 in loss_mask[start:end]:
            raise ParityInputError(
                f"sample {sample.index!r}: observation record {number} ({start}..{end}) covers trainable tokens"
            )
        segments.append(Segment("observation", number, prompt_length + start, prompt_length + end))
        messages.extend(dict(message) for message in observed)
        cursor = end
    if cursor < response_length:
        add_turn(cursor, response_length)
    ends_with_observation = segments[-1].kind != "turn"
    return Conversation(messages, tuple(segments), add_generation_prompt=ends_with_observation)


def _observation_records(
    metadata: Mapping[str, Any], response_length: int, sample_index: Any
) -> list[tuple[int, int, list[Mapping[str, Any]]]]:
    records = metadata.get(OBSERVATIONS_KEY) or []
    if not isinstance(records, list):
        raise ParityInputError(f"sample {sample_index!r}: metadata[{OBSERVATIONS_KEY!r}] must be a list")
    checked = []
    for number, record in enumerate(records):
        start = record.get("start") if isinstance(record, dict) else None
        end = record.get("end") if isinstance(record, dict) else None
        observed = record.get("messages") if isinstance(record, dict) else None
        if (
            type(start) is not int
            or type(end) is not int
            or not 0 <= start <= end <= response_length
            or not isinstance(observed, list)
            or not all(isinstance(message, dict) for message in observed)
        ):
            raise ParityInputError(
                f"sample {sample_index!r}: observation record {number} must be {{'start', 'end', 'messages'}} "
                f"with 0 <= start <= end <= {response_length}; got {record!r:.200}"
            )
        checked.append((start, end, observed))
    return checked


def _first_difference(tokens: Sequence[int], rendered: Sequence[int], pad: int | None) -> tuple[int, int] | None:
    """The first position where the sequences differ, in each of them; None when they are equal.

    A run of ``pad`` on both sides matches whatever the two runs' lengths. When one sequence is a proper prefix
    of the other, the position is the end of the shorter one.
    """
    if pad is None or (pad not in tokens and pad not in rendered):
        shorter = min(len(tokens), len(rendered))
        position = next((i for i in range(shorter) if tokens[i] != rendered[i]), shorter)
        if position == shorter and len(tokens) == len(rendered):
            return None
        return position, position
    i = j = 0
    while i < len(tokens) and j < len(rendered):
        if tokens[i] != rendered[j]:
            return i, j
        if tokens[i] == pad:
            while i < len(tokens) and tokens[i] == pad:
                i += 1
            while j < len(rendered) and rendered[j] == pad:
                j += 1
        else:
            i += 1
            j += 1
    if i == len(tokens) and j == len(rendered):
        return None
    return i, j
