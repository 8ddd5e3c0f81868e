"""Tool calls in generated text, in the Qwen / Hermes format: ``<tool_call>{"name": ..., "arguments": {}}</tool_call>``.

:func:`parse_tool_calls` finds every ``<tool_call>`` block of a turn, in order, and returns the calls it could read
and a problem for each block it could not. It never raises on the model's text: a turn is model output, and what
is wrong with it is information for the environment (feedback, a zero reward), not an error of the rollout.

Per block:

* the body (between the tags, surrounding whitespace and a Markdown code fence ignored) must be a JSON object;
* ``name`` must be a non-empty string;
* ``arguments`` must be an object, or a string holding a JSON object (some models emit it that way); a missing
  ``arguments`` reads as ``{}`` (a tool without parameters);
* a ``<tool_call>`` without its ``</tool_call>`` before the next ``<tool_call>`` or the end of the text is an
  ``unclosed_tag`` problem; with ``read_unclosed=True`` the *last* block may be unclosed and is read to the end of
  the text (generation that stopped on the ``</tool_call>`` stop string leaves it out of the text).

A stray ``</tool_call>`` with no opening tag is text like any other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CLOSE_TAG",
    "OPEN_TAG",
    "ToolCall",
    "ToolCallParse",
    "ToolCallProblem",
    "ToolCallProblemKind",
    "parse_tool_calls",
]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

ToolCallProblemKind = Literal[
    "malformed_json", "not_an_object", "missing_name", "malformed_arguments", "arguments_not_object", "unclosed_tag"
]
"""What is wrong with a block: its body is not JSON, or JSON but not an object; it has no usable ``name``; its
``arguments`` string is not JSON, or its arguments are not an object; or its closing tag is missing."""

_CODE_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call read from the text."""

    name: str
    arguments: dict[str, Any]
    """The arguments object (decoded when the model wrote it as a JSON string)."""
    raw: str
    """The block's body as written, between the tags."""
    start: int
    """Offset of ``<tool_call>`` in the text."""
    end: int
    """Offset just past ``</tool_call>`` (the end of the text for an unclosed last block read anyway)."""
    index: int
    """The block's place among the text's ``<tool_call>`` blocks, calls and problems alike (0-based)."""
    payload: Mapping[str, Any] = field(repr=False)
    """The whole decoded object (``name``, ``arguments`` and any other keys the model wrote)."""
    closed: bool = True
    """False for an unclosed last block read with ``read_unclosed=True``."""


@dataclass(frozen=True, slots=True)
class ToolCallProblem:
    """A block that is not a usable call, and why."""

    kind: ToolCallProblemKind
    message: str
    """One sentence saying what is wrong, for logs or for feedback to the model."""
    raw: str
    start: int
    end: int
    index: int
    name: Any = None
    """The block's ``name`` as written, when its body decoded to an object with one (else None)."""
    detail: str | None = None
    """The JSON decoder's own message for ``malformed_json`` / ``malformed_arguments``, the JSON type for
    ``not_an_object`` / ``arguments_not_object``."""


@dataclass(frozen=True, slots=True)
class ToolCallParse:
    """The calls of a text and the problems of its other blocks, each in text order."""

    calls: tuple[ToolCall, ...] = ()
    problems: tuple[ToolCallProblem, ...] = ()

    @property
    def ok(self) -> bool:
        """No block had a problem (a text without blocks is ok)."""
        return not self.problems

    @property
    def blocks(self) -> tuple[ToolCall | ToolCallProblem, ...]:
        """Calls and problems together, in text order (one per ``<tool_call>`` block)."""
        merged: list[ToolCall | ToolCallProblem] = [*self.calls, *self.problems]
        merged.sort(key=lambda block: block.index)
        return tuple(merged)


Loads = Callable[[str], Any]


def parse_tool_calls(text: str, *, read_unclosed: bool = False, loads: Loads | None = None) -> ToolCallParse:
    """Every ``<tool_call>`` block of ``text``: the calls in order, and the problems of the blocks that are not.

    ``loads`` decodes a body (and an ``arguments`` string); it defaults to :func:`json.loads` and may raise any
    ``ValueError`` for text it cannot read (an environment can pass a more forgiving decoder for its domain).
    """
    decode = loads or json.loads
    calls: list[ToolCall] = []
    problems: list[ToolCallProblem] = []
    position = 0
    index = 0
    while True:
        start = text.find(OPEN_TAG, position)
        if start < 0:
            break
        body_start = start + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body_start)
        reopen = text.find(OPEN_TAG, body_start)
        if close >= 0 and (reopen < 0 or close < reopen):
            raw, end, closed = text[body_start:close], close + len(CLOSE_TAG), True
        else:
            body_end = reopen if reopen >= 0 else len(text)
            raw, end, closed = text[body_start:body_end], body_end, False
        position = end
        if not closed and (reopen >= 0 or not read_unclosed):
            problems.append(
                ToolCallProblem(
                    "unclosed_tag", f"{OPEN_TAG} at character {start} has no {CLOSE_TAG}.", raw, start, end, index
                )
            )
        else:
            block = _read_block(raw, start, end, index, closed, decode)
            if isinstance(block, ToolCall):
                calls.append(block)
            else:
                problems.append(block)
        index += 1
    return ToolCallParse(tuple(calls), tuple(problems))


def _decode(text: str, decode: Loads) -> tuple[Any, str | None]:
    """The decoded value and None, or None and the decoder's message."""
    try:
        return decode(_CODE_FENCE.sub("", text.strip())), None
    except json.JSONDecodeError as error:
        return None, f"{error.msg} at character {error.pos}"
    except (ValueError, TypeError, RecursionError) as error:  # a custom decoder's own failure
        return None, str(error) or type(error).__name__


def _read_block(raw: str, start: int, end: int, index: int, closed: bool, decode: Loads) -> ToolCall | ToolCallProblem:
    def problem(
        kind: ToolCallProblemKind, message: str, name: Any = None, detail: str | None = None
    ) -> ToolCallProblem:
        return ToolCallProblem(kind, message, raw, start, end, index, name=name, detail=detail)

    payload, error = _decode(raw, decode)
    if error is not None:
        return problem("malformed_json", f"The tool call is not valid JSON ({error}).", detail=error)
    if not isinstance(payload, dict):
        kind = _json_type(payload)
        return problem("not_an_object", f"The tool call must be a JSON object, not {kind}.", detail=kind)
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return problem("missing_name", 'The tool call has no "name" string.', name=name)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        arguments, error = _decode(arguments, decode)
        if error is not None:
            return problem(
                "malformed_arguments",
                f"The {name} arguments string is not valid JSON ({error}).",
                name=name,
                detail=error,
            )
    if not isinstance(arguments, dict):
        kind = _json_type(arguments)
        return problem(
            "arguments_not_object",
            f'The {name} call\'s "arguments" must be an object, not {kind}.',
            name=name,
            detail=kind,
        )
    return ToolCall(name, arguments, raw, start, end, index, payload=payload, closed=closed)


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (what the model wrote, not Python's name for it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return type(value).__name__
