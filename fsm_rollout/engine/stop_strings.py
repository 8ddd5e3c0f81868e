"""vLLM's stop-string rule, once, for every server that generates and for the client that checks its answers.

vLLM detokenizes the output one token at a time and, after each token, looks for the stop strings (in the order the
request lists them) in the text that token completed: a stop string may begin in earlier text but must end in the
new characters. The first ``min_tokens`` output tokens never stop a request on a stop string: their text is
skipped, so a stop string wholly inside it is never honoured, while one that begins there and ends in a later
token's text is. The token that completes a stop string is the last token returned (token-out answers are not
trimmed), and the matched string is the answer's ``stop_reason``.

:func:`completed_stop_string` is the rule for one decode step (the embedded engine calls it after each token);
:func:`first_stop_string` applies it to a finished list of tokens (the client finds where a merged turn stopped);
:func:`cut_at_stop` adds stop tokens and ``max_tokens`` for the servers whose output is known in advance (the fake
server's scripted turns, the bench server's canned answer). All are pure: the caller supplies the decoding, with the
request's ``skip_special_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["StopCut", "StopStringMatch", "completed_stop_string", "cut_at_stop", "first_stop_string"]


@dataclass(frozen=True)
class StopStringMatch:
    """Where a token list stopped on a stop string: its first ``end`` tokens are the answer (the last of them
    completed the stop string), and ``stop`` is the string vLLM reports as ``stop_reason``."""

    end: int
    stop: str


def completed_stop_string(text: str, checked: int, stop: Sequence[str]) -> str | None:
    """The first of ``stop`` (in request order) that ends past ``text[:checked]``, the text already searched.

    A decode step calls it with the text so far and the length before the step's token (never less than the length
    of the first ``min_tokens`` tokens' text). Empty stop strings never match.
    """
    for item in stop:
        if item and text.find(item, max(0, checked - len(item) + 1)) != -1:
            return item
    return None


def first_stop_string(
    token_ids: Sequence[int],
    stop: Sequence[str],
    decode: Callable[[Sequence[int]], str],
    *,
    min_tokens: int = 0,
) -> StopStringMatch | None:
    """Where vLLM would have stopped generating ``token_ids`` on a stop string, or None when it would not have.

    ``decode`` turns a prefix of ``token_ids`` into text as the server detokenizes (its ``skip_special_tokens``).
    Only a prefix longer than ``min_tokens`` can stop, and only on a stop string that ends past the text of the
    first ``min_tokens`` tokens. Holding such a string only grows with the prefix, so a binary search needs about
    ``log2(len(token_ids))`` decodes.
    """
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    stops = [item for item in _listed(stop) if item]
    if not stops or len(token_ids) <= min_tokens:
        return None
    floor = len(decode(token_ids[:min_tokens])) if min_tokens else 0

    def holds(length: int) -> str | None:
        return completed_stop_string(decode(token_ids[:length]), floor, stops)

    matched = holds(len(token_ids))
    if matched is None:
        return None
    low, high = min_tokens + 1, len(token_ids)  # the prefix of length ``high`` always holds ``matched``
    while low < high:
        middle = (low + high) // 2
        found = holds(middle)
        if found is not None:
            high, matched = middle, found
        else:
            low = middle + 1
    # The shortest prefix's text has no stop string before its last token's characters, so the one found there is
    # the first in request order that this token completed, as vLLM reports it.
    return StopStringMatch(end=high, stop=matched)


@dataclass(frozen=True)
class StopCut:
    """A finished output cut where vLLM would have stopped generating it: the tokens returned, the finish reason
    and ``stop_reason`` (the stop string or stop token id; None for EOS, for ``length`` and for an output that ran
    out without a stop)."""

    token_ids: list[int]
    finish: Literal["stop", "length"]
    stop_reason: str | int | None


def cut_at_stop(
    token_ids: Sequence[int],
    *,
    max_tokens: int,
    min_tokens: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Collection[int] = (),
    eos_token_id: int | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> StopCut:
    """Where vLLM would have stopped while generating ``token_ids`` (a whole output known in advance, as a scripted
    or canned server has), checking after each token as vLLM does:

    1. a stop token (``eos_token_id``, None when the request ignores EOS, or one of ``stop_token_ids``) once at
       least ``min_tokens`` tokens are out (vLLM never samples one earlier; a scripted one earlier is passed over);
    2. a stop string (:func:`first_stop_string`, which needs ``decode``);
    3. ``max_tokens`` (``length``), unless the token reaching it also stopped the output.

    An output that runs out before any of these ends with ``stop`` (the script's end is the model's).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stops = {*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))}
    end: int | None = None
    reason: str | int | None = None
    for index in range(max(min_tokens - 1, 0), min(len(token_ids), max_tokens)):
        if token_ids[index] in stops:
            end, reason = index + 1, None if token_ids[index] == eos_token_id else token_ids[index]
            break
    if any(_listed(stop)):
        if decode is None:
            raise ValueError("cut_at_stop needs decode to find stop strings")
        searched = min(len(token_ids), max_tokens) if end is None else end
        matched = first_stop_string(token_ids[:searched], stop, decode, min_tokens=min_tokens)
        if matched is not None and (end is None or matched.end < end):  # on one token, the stop token wins
            end, reason = matched.end, matched.stop
    if end is not None:
        return StopCut(token_ids=list(token_ids[:end]), finish="stop", stop_reason=reason)
    if len(token_ids) >= max_tokens:
        return StopCut(token_ids=list(token_ids[:max_tokens]), finish="length", stop_reason=None)
    return StopCut(token_ids=list(token_ids), finish="stop", stop_reason=None)


def _listed(stop: Sequence[str]) -> Sequence[str]:
    """A lone string is one stop string (as vLLM reads ``"stop": "x"``), not a list of its characters."""
    return [stop] if isinstance(stop, str) else stop
