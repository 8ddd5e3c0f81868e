"""A synthetic recorded run of any size (a trace and a results file, no tape), seeded, for the report's scale test
and its benchmark: every path is an edge sequence of today's table, with tokens, masks and logprobs per sample."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson

from fsm_rollout.trace import TRACE_SCHEMA_VERSION, TRANSITION_EVENT

_ENDINGS = (("completed", "env_done"), ("truncated", "max_turns"), ("truncated", "length"))


def write_synthetic_run(
    directory: Path,
    samples: int,
    *,
    group_size: int = 4,
    max_turns: int = 3,
    prompt_tokens: int = 120,
    turn_tokens: int = 60,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``trace.jsonl`` and ``results.jsonl`` for ``samples`` sample runs in groups of ``group_size``;
    returns their paths. Each sample takes 1 to ``max_turns`` turns of about ``turn_tokens`` tokens, with a masked
    observation between turns."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    trace_path, results_path = directory / "trace.jsonl", directory / "results.jsonl"
    with trace_path.open("wb") as trace, results_path.open("wb") as results:
        for number in range(samples):
            events, row = _sample(rng, number, group_size, max_turns, prompt_tokens, turn_tokens)
            trace.write(b"".join(orjson.dumps(line) + b"\n" for line in events))
            results.write(orjson.dumps(row) + b"\n")
    return trace_path, results_path


def _sample(
    rng: random.Random, number: int, group_size: int, max_turns: int, prompt_tokens: int, turn_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One sample run's transition events and results row."""
    group, member = divmod(number, group_size)
    sample_id, session = f"{group}.{member}", f"session-{number}"
    turns = rng.randint(1, max_turns)
    status, reason = _ENDINGS[0] if turns < max_turns else rng.choice(_ENDINGS)
    tokens = [rng.randrange(100, 150_000) for _ in range(prompt_tokens)]
    mask: list[int] = []
    logprobs: list[float] = []
    events: list[dict[str, Any]] = []
    clock = [1_800_000_000.0 + number * 0.01]

    def event(trigger: str, src: str, dst: str, turn: int, dwell: float, **fields: Any) -> None:
        clock[0] += dwell / 1000.0
        events.append({
            "trigger": trigger, "src": src, "dst": dst, "turn": turn, "response_length": len(mask),
            "dwell_ms": round(dwell, 3), **fields, "event": TRANSITION_EVENT, "session_id": session,
            "sample_id": sample_id, "rollout_uid": f"uid{number}", "schema": TRACE_SCHEMA_VERSION,
            "ts": round(clock[0], 6),
        })  # fmt: skip

    event("render", "pending", "rendered", 0, rng.uniform(50, 200), prompt_tokens=prompt_tokens,
          queued_ms=round(rng.uniform(0, 5000), 3))  # fmt: skip
    event("generate", "rendered", "generating", 0, 0.1)
    for turn in range(turns):
        generated = rng.randint(turn_tokens // 2, turn_tokens * 2)
        tokens += [rng.randrange(100, 150_000) for _ in range(generated)]
        mask += [1] * generated
        logprobs += [round(-rng.expovariate(2.0), 4) for _ in range(generated)]
        event("step", "generating", "stepping", turn, rng.uniform(500, 3000), generated_tokens=generated,
              finish="stop", eos_inserted=False)  # fmt: skip
        if turn + 1 == turns:
            event("observe", "stepping", status, turn, 0.5, reason=reason)
            break
        event("observe", "stepping", "observing", turn, 0.5)
        observation = rng.randint(10, 30)
        tokens += [rng.randrange(100, 150_000) for _ in range(observation)]
        mask += [0] * observation
        logprobs += [0.0] * observation
        event("generate", "observing", "generating", turn + 1, 0.2, observation_tokens=observation)
    row = {
        "group_index": group,
        "index": group,
        "prompt": f"synthetic prompt {number}",
        "tokens": tokens,
        "response": f"synthetic response {number}",
        "response_length": len(mask),
        "label": str(group % 7),
        "reward": float(rng.random() < 0.3),
        "loss_mask": mask,
        "rollout_log_probs": logprobs,
        "status": status,
        "metadata": {"group_member": member, "rollout_reason": reason},
        "session_id": session,
    }
    return events, row
