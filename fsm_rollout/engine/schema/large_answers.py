"""Decoding a JSON answer whose bulk is a few very long strings, without the JSON parser walking them.

A render answer for images carries each image's features as one base64 string of megabytes
(``features.kwargs_data.image[i]``). The client only forwards those strings and decodes them once at the end, so
:func:`loads_answer` lifts every long string out of the raw bytes, parses the small remainder, and puts the strings
back as ``str`` objects made straight from the bytes. The result equals ``orjson.loads(raw)``:

* strings are found by scanning quote to quote from the start (outside a string, a JSON ``"`` only opens one), so
  a string's end is its first ``"`` not escaped by an odd run of backslashes;
* a long string holding a backslash (an escape) is decoded by the JSON parser, as are all short strings; a lifted
  string is checked to be UTF-8 but not for raw control characters, which the engine's JSON encoder never writes;
* a long string is put back only as a value inside the top-level ``features`` object, where the engine writes
  them; anywhere else (or in any other answer shape) the whole answer is parsed the ordinary way.

Answers under :data:`LARGE_ANSWER_BYTES`, and answers with more than :data:`MAX_SCANNED_STRINGS` strings before the
end (a long generate answer with logprobs), go straight to ``orjson.loads``.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

import orjson

LARGE_ANSWER_BYTES: Final = 256 * 1024
"""Answers smaller than this are parsed whole: there is nothing worth lifting out."""
LONG_STRING_BYTES: Final = 64 * 1024
"""A string at least this long (its JSON text) is lifted out of the answer."""
MAX_SCANNED_STRINGS: Final = 512
"""The scan gives up (and the answer is parsed whole) after this many strings: the answers worth lifting are
render answers, whose strings are few."""

_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C


def loads_answer(raw: bytes) -> Any:
    """``orjson.loads(raw)``, faster when ``raw`` is a large answer made mostly of long strings (see the module).

    Raises ``orjson.JSONDecodeError`` for text that is not JSON, as ``orjson.loads`` does.
    """
    if len(raw) < LARGE_ANSWER_BYTES:
        return orjson.loads(raw)
    spans = _long_string_spans(raw)
    if not spans:
        return orjson.loads(raw)
    marker = "\x00fsm-long-" + secrets.token_hex(8) + "-"
    skeleton: list[bytes | memoryview] = []
    view = memoryview(raw)
    position = 0
    for index, (start, end) in enumerate(spans):
        skeleton.append(view[position:start])
        skeleton.append(orjson.dumps(marker + str(index))[1:-1])
        position = end
    skeleton.append(view[position:])
    try:
        data = orjson.loads(b"".join(skeleton))
    except orjson.JSONDecodeError:
        return orjson.loads(raw)  # the answer's own error, as without lifting
    features = data.get("features") if isinstance(data, dict) else None
    if not isinstance(features, dict | list) or _restore(features, marker, view, spans) != len(spans):
        return orjson.loads(raw)
    return data


def _long_string_spans(raw: bytes) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents (between the quotes) of each long string without a backslash."""
    spans: list[tuple[int, int]] = []
    find = raw.find
    position = 0
    for _ in range(MAX_SCANNED_STRINGS):
        opening = find(b'"', position)
        if opening < 0:
            return spans
        closing = find(b'"', opening + 1)
        while closing > 0 and raw[closing - 1] == _BACKSLASH and _escaped(raw, closing):
            closing = find(b'"', closing + 1)
        if closing < 0:
            return []  # unterminated: let the parser say so
        if closing - opening - 1 >= LONG_STRING_BYTES and find(b"\\", opening + 1, closing) < 0:
            spans.append((opening + 1, closing))
        position = closing + 1
    return []


def _escaped(raw: bytes, quote: int) -> bool:
    """Whether the ``"`` at ``quote`` is escaped: preceded by an odd number of backslashes."""
    count = 0
    index = quote - 1
    while raw[index] == _BACKSLASH:
        count += 1
        index -= 1
    return count % 2 == 1


def _restore(value: dict[str, Any] | list[Any], marker: str, view: memoryview, spans: list[tuple[int, int]]) -> int:
    """Put each lifted string back where its marker is, inside ``value``; return how many were put back (-1 for a
    string that is not UTF-8)."""
    restored = 0
    items: Any = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in list(items):
        if isinstance(item, str):
            if item.startswith(marker):
                start, end = spans[int(item[len(marker) :])]
                try:
                    value[key] = str(view[start:end], "utf-8")
                except UnicodeDecodeError:
                    return -1  # not JSON text: the parser reports it
                restored += 1
        elif isinstance(item, dict | list):
            inner = _restore(item, marker, view, spans)
            if inner < 0:
                return -1
            restored += inner
    return restored


__all__ = ["LARGE_ANSWER_BYTES", "LONG_STRING_BYTES", "MAX_SCANNED_STRINGS", "loads_answer"]
