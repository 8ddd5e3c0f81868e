"""Internal: observation boundary tokens (the dummy-prefix method) and the rule for the masked EOS after a stop
string.

The canonical token history of a sample is what vLLM rendered and generated; it is never re-rendered. To append an
observation, only the *boundary* is encoded: the tokens that close the assistant turn, add the observation turn and
open the next assistant turn. They are cut out of a fixed dummy conversation rendered with the local chat template.

An observation is one message or a list of messages (one ``tool`` result per call, say). A list is one suffix: its
messages are rendered together after the dummy prefix, exactly as the template renders consecutive messages (a
template may group consecutive ``tool`` results into one turn, which rendering them one by one would not).

The dummy prefix depends on the observation's *shape*, the role of its first message: before ``tool`` results it
ends with an assistant message that has ``tool_calls`` (templates may render a tool result differently, or refuse
it, after anything else); before anything else it ends with a plain assistant message. Each shape's prefix is
rendered once per (tokenizer, tools, template kwargs) and cached, so each new observation costs one template
render; boundaries of recently seen observations are cached too (environments often repeat the same feedback), so
a repeated one costs none. Every boundary checks that its shape's prefix renders the same with the observation
after it (:class:`~fsm_rollout.errors.TemplateNotPrefixStable` otherwise); :meth:`ObservationEncoder.probe` runs
that check, and a whole conversation's, once at start-up instead of at the first observation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

from fsm_rollout.errors import ImageObservationError, ObservationError, TemplateError, TemplateNotPrefixStable
from fsm_rollout.multimodal import check_observation_parts, is_image_part
from fsm_rollout.sample import Sample
from fsm_rollout.tokens.chat_messages import template_messages
from fsm_rollout.tokens.parity import (
    OBSERVATIONS_KEY,
    ParityReport,
    check_template_parity,
    record_observation,
    template_token_ids,
)
from fsm_rollout.types import TokenIds

__all__ = [
    "BOUNDARY_CACHE_SIZE",
    "DUMMY_MESSAGES",
    "DUMMY_PREFIXES",
    "OBSERVATIONS_KEY",
    "PROBE_OBSERVATIONS",
    "PROBE_QUESTION",
    "PROBE_TURNS",
    "TOOL_DUMMY_MESSAGES",
    "TOOL_SHAPE",
    "USER_SHAPE",
    "Observation",
    "ObservationEncoder",
    "observation_shape",
    "probe_conversation",
    "record_observation",
    "render_key",
    "stop_string_eos_due",
    "template_identity",
    "template_token_ids",
    "validate_observation",
    "validate_observation_message",
    "validate_text_observation",
]

BOUNDARY_CACHE_SIZE = 4096
"""Observation boundaries kept per encoder (least recently used ones are dropped)."""

DUMMY_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)
"""The dummy prefix before any observation that does not start with a ``tool`` message."""

TOOL_DUMMY_MESSAGES: tuple[dict[str, Any], ...] = (
    *DUMMY_MESSAGES[:2],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "dummy_tool", "arguments": "{}"}},
        ],
    },
)
"""The dummy prefix before an observation that starts with a ``tool`` message: it ends with a tool call. Its
arguments are a JSON string, OpenAI's wire form, because the image path sends this prefix to the engine; local
renders decode them as vLLM does (:func:`fsm_rollout.tokens.chat_messages.template_messages`)."""

USER_SHAPE: Final = "user"
TOOL_SHAPE: Final = "tool"
DUMMY_PREFIXES: Mapping[str, tuple[dict[str, Any], ...]] = {USER_SHAPE: DUMMY_MESSAGES, TOOL_SHAPE: TOOL_DUMMY_MESSAGES}
"""The dummy prefix of each observation shape."""


def observation_shape(messages: Sequence[Mapping[str, Any]]) -> str:
    """The shape of an observation: ``"tool"`` when its first message is a ``tool`` message, else ``"user"``."""
    return TOOL_SHAPE if messages and messages[0].get("role") == "tool" else USER_SHAPE


def template_identity(tokenizer: Any) -> str:
    """How errors name a tokenizer's chat template: its ``name_or_path`` and a short hash of the template text."""
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        text = template
    elif isinstance(template, Mapping):  # named templates
        text = orjson.dumps(dict(template), option=orjson.OPT_SORT_KEYS).decode()
    else:
        return f"{name} (no chat_template attribute)"
    return f"{name} (chat template sha256:{hashlib.sha256(text.encode()).hexdigest()[:12]})"


def validate_text_observation(message: Any, *, images: bool = False) -> dict[str, Any]:
    """Check that an observation message is ``{"role", "content"}`` with text-only content; return it.

    A ``tool`` message may carry ``tool_call_id`` and ``name``, as strings. ``images`` lets image parts through.
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
        raise ObservationError(
            f"format_observation must return a {{'role': str, 'content': ...}} message, got {message!r:.200}"
        )
    if message["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if key in message and not isinstance(message[key], str):
                raise ObservationError(
                    f"a tool observation's {key!r} must be a string, got {type(message[key]).__name__}"
                )
    content = message["content"]
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ObservationError(
            f"observation content must be text or a list of text parts, got {type(content).__name__}"
        )
    for index, part in enumerate(content):
        if is_image_part(part):
            if images:
                continue
            raise ImageObservationError(
                f"observation content[{index}] is an image part ({part.get('type')!r}): this check takes "
                "text-only messages (validate_observation takes image parts)"
            )
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ObservationError(
                f"observations hold text{' and image' if images else ''} parts only; content[{index}]={part!r:.200}"
            )
    return message


def validate_observation_message(message: Any) -> dict[str, Any]:
    """Check one observation message as :func:`validate_text_observation` does, but take image parts too
    (``image``, or ``image_url`` with a data URL, a file path or a PIL image); a video or audio part is a
    :class:`~fsm_rollout.errors.VideoObservationError`."""
    if isinstance(message, dict):  # a media part is named as such, before the general part check
        check_observation_parts([message])
    return validate_text_observation(message, images=True)


def validate_observation(observation: Any) -> list[dict[str, Any]]:
    """Check what ``format_observation`` returned: one message, or a non-empty list of them.

    Returns the messages as a list (the caller's message objects, not copies). Each message is checked as
    :func:`validate_observation_message` checks it (text and image parts); an error about a list item names its
    index.
    """
    if isinstance(observation, dict):
        return [validate_observation_message(observation)]
    if not isinstance(observation, list | tuple):
        raise ObservationError(
            "format_observation must return a {'role': str, 'content': ...} message or a non-empty list of them, "
            f"got {observation!r:.200}"
        )
    if not observation:
        raise ObservationError("format_observation returned an empty list: an observation needs at least one message")
    messages = []
    for index, message in enumerate(observation):
        try:
            messages.append(validate_observation_message(message))
        except ObservationError as error:  # same class, the item named
            raise type(error)(f"observation message [{index}]: {error}") from None
    return messages


def render_key(tools: Any, template_kwargs: Mapping[str, Any] | None) -> bytes:
    """A cache key for renders with these tools and template kwargs: exactly what the template is given, in the
    order given. Templates write JSON keys in the order they were sent (``tool | tojson``), so two tool schemas that
    differ only in key order render different tokens and must not share a cached render."""
    return orjson.dumps([tools, dict(template_kwargs or {})])


Observation = Mapping[str, Any] | Sequence[Mapping[str, Any]]
"""One observation message, or a list of them encoded as one suffix."""


class ObservationEncoder:
    """Encodes observations into boundary tokens with one tokenizer's chat template.

    ``tokenizer`` needs ``apply_chat_template`` and an integer ``eos_token_id`` (the chat turn terminator);
    :meth:`probe` also needs ``encode`` and ``decode``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos_token_id if type(eos_token_id) is int else None
        self._prefixes: dict[tuple[str, bytes], tuple[TokenIds, int]] = {}
        self._boundaries: OrderedDict[bytes, TokenIds] = OrderedDict()
        self._probed: OrderedDict[bytes, None] = OrderedDict()

    def _prefix(
        self, shape: str, key: bytes, tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any]
    ) -> tuple[TokenIds, int]:
        cached = self._prefixes.get((shape, key))
        if cached is not None:
            return cached
        if self.eos_token_id is None:
            raise TemplateError("tokenizer.eos_token_id must be an integer (the chat turn terminator)")
        prefix = template_token_ids(
            self.tokenizer.apply_chat_template(
                template_messages(DUMMY_PREFIXES[shape]),
                tools=tools,
                tokenize=True,
                add_generation_prompt=False,
                **template_kwargs,
            ),
            what="dummy observation prefix",
        )
        try:
            eos_index = len(prefix) - 1 - prefix[::-1].index(self.eos_token_id)
        except ValueError as error:
            raise TemplateError(
                f"Dummy observation prefix lacks eos_token_id={self.eos_token_id}: the chat template does not "
                "end assistant turns with the tokenizer's EOS"
            ) from error
        self._prefixes[(shape, key)] = (prefix, eos_index)
        return prefix, eos_index

    def image_render_prefix(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[dict[str, Any]], TokenIds, int]:
        """What an image observation is rendered after by the engine: the dummy messages of its shape, their tokens
        as the local template renders them, and the index of the EOS that closes their assistant turn (the
        boundary starts there, as for text)."""
        kwargs = template_kwargs or {}
        shape = observation_shape(messages)
        prefix, eos_index = self._prefix(shape, render_key(tools, kwargs), tools, kwargs)
        return [dict(message) for message in DUMMY_PREFIXES[shape]], prefix, eos_index

    def encode(
        self,
        message: Observation,
        *,
        ends_with_eos: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenIds:
        """Boundary tokens that follow the canonical history for this observation (a message or a list of them).

        A list is one suffix: the boundary once, then all its messages as the template renders them together.
        ``ends_with_eos`` says whether the canonical history already ends with EOS (the model stopped on it, or
        one was appended after a stop string); then the boundary's leading EOS is left out.
        """
        messages = [message] if isinstance(message, Mapping) else list(message)
        if not messages:
            raise ObservationError("an observation needs at least one message")
        kwargs = template_kwargs or {}
        prefix_key = render_key(tools, kwargs)
        key = prefix_key + b"\x00" + orjson.dumps(messages)
        cached = self._boundaries.get(key)
        if cached is None:
            cached = self._boundary(prefix_key, messages, tools, kwargs)
            self._boundaries[key] = cached
            if len(self._boundaries) > BOUNDARY_CACHE_SIZE:
                self._boundaries.popitem(last=False)
        else:
            self._boundaries.move_to_end(key)
        return cached[1:] if ends_with_eos else list(cached)

    def _boundary(
        self,
        prefix_key: bytes,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> TokenIds:
        """The boundary tokens starting with the EOS that closes the assistant turn."""
        shape = observation_shape(messages)
        prefix, eos_index = self._prefix(shape, prefix_key, tools, kwargs)
        rendered = template_token_ids(
            self.tokenizer.apply_chat_template(
                template_messages([*DUMMY_PREFIXES[shape], *messages]),
                tools=tools,
                tokenize=True,
                add_generation_prompt=True,
                **kwargs,
            ),
            what="observation template",
        )
        if rendered[: len(prefix)] != prefix:
            raise TemplateNotPrefixStable(
                f"Observation template {template_identity(self.tokenizer)} is not prefix-stable for {shape} "
                "observations: rendering one more message changed the tokens of the conversation before it "
                "(e.g. a template that rewrites earlier assistant turns)"
            )
        return prefix[eos_index:] + rendered[len(prefix) :]

    def probe(
        self,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        shapes: Sequence[str] | None = None,
    ) -> None:
        """Check once, before any rollout, that the template can append observations of these shapes.

        For each shape (default: ``user``, and ``tool`` too when ``tools`` are given) this encodes a sample
        observation, which checks that shape's dummy prefix, then rebuilds a short made-up conversation of that
        shape (assistant turns with ``<think>`` blocks, two observations) the way a rollout appends it and
        compares it with the template's rendering of the whole conversation (:func:`probe_conversation`, with
        :func:`fsm_rollout.tokens.parity.check_template_parity`). A template that renders earlier turns differently
        once more follows (one that drops the ``<think>`` blocks of earlier assistant turns, say) fails here
        with :class:`~fsm_rollout.errors.TemplateNotPrefixStable` naming the template and the first differing
        token, instead of at the first observation or silently in training data. Other template failures are
        a :class:`~fsm_rollout.errors.TemplateError` naming the template and the shape.

        Passing (tools, template kwargs, shapes) combinations are remembered (the most recently used
        ``BOUNDARY_CACHE_SIZE`` of them), so calling this once per sample costs a lookup after the first.
        """
        kwargs = dict(template_kwargs or {})
        chosen = tuple(shapes) if shapes is not None else (USER_SHAPE, TOOL_SHAPE) if tools else (USER_SHAPE,)
        unknown = [shape for shape in chosen if shape not in DUMMY_PREFIXES]
        if unknown:
            raise ValueError(f"unknown observation shape(s) {unknown}; the shapes are {sorted(DUMMY_PREFIXES)}")
        key = hashlib.sha256(render_key(tools, kwargs) + b"\x00" + orjson.dumps(sorted(chosen))).digest()
        if key in self._probed:
            self._probed.move_to_end(key)
            return
        missing = [name for name in ("encode", "decode") if not callable(getattr(self.tokenizer, name, None))]
        if missing:
            raise TemplateError(f"the template probe needs tokenizer.{' and tokenizer.'.join(missing)}")
        for shape in chosen:
            try:
                report = probe_conversation(self, shape, tools=tools, template_kwargs=kwargs)
            except TemplateError:
                raise
            except Exception as error:  # the template itself raised: say which template and which shape
                raise TemplateError(
                    f"chat template {template_identity(self.tokenizer)} cannot render {shape} observations: "
                    f"{type(error).__name__}: {error}"
                ) from error
            if not report.ok:
                raise TemplateNotPrefixStable(
                    f"chat template {template_identity(self.tokenizer)} is not prefix-stable for {shape} "
                    f"observations: {report.describe()}. A rollout appends each observation to the tokens "
                    "generated so far, so the template must render every earlier turn the same whatever follows "
                    "it (templates that drop the <think> blocks of earlier assistant turns do not)"
                )
        self._probed[key] = None
        if len(self._probed) > BOUNDARY_CACHE_SIZE:  # samples may each bring their own tools
            self._probed.popitem(last=False)


def stop_string_eos_due(
    text: str,
    token_ids: Sequence[int],
    *,
    finish: str,
    stop: str | Sequence[str] | None,
    eos_token_id: int | None,
) -> bool:
    """Whether a masked EOS must follow this turn: it stopped on a stop string and did not end with EOS itself.

    Stops on ``stop_token_ids`` never qualify (the text does not end with a stop string).
    """
    if finish != "stop" or not stop or eos_token_id is None:
        return False
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if not text.endswith(stop_strings):
        return False
    return not (token_ids and token_ids[-1] == eos_token_id)


# ---------------------------------------------------------------------------------------------------- the probe

PROBE_QUESTION = "What is six times seven?"
PROBE_TURNS: Mapping[str, str] = {
    "user": "<think>\nSix sevens are forty-two.\n</think>\n\nThe answer is 42.",
    "tool": (
        "<think>\nI will check both products with the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "7*6"}}\n</tool_call>'
    ),
}
"""The made-up assistant turns of the probe: a ``<think>`` block first, as reasoning models write them."""
PROBE_OBSERVATIONS: Mapping[str, tuple[dict[str, Any], ...]] = {
    "user": ({"role": "user", "content": "Are you sure?"},),
    "tool": (
        {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "calc"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "calc"},
    ),
}
"""The probe's observation of each shape (two consecutive tool results, so grouping templates group them)."""


def probe_conversation(
    encoder: ObservationEncoder,
    shape: str,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ParityReport:
    """Build a made-up sample as a rollout would (prompt, turn, observation, turn, observation, turn) with
    ``encoder`` and check its template parity. Needs ``tokenizer.encode`` (the turns' tokens are their text
    encoded, as a model that writes canonical tokens would produce them)."""
    tokenizer = encoder.tokenizer
    kwargs = dict(template_kwargs or {})
    observation = [dict(message) for message in PROBE_OBSERVATIONS[shape]]
    encoder.encode(observation, ends_with_eos=True, tools=tools, template_kwargs=kwargs)  # the prefix check
    eos = encoder.eos_token_id
    assert eos is not None  # encode raised otherwise
    prompt = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": PROBE_QUESTION},
    ]
    sample = Sample(prompt=prompt, metadata={"tools": list(tools)} if tools else {})
    sample.tokens = template_token_ids(
        tokenizer.apply_chat_template(prompt, tools=tools, tokenize=True, add_generation_prompt=True, **kwargs),
        what="probe prompt",
    )
    turn = [*tokenizer.encode(PROBE_TURNS[shape], add_special_tokens=False), eos]
    for number in range(3):
        sample.append_response_tokens(turn, [0.0] * len(turn), trainable=True)
        if number == 2:
            break
        boundary = encoder.encode(observation, ends_with_eos=True, tools=tools, template_kwargs=kwargs)
        start = sample.response_length
        sample.append_response_tokens(boundary, trainable=False)
        record_observation(sample.metadata, observation, start=start, end=sample.response_length)
    return check_template_parity(sample, tokenizer, tools=tools, template_kwargs=kwargs)
