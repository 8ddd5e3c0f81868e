"""How the fake vLLM server turns a scripted turn into a generate answer: vLLM's field checks, its cuts at stop
strings, stop tokens, EOS and ``max_tokens``, and its answer shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fsm_rollout.engine.schema import (
    Finish,
    GenerateAnswer,
    GenerateChoice,
    LogprobEntry,
    RequestError,
    WeightVersionSpan,
    boolean_field,
    check_prompt_room,
    check_single_prompt_extra,
    generate_request_id,
    request_sampling_params,
    request_token_ids,
    resolve_max_tokens,
    server_request_id,
    stop_strings,
    stop_token_ids,
    token_text,
)
from fsm_rollout.testing.fake_vllm.scripting import OMIT, ScriptedTurn

LogprobEntryStyle = Literal["token_id", "token"]

_MIN_LOGPROB = -9999.0  # vLLM clamps logprobs to this in the "token" entry style (-inf is not JSON)


@dataclass(frozen=True)
class GenerateParams:
    """What of a generate request decides the answer."""

    request_id: str
    prompt_ids: tuple[int, ...]
    prompt_len: int
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool


def generate_params(body: Mapping[str, Any], max_model_len: int) -> GenerateParams:
    """The checked parameters of a generate request body; a bad field is a :class:`RequestError`."""
    # vLLM's field checks, in this server's order; everything else in the body is accepted and ignored
    token_ids = request_token_ids(body)
    sampling = request_sampling_params(body)
    check_single_prompt_extra(body)
    request_id = generate_request_id(body, uuid.uuid4().hex)
    prompt_len = len(token_ids)
    check_prompt_room(prompt_len, max_model_len)
    return GenerateParams(
        request_id=request_id,
        prompt_ids=tuple(token_ids),
        prompt_len=prompt_len,
        max_tokens=resolve_max_tokens(sampling, prompt_len=prompt_len, max_model_len=max_model_len),
        stop=stop_strings(sampling.get("stop")),
        stop_token_ids=stop_token_ids(sampling.get("stop_token_ids")),
        ignore_eos=boolean_field(sampling, "ignore_eos", False),
    )


def complete(tokenizer: Any, turn: ScriptedTurn, params: GenerateParams) -> tuple[list[int], Finish]:
    """The tokens vLLM would return for this scripted output, and why it would have stopped."""
    if turn.token_ids is not None:
        scripted = list(turn.token_ids)
    else:
        scripted = as_token_ids(tokenizer.encode(turn.text, add_special_tokens=False))
    end = len(scripted)
    stopped_by_token = False
    stop_at = _first_stop_string_end(tokenizer, scripted, params.stop)
    if stop_at is not None:
        end = stop_at
        stopped_by_token = True
    eos = None if params.ignore_eos else tokenizer.eos_token_id
    for index, token in enumerate(scripted[:end]):
        if token in params.stop_token_ids or token == eos:
            end = index + 1
            stopped_by_token = True
            break
    # Like vLLM's stop check: a stop condition on the last token wins over reaching max_tokens ("length").
    if end > params.max_tokens or (end == params.max_tokens and not stopped_by_token):
        return scripted[: params.max_tokens], "length"
    return scripted[:end], "stop"


def _first_stop_string_end(tokenizer: Any, token_ids: list[int], stop: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix whose text contains a stop string, or None.

    Containment only grows with the prefix, so a binary search over prefix lengths needs log(n) decodes.
    """
    if not stop or not token_ids or not _contains_stop(tokenizer, token_ids, stop):
        return None
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if _contains_stop(tokenizer, token_ids[:middle], stop):
            high = middle
        else:
            low = middle + 1
    return low


def _contains_stop(tokenizer: Any, token_ids: list[int], stop: tuple[str, ...]) -> bool:
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    return any(s in text for s in stop)


def generate_answer(
    params: GenerateParams,
    turn: ScriptedTurn,
    token_ids: list[int],
    finish: Finish,
    *,
    model: str,
    logprob_entry_style: LogprobEntryStyle,
    weight_versions: list[WeightVersionSpan] | None,
    offset: int = 0,
) -> dict[str, Any]:
    """vLLM's generate answer for ``token_ids``, with the turn's logprobs (or the default ones) and extras,
    and ``weight_versions`` unless it is None.

    ``token_ids`` are the turn's output from position ``offset`` on (an interrupted turn's continuation), so
    the logprobs are taken from there too.
    """
    end = offset + len(token_ids)
    if turn.logprobs is not None:
        logprobs = list(turn.logprobs[offset:end])
    else:
        logprobs = [-0.01 * (i + 1) for i in range(offset, end)]
    if len(logprobs) != len(token_ids):
        raise RequestError(
            500, f"fake vLLM: the scripted turn has {len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    choice: GenerateChoice = {
        "index": 0,
        "finish_reason": finish,
        "token_ids": token_ids,
        "logprobs": {
            "content": [
                logprob_entry(logprob_entry_style, t, lp) for t, lp in zip(token_ids, logprobs, strict=True)
            ]
        },
        "routed_experts": None,
        "sampling_mask": None,
    }
    if weight_versions is not None:
        choice["weight_versions"] = weight_versions
    answer: GenerateAnswer = {
        "request_id": server_request_id(params.request_id),
        "model": model,
        "created": int(time.time()),
        "choices": [choice],
        "usage": {
            "prompt_tokens": params.prompt_len,
            "completion_tokens": len(token_ids),
            "total_tokens": params.prompt_len + len(token_ids),
        },
    }
    # the extras are free-form (for schema-violation tests): merged outside the record types
    return _merged({**answer, "choices": [_merged(choice, turn.choice_extra)]}, turn.top_extra)


def _merged(record: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**record, **extra}
    return {key: value for key, value in merged.items() if value is not OMIT}


def version_spans(runs: Iterable[tuple[str, int]]) -> list[WeightVersionSpan]:
    """``choices[0].weight_versions`` for consecutive runs of ``(version, token count)``: half-open spans over
    the output, neighbours of one version merged, empty runs left out."""
    spans: list[WeightVersionSpan] = []
    start = 0
    for version, count in runs:
        if count <= 0:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] += count
        else:
            spans.append({"version": version, "start": start, "end": start + count})
        start += count
    return spans


def logprob_entry(style: LogprobEntryStyle, token_id: int, logprob: float) -> LogprobEntry:
    """One ``logprobs.content`` entry in either of vLLM's two shapes."""
    if style == "token":
        return {
            "token": token_text(token_id),
            "logprob": max(logprob, _MIN_LOGPROB),
            "top_logprobs": [],
        }
    return {"token_id": token_id, "logprob": logprob, "rank": 1, "top_logprobs": []}


def as_token_ids(encoded: Any) -> list[int]:
    """Token ids from a tokenizer result: a list, a mapping (``BatchEncoding``) with ``input_ids``, or a batch
    of one."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if len(ids) == 1 and isinstance(ids[0], list | tuple):
        ids = list(ids[0])
    return [int(token) for token in ids]
