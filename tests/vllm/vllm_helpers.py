"""Helpers of the real-vLLM tier: direct calls to the server (probes, metrics) and assertions shared by tests."""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from fsm_rollout.engine.schema import ABORT_PATH, GENERATE_PATH, RENDER_PATH

__all__ = [
    "ABORT_PATH",
    "ASCII_STOPS",
    "GENERATE_PATH",
    "OBSERVATION",
    "RENDER_PATH",
    "SERVED_MODEL",
    "GreedyProbe",
    "assert_logprobs_aligned",
    "greedy_probe",
    "metrics",
    "partial_stop_string",
    "pick_stop_string",
    "pick_stop_token",
]

SERVED_MODEL = "tiny-qwen2"
OBSERVATION = "Continue the reasoning."
#: Stop strings that end almost every turn of the random model within a few tokens (any ASCII letter).
ASCII_STOPS = list(string.ascii_letters)


async def post(url: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        answer.raise_for_status()
        return await answer.json()


@dataclass
class GreedyProbe:
    """What the server generates greedily (temperature 0) for a prompt: the tokens and their texts."""

    prompt_ids: list[int]
    token_ids: list[int]
    texts: list[str]


async def greedy_probe(base_url: str, prompt: str, tokenizer: Any, max_tokens: int = 48) -> GreedyProbe:
    """Render ``prompt`` as one user message and generate ``max_tokens`` tokens greedily, directly at vLLM."""
    rendered = await post(
        base_url + RENDER_PATH, {"model": SERVED_MODEL, "messages": [{"role": "user", "content": prompt}]}
    )
    answer = await post(
        base_url + GENERATE_PATH,
        {
            "token_ids": rendered["token_ids"],
            "model": SERVED_MODEL,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1},
        },
    )
    token_ids = answer["choices"][0]["token_ids"]
    return GreedyProbe(
        prompt_ids=rendered["token_ids"],
        token_ids=token_ids,
        texts=[tokenizer.decode([token], skip_special_tokens=False) for token in token_ids],
    )


def _clean(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and text.isprintable()


def pick_stop_token(probe: GreedyProbe, tokenizer: Any, start: int = 3) -> int:
    """An index ``k >= start`` whose token first occurs there and is an ordinary token (not EOS/special)."""
    specials = set(tokenizer.all_special_ids)
    for k in range(start, len(probe.token_ids) - 4):
        token = probe.token_ids[k]
        if token not in probe.token_ids[:k] and token not in specials and token < len(tokenizer):
            return k
    raise AssertionError(f"no usable stop token in the greedy output {probe.token_ids}")


def pick_stop_string(probe: GreedyProbe, tokenizer: Any, start: int = 3, *, min_len: int = 4) -> tuple[int, str]:
    """An index ``k >= start`` and a stop string (the stripped text of token ``k``) whose first occurrence in the
    decoded greedy output ends exactly at the end of token ``k``, so vLLM stops right after token ``k``."""
    for k in range(start, len(probe.token_ids) - 4):
        candidate = probe.texts[k].strip()
        if len(candidate) < min_len or not _clean(candidate) or not candidate.isascii():
            continue
        through = tokenizer.decode(probe.token_ids[: k + 1], skip_special_tokens=False)
        if through.find(candidate) == len(through) - len(candidate):
            return k, candidate
    raise AssertionError(f"no usable stop string in the greedy output {probe.texts}")


def partial_stop_string(probe: GreedyProbe, tokenizer: Any, k: int, candidate: str) -> str:
    """A stop string that completes inside token ``k`` but is not a suffix of the text through token ``k``."""
    partial = candidate[:-1]
    before = tokenizer.decode(probe.token_ids[:k], skip_special_tokens=False)
    through = tokenizer.decode(probe.token_ids[: k + 1], skip_special_tokens=False)
    assert partial not in before and partial in through and not through.endswith(partial), (partial, through)
    return partial


async def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over labels (``name -> value``)."""
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as answer:
        text = await answer.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def assert_logprobs_aligned(response: dict[str, Any]) -> list[float]:
    """One finite, non-positive logprob per generated token, each entry naming its token; returns the values."""
    choice = response["choices"][0]
    token_ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(token_ids)
    values = []
    for token, entry in zip(token_ids, content, strict=True):
        assert entry["token_id"] == token
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0.0
        values.append(entry["logprob"])
    return values


def model_positions(loss_mask: Sequence[int]) -> list[int]:
    return [index for index, bit in enumerate(loss_mask) if bit == 1]
