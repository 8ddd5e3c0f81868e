"""The bench server's canned answers: one conversation (one prompt, one answer) answered through the serving frame
(:mod:`fsm_rollout.engine.serving`), and the HTTP response bytes that carry them.

Every request is checked as vLLM checks it and errors get vLLM's bodies; render answers the canned prompt with the
request's sampling fields (a conversation of more than one message, a fork policy's re-render, goes through the
chat template); generate answers the canned answer cut by the request's ``max_tokens``, ``min_tokens``,
stop strings and stop tokens (:func:`~fsm_rollout.engine.stop_strings.cut_at_stop`), under the request's id. Cuts
and answer bodies are cached, so a repeated request costs a JSON parse, the checks and a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

import orjson

from fsm_rollout.cli.bench.params import ANSWER, PROMPT
from fsm_rollout.engine.schema import server_request_id
from fsm_rollout.engine.serving import (
    GenerateOutcome,
    GenerateRequest,
    generate_answer,
    parse_generate_request,
    parse_render_request,
    read_json,
    render_answer,
)
from fsm_rollout.engine.stop_strings import StopCut, cut_at_stop

MODEL: Final = "fake-model"
"""The served model name (the fake vLLM server's default, which the bench's configs name)."""
MAX_MODEL_LEN: Final = 4096

_CACHE_LIMIT = 4096
"""Cached cuts and answer bodies (by sampling fields and prompt length) before the caches start over."""
_ID_MARK = "@@request-id@@"
"""Stands for the request id in a cached answer body, so one body serves every request id."""


@dataclass(frozen=True)
class Canned:
    """The canned conversation: the prompt's token ids (the chat template's rendering of :data:`PROMPT`), the
    answer's (:data:`ANSWER` and EOS) with the fake server's default logprobs, and how to decode token ids."""

    prompt: list[int]
    answer: list[int]
    logprobs: list[float]
    eos_token_id: int
    decode: Callable[[Sequence[int], bool], str]
    render: Callable[[Any], list[int]]
    """The chat template's rendering of a longer conversation (a fork policy's re-render), with a generation prompt."""


def load_canned() -> Canned:
    """The canned conversation, rendered and encoded with the Qwen tokenizer the tests use."""
    from fsm_rollout.testing.fake_vllm.generation import as_token_ids
    from fsm_rollout.testing.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    eos_token_id = tokenizer.eos_token_id
    if not isinstance(eos_token_id, int):
        raise RuntimeError(f"bench server: the tokenizer has no EOS token id (got {eos_token_id!r})")
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), eos_token_id]

    def decode(token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render(messages: Any) -> list[int]:
        return as_token_ids(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    return Canned(
        prompt=as_token_ids(prompt),
        answer=answer,
        logprobs=[-0.01 * (index + 1) for index in range(len(answer))],
        eos_token_id=eos_token_id,
        decode=decode,
        render=render,
    )


def _entries(token_ids: Sequence[int], logprobs: Sequence[float], top: int | None) -> list[Any]:
    """The answer's ``logprobs.content``, with the fake server's candidates for a request's ``logprobs``."""
    from fsm_rollout.testing.fake_vllm.generation import logprob_entry

    return [
        logprob_entry("token_id", token, logprob, top=top) for token, logprob in zip(token_ids, logprobs, strict=True)
    ]


_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}


def http_response(body: bytes, status: int = 200) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        status,
        _REASONS.get(status, "Error").encode(),
        len(body),
    )
    return head + body


def status_response(answer: tuple[int, bytes]) -> bytes:
    status, body = answer
    return http_response(body, status)


def json_response(value: Any, status: int = 200) -> bytes:
    return http_response(orjson.dumps(value), status)


class Answers:
    """What the canned server answers each endpoint, through the serving frame (see the module docstring)."""

    def __init__(self, canned: Canned) -> None:
        self.canned = canned
        self._cuts: dict[tuple[Any, ...], StopCut] = {}
        self._bodies: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}

    def render(self, raw: bytes) -> bytes:
        parsed = parse_render_request(read_json(raw), MODEL)
        # the canned prompt for a first render; a whole conversation (a fork policy's re-render) through the template
        prompt = self.canned.prompt if len(parsed.messages) == 1 else self.canned.render(parsed.messages)
        return json_response(render_answer(parsed, prompt, None, model=MODEL, max_model_len=MAX_MODEL_LEN))

    def parse_generate(self, raw: bytes) -> GenerateRequest:
        return parse_generate_request(read_json(raw), MODEL, max_model_len=MAX_MODEL_LEN)

    def generate(self, request: GenerateRequest, version: str) -> bytes:
        """The canned answer cut for this request, under its id, its tokens labelled ``version``."""
        settings = request.settings
        key = (
            settings.max_tokens,
            settings.min_tokens,
            settings.stop,
            settings.stop_token_ids,
            settings.ignore_eos,
            settings.skip_special_tokens,
        )
        cut = self._cuts.get(key)
        if cut is None:
            canned = self.canned
            skip = settings.skip_special_tokens
            cut = self._cuts[key] = cut_at_stop(
                canned.answer,
                max_tokens=settings.max_tokens,
                min_tokens=settings.min_tokens,
                stop=settings.stop,
                stop_token_ids=settings.stop_token_ids,
                eos_token_id=None if settings.ignore_eos else canned.eos_token_id,
                decode=lambda ids: canned.decode(ids, skip),
            )
            if len(self._cuts) > _CACHE_LIMIT:
                self._cuts = {key: cut}
        count = len(cut.token_ids)
        return self.answer(request, 0, count, cut.finish, ((version, 0, count),) if count else (), cut.stop_reason)

    def answer(
        self,
        request: GenerateRequest,
        start: int,
        end: int,
        finish: str,
        spans: tuple[tuple[str, int, int], ...],
        stop_reason: str | int | None = None,
    ) -> bytes:
        """A generate answer of the canned answer's tokens ``start:end`` whose versions are ``spans`` (positions in
        the answer, from ``start``), for ``request``."""
        key = (request.prompt_len, start, end, finish, spans, stop_reason, request.settings.logprobs)
        parts = self._bodies.get(key)
        if parts is None:
            outcome = GenerateOutcome(
                token_ids=self.canned.answer[start:end],
                finish=finish,  # type: ignore[arg-type]
                logprobs=_entries(
                    self.canned.answer[start:end], self.canned.logprobs[start:end], request.settings.logprobs
                ),
                weight_versions=[{"version": version, "start": first, "end": last} for version, first, last in spans],
                stop_reason=stop_reason,
            )
            body = orjson.dumps(generate_answer(_ID_MARK, request.prompt_len, outcome, model=MODEL))
            head, _, tail = body.partition(orjson.dumps(server_request_id(_ID_MARK)))
            parts = self._bodies[key] = (head, tail)
            if len(self._bodies) > _CACHE_LIMIT:
                self._bodies = {key: parts}
        head, tail = parts
        return http_response(head + orjson.dumps(server_request_id(request.request_id)) + tail)
