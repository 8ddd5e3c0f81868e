"""Internal: vLLM's streamed generate (``POST /inference/v1/generate`` with ``"stream": true``), both directions.

vLLM 0.32 answers a streamed generate with Server-Sent Events: one ``data:`` line per engine step that produced
tokens, each a ``GenerateTokensStreamResponse`` (``request_id``, ``usage``, ``output_mode``, ``choices[0]`` with
``index``, ``finish_reason``, ``stop_reason``, ``token_ids`` (the new ones), ``routed_experts``, ``sampling_mask``,
``weight_versions`` (the last chunk only, over the whole output) and ``logprobs``), a terminal chunk with the
``finish_reason`` (an abort's has no tokens), with ``stream_options.include_usage`` a chunk with no choices and
the usage, then ``data: [DONE]``. An error mid-stream is a ``data:`` line holding vLLM's error body.

The servers' side (:func:`stream_chunk`, :func:`usage_chunk`, :func:`stream_flags`) is shared by the embedded engine
and the fake server; the client's side (:class:`StreamAssembly`) hands each chunk's tokens to a
:data:`TokenSink` and rebuilds the non-streaming answer from the chunks, which the client then parses exactly as a
whole answer: the turn is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsm_rollout.engine.schema import (
    LogprobEntry,
    RequestError,
    WeightVersionSpan,
    parse_logprobs,
    server_request_id,
)
from fsm_rollout.errors import GenerationError

__all__ = ["DONE", "StreamAssembly", "StreamRefused", "TokenSink", "stream_chunk", "stream_flags", "usage_chunk"]

TokenSink = Callable[[list[int], list[float]], None]
"""Called with each streamed chunk's new token ids and their logprobs, in order, as they arrive."""

DONE = "[DONE]"


class StreamRefused(Exception):
    """Internal: the server met a streamed generate with its whole answer (``answer``: a plain JSON body, not
    Server-Sent Events), as a server that does not read ``stream`` does; the request is answered, nothing is to be
    sent again."""

    def __init__(self, answer: Any) -> None:
        super().__init__("the server answered a streamed generate with a plain JSON body")
        self.answer = answer


def stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a generate body, checked as vLLM's pydantic model checks them: ``stream`` a
    boolean or null, ``stream_options`` null or an object of ``include_usage`` / ``continuous_usage_stats``
    booleans."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, f"stream: Input should be a valid boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, Mapping):
        raise RequestError(400, f"stream_options: Input should be an object, got {options!r}", "stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "continuous_usage_stats"):
            raise RequestError(400, f"stream_options.{name}: Extra inputs are not permitted", "stream_options")
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, f"stream_options.{name}: Input should be a valid boolean", "stream_options")
    return bool(stream), bool(stream) and bool(options.get("include_usage"))


def stream_chunk(
    request_id: str,
    token_ids: Sequence[int],
    logprobs: Sequence[LogprobEntry] | None,
    *,
    finish: str | None = None,
    stop_reason: str | int | None = None,
    weight_versions: list[WeightVersionSpan] | None = None,
) -> dict[str, Any]:
    """One ``GenerateTokensStreamResponse`` chunk, its fields in vLLM's order (``prompt_token_ids``,
    ``mm_placeholders`` and ``metrics`` left out, as vLLM leaves them out of token-bearing chunks)."""
    return {
        "request_id": server_request_id(request_id),
        "usage": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": stop_reason if finish == "stop" else None,
                "token_ids": list(token_ids),
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": weight_versions if finish is not None else None,
                "logprobs": None if logprobs is None else {"content": list(logprobs)},
            }
        ],
    }


def usage_chunk(request_id: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage (``exclude_none``, as vLLM)."""
    return {
        "request_id": server_request_id(request_id),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        },
        "output_mode": "tokens",
        "choices": [],
    }


class StreamAssembly:
    """The client's side: feed it each ``data:`` payload (decoded JSON, or the ``[DONE]`` text) in order; it hands
    new tokens to ``sink`` and :meth:`answer` is the non-streaming answer the chunks add up to."""

    def __init__(self, sink: TokenSink | None) -> None:
        self._sink = sink
        self._token_ids: list[int] = []
        self._logprobs: list[Any] | None = None
        self._choice: dict[str, Any] = {}
        self._top: dict[str, Any] = {}
        self.done = False

    def feed(self, payload: Any) -> None:
        if payload == DONE:
            self.done = True
            return
        if not isinstance(payload, Mapping):
            raise GenerationError(f"vLLM generate stream: a chunk is not a JSON object: {str(payload)[:200]!r}")
        if "error" in payload and "choices" not in payload:
            raise GenerationError(f"vLLM generate stream failed: {payload['error']}")
        for key in ("request_id", "usage", "metrics"):
            if payload.get(key) is not None:
                self._top[key] = payload[key]
        choices = payload.get("choices")
        if not isinstance(choices, list):
            raise GenerationError(f"vLLM generate stream: a chunk has no choices list: {str(payload)[:200]!r}")
        for choice in choices:
            self._take(choice)

    def _take(self, choice: Any) -> None:
        if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
            raise GenerationError(f"vLLM generate stream: unexpected choice {str(choice)[:200]!r}")
        if choice.get("routed_experts") is not None or choice.get("sampling_mask") is not None:
            raise GenerationError("vLLM generate stream: routed experts and sampling masks are not streamed here")
        token_ids = choice.get("token_ids") or []
        if not isinstance(token_ids, list):
            raise GenerationError(f"vLLM generate stream: token_ids must be a list, got {token_ids!r}")
        logprobs = choice.get("logprobs")
        values: list[float] = []
        if token_ids:
            content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
            if content is not None:
                values = parse_logprobs({"logprobs": logprobs}, token_ids)
                if self._logprobs is None:
                    self._logprobs = []
                self._logprobs.extend(content)  # in place: a copy per chunk is quadratic in the answer's length
            elif self._logprobs is not None:
                raise GenerationError("vLLM generate stream: a chunk without logprobs after chunks with them")
            self._token_ids.extend(token_ids)
        for key in ("finish_reason", "stop_reason", "weight_versions"):
            if choice.get(key) is not None:
                self._choice[key] = choice[key]
        if token_ids and self._sink is not None:
            self._sink(list(token_ids), values)

    def answer(self) -> dict[str, Any]:
        """The whole answer, shaped as vLLM's non-streaming ``GenerateResponse``."""
        if "finish_reason" not in self._choice:
            raise GenerationError("vLLM generate stream ended without a finish_reason")
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": self._choice["finish_reason"],
            "stop_reason": self._choice.get("stop_reason"),
            "token_ids": self._token_ids,
            "logprobs": None if self._logprobs is None else {"content": self._logprobs},
        }
        if "weight_versions" in self._choice:
            choice["weight_versions"] = self._choice["weight_versions"]
        return {**self._top, "choices": [choice]}
