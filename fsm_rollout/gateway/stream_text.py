"""Internal: an answer's text as its tokens stream in, safe to show before the turn ends.

:class:`AnswerStream` decodes the tokens so far (the turn's own, never re-tokenized; end tokens left out, as
:func:`~fsm_rollout.gateway.answers.read_answer` leaves them out) and says which new reasoning and content text may
go to the agent now. It holds back whatever the finished answer could still read differently: an incomplete
character, trailing whitespace (the answer is stripped), a ``<tool_call>`` block and anything after it (tool calls
go out at the end), a tail that may be the start of ``<think>``, ``</think>``, ``<tool_call>`` or a stop string (the
answer leaves the stop string out). Whatever is held back goes out with the finished answer, so what was streamed
is always a prefix of the answer's text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fsm_rollout.gateway.answers import THINK_CLOSE, THINK_OPEN, TokenText
from fsm_rollout.tokens.tool_calls import OPEN_TAG

__all__ = ["AnswerStream", "Listener", "TokenFanout", "opens_thinking"]

Listener = Callable[[list[int], bool, int], None]
"""Gets a streaming turn's new token ids, whether its prompt opened a thinking block, and the prompt's length."""


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt's generation prompt opened a thinking block (the turn then starts with its reasoning)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def _partial_tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _before(text: str, marker: str) -> tuple[str, bool]:
    """``text`` up to ``marker`` (found), or without a tail that may begin it."""
    index = text.find(marker)
    if index >= 0:
        return text[:index], True
    return text[: len(text) - _partial_tail(text, marker)], False


class AnswerStream:
    """The reasoning and content of a streaming answer, safe parts first (see the module docstring)."""

    def __init__(self, text_of: TokenText, *, parse_calls: bool, stops: Sequence[str] = ()) -> None:
        self._text_of = text_of
        self._parse_calls = parse_calls
        self._stops = [stop for stop in stops if stop]
        self._token_ids: list[int] = []
        self.reasoning = ""
        """The reasoning text sent so far."""
        self.content = ""
        """The content text sent so far."""

    def feed(self, token_ids: Sequence[int], *, opened: bool = False) -> list[tuple[str, str]]:
        """Take new tokens; the new text that may be sent now, as ``("reasoning" | "content", delta)`` pairs.
        ``opened``: the prompt opened a thinking block."""
        self._token_ids.extend(token_ids)
        ids = self._token_ids
        cut = len(ids)
        ends = self._text_of.end_token_ids
        while cut and ids[cut - 1] in ends:
            cut -= 1
        text = self._text_of.decode(ids[:cut]).rstrip("\ufffd")  # an incomplete character waits for its bytes
        reasoning, content = self._safe(text, opened)
        out: list[tuple[str, str]] = []
        if reasoning and reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append(("reasoning", reasoning[len(self.reasoning) :]))
            self.reasoning = reasoning
        if content and content.startswith(self.content) and len(content) > len(self.content):
            out.append(("content", content[len(self.content) :]))
            self.content = content
        return out

    def _safe(self, text: str, opened: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if opened or stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN) :] if stripped.startswith(THINK_OPEN) else stripped
            head, closed = _before(body, THINK_CLOSE)
            if not closed:
                return head.strip(), ""
            return head.strip(), self._content(body[len(head) + len(THINK_CLOSE) :])
        if THINK_OPEN.startswith(stripped):  # nothing yet, or what may become the opening tag
            return "", ""
        if THINK_CLOSE in text:  # a closing tag after text: the answer decides (it may read it as reasoning)
            return "", ""
        return "", self._content(text[: len(text) - _partial_tail(text, THINK_CLOSE)])

    def _content(self, text: str) -> str:
        content = text.lstrip()
        if self._parse_calls:
            content, _ = _before(content, OPEN_TAG)
        for stop in self._stops:
            content, _ = _before(content, stop)
        return content.rstrip()


class TokenFanout:
    """The tokens of the turn being generated for a lineage's call, handed to every HTTP call waiting for it (the
    call and a retry attached to it); a listener that comes late gets the tokens so far first."""

    def __init__(self, prompt: Callable[[], tuple[str, int]]) -> None:
        self._prompt = prompt
        self._token_ids: list[int] = []
        self._opened: bool | None = None
        self._prompt_tokens = 0
        self._listeners: list[Listener] = []

    def reset(self) -> None:
        """A new call's turn begins."""
        self._token_ids = []
        self._opened = None

    def push(self, token_ids: list[int], logprobs: list[float]) -> None:
        """The engine's sink: the turn's next tokens."""
        if self._opened is None:
            tail, self._prompt_tokens = self._prompt()
            self._opened = opens_thinking(tail)
        self._token_ids.extend(token_ids)
        for listener in list(self._listeners):
            listener(list(token_ids), self._opened, self._prompt_tokens)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Listen from now on (after the tokens so far); returns the way to stop listening."""
        if self._token_ids:
            listener(list(self._token_ids), bool(self._opened), self._prompt_tokens)
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop
