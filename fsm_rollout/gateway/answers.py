"""Internal: a gateway answer read from the model's turn: its text decoded from the turn's own tokens (the end
tokens left out), its tool calls parsed, and why it finished. Nothing is re-tokenized."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

from fsm_rollout.envs.step import Turn
from fsm_rollout.gateway.openai_wire import TurnAnswer
from fsm_rollout.tokens.tool_calls import parse_tool_calls


class TokenText:
    """Reads an answer's text from its tokens: the tokenizer's end tokens and a decode, found once per gateway.

    A fast tokenizer without clean-up decodes through its backend directly, which is what its ``decode`` returns
    without the per-call wrapper work."""

    def __init__(self, tokenizer: Any, sampling_params: Mapping[str, Any]) -> None:
        ends = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
        ends.update(sampling_params.get("stop_token_ids") or ())
        self.end_token_ids: frozenset[int] = frozenset(token for token in ends if isinstance(token, int))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            self._decode: Callable[..., str] = backend.decode
        else:
            self._decode = tokenizer.decode

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids, skip_special_tokens=False) if token_ids else ""

    def thinking_length(self, text_ids: list[int], text: str | None = None) -> int:
        """How many of a turn's tokens (end tokens cut) its thinking takes: the shortest prefix whose text holds
        ``</think>``, found by bisection (a prefix's text only grows, so holding the tag is monotone), each probe
        one decode; none closes it: the whole turn (cut inside its thinking). ``text`` is the turn's, decoded."""
        if THINK_CLOSE not in (self.decode(text_ids) if text is None else text):
            return len(text_ids)
        low, high = 1, len(text_ids)  # the answer lies in [low, high]
        while low < high:
            middle = (low + high) // 2
            if THINK_CLOSE in self.decode(text_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low


def read_answer(
    turn: Turn,
    text_of: TokenText,
    *,
    parse_calls: bool,
    max_tokens: int | None,
    with_top_logprobs: bool,
    weight_version: str | None,
    finish: str | None = None,
) -> TurnAnswer:
    """The answer to the waiting call: the turn's tokens, its text without the end tokens, its tool calls (none
    parsed when ``parse_calls`` is False: tool_choice "none" keeps the markup as content)."""
    token_ids = list(turn.token_ids)
    logprobs = [float(logprob) for logprob in turn.logprobs]
    ends = text_of.end_token_ids
    cut = len(token_ids)
    while cut and token_ids[cut - 1] in ends:
        cut -= 1
    text_ids = token_ids[:cut]
    text = text_of.decode(text_ids)
    reasoning, answered = split_reasoning(text)
    found = parse_tool_calls(answered).calls if parse_calls else []
    content = answered
    for call in reversed(found):
        content = content[: call.start] + content[call.end :]
    content = content.strip()
    calls = [
        {"id": f"call_{secrets.token_hex(12)}", "name": call.name, "arguments": dict(call.arguments)} for call in found
    ]
    if finish is None:
        if max_tokens is not None and len(token_ids) >= max_tokens and len(text_ids) == len(token_ids):
            finish = "length"
        else:
            finish = "tool_calls" if calls else "stop"
    top = turn.top_logprobs if with_top_logprobs else None
    return TurnAnswer(
        content=content if content or not calls else None,
        tool_calls=calls,
        finish_reason=finish,
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=len(token_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        weight_version=weight_version,
        top_logprobs=None if top is None else [list(candidates) for candidates in top],
        reasoning=reasoning,
        reasoning_tokens=0 if reasoning is None else text_of.thinking_length(text_ids, text),
    )


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a turn's text: a thinking template's turn starts with its reasoning, closed by
    ``</think>`` (opened by ``<think>``, or by the generation prompt, which then holds the opening tag). A turn
    without the closing tag has no reasoning; a turn cut inside its thinking has no answer yet."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE not in stripped:
        return stripped[len(THINK_OPEN) :].strip(), ""
    end = text.find(THINK_CLOSE)
    if end < 0:
        return None, text
    head = text[:end].lstrip()
    if head.startswith(THINK_OPEN):
        head = head[len(THINK_OPEN) :]
    elif THINK_OPEN in head:  # a closing tag after other text is the model's prose, not a thinking block
        return None, text
    return head.strip(), text[end + len(THINK_CLOSE) :]
