"""How the fake vLLM server turns a scripted turn into a generate answer: the turn cut where vLLM would have stopped
(:func:`fsm_rollout.engine.stop_strings.cut_at_stop`), answered with the serving frame's answer shape."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from fsm_rollout.engine.schema import (
    Finish,
    LogprobEntry,
    RequestError,
    WeightVersionSpan,
    token_text,
)
from fsm_rollout.engine.serving import GenerateOutcome, GenerateRequest, SamplingSettings
from fsm_rollout.engine.serving import generate_answer as frame_answer
from fsm_rollout.engine.stop_strings import StopCut, cut_at_stop
from fsm_rollout.testing.fake_vllm.scripting import OMIT, ScriptedTurn

LogprobEntryStyle = Literal["token_id", "token"]

_MIN_LOGPROB = -9999.0  # vLLM clamps logprobs to this in the "token" entry style (-inf is not JSON)


def complete(tokenizer: Any, turn: ScriptedTurn, settings: SamplingSettings) -> StopCut:
    """The tokens vLLM would return for this scripted output, and why it would have stopped: at the first stop
    token or EOS (not before ``min_tokens``), stop string (decoded as the request says) or ``max_tokens``."""
    if turn.token_ids is not None:
        scripted = list(turn.token_ids)
    else:
        scripted = as_token_ids(tokenizer.encode(turn.text, add_special_tokens=False))

    def decode(token_ids: Any) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=settings.skip_special_tokens))

    return cut_at_stop(
        scripted,
        max_tokens=settings.max_tokens,
        min_tokens=settings.min_tokens,
        stop=settings.stop,
        stop_token_ids=settings.stop_token_ids,
        eos_token_id=None if settings.ignore_eos else tokenizer.eos_token_id,
        decode=decode,
    )


def generate_answer(
    request: GenerateRequest,
    turn: ScriptedTurn,
    token_ids: list[int],
    finish: Finish,
    *,
    model: str,
    logprob_entry_style: LogprobEntryStyle,
    weight_versions: list[WeightVersionSpan] | None,
    stop_reason: str | int | None = None,
    offset: int = 0,
    routed_experts: str | None = None,
) -> dict[str, Any]:
    """vLLM's generate answer for ``token_ids``, with the turn's logprobs (or the default ones), the turn's extras,
    and ``weight_versions`` unless it is None; ``routed_experts`` (base64 ``.npy``) when given.

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
    # Sent even when the request asks for none (vLLM then says null): the fake's tests read them either way.
    top = request.settings.logprobs
    entries = [logprob_entry(logprob_entry_style, t, lp, top=top) for t, lp in zip(token_ids, logprobs, strict=True)]
    outcome = GenerateOutcome(
        token_ids=token_ids, finish=finish, logprobs=entries, weight_versions=weight_versions, stop_reason=stop_reason
    )
    answer: Mapping[str, Any] = frame_answer(request.request_id, request.prompt_len, outcome, model=model)
    choice: dict[str, Any] = dict(answer["choices"][0])
    if routed_experts is not None:
        choice["routed_experts"] = routed_experts
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


def logprob_entry(style: LogprobEntryStyle, token_id: int, logprob: float, *, top: int | None = None) -> LogprobEntry:
    """One ``logprobs.content`` entry in either of vLLM's two shapes.

    With ``top`` (the request's ``logprobs``) it lists ``max(top, 1)`` candidates as vLLM does: the sampled token
    first, then made-up others, each less likely than the one before (so the sampled token is the argmax, as a
    greedy draw's is) and distinct from it. Without (the request asked for no logprobs), none.
    """
    candidates = [] if top is None else _candidates(token_id, logprob, max(top, 1))
    if style == "token":
        return {
            "token": token_text(token_id),
            "logprob": max(logprob, _MIN_LOGPROB),
            "top_logprobs": [
                {"token": token_text(candidate), "logprob": max(value, _MIN_LOGPROB)}  # type: ignore[typeddict-item]
                for candidate, value, _ in candidates
            ],
        }
    return {
        "token_id": token_id,
        "logprob": logprob,
        "rank": 1,
        "top_logprobs": [
            {"token_id": candidate, "logprob": value, "rank": rank} for candidate, value, rank in candidates
        ],
    }


def _candidates(token_id: int, logprob: float, count: int) -> list[tuple[int, float, int]]:
    """``count`` candidates ``(token_id, logprob, rank)``: the sampled token, then the ids below it (above it for the
    first few ids), one nat less likely each."""
    others = [token_id - step if token_id >= count else token_id + step for step in range(1, count)]
    return [(token_id, logprob, 1)] + [(other, logprob - step, step + 1) for step, other in enumerate(others, 1)]


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
