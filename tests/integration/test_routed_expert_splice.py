"""Routed experts across weight updates, against the fake vLLM server with per-version routes: a turn cut by one
or two suspensions gets each row of routing from the request that sampled the token it produced (the prompt from
the first request that prefilled it), and ``metadata["routed_expert_spans"]`` says which request and version. The
suspensions land where the server holds a request, so nothing depends on timing."""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsm_rollout import RolloutConfig, RolloutRunner, Sample, get_tracer
from fsm_rollout.engine.schema import GENERATE_PATH
from fsm_rollout.replay import replay_async
from fsm_rollout.rollout import Rollout
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.fake_vllm.routes import version_routes

DIMS = (2, 3)
SAMPLING = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0}
TEXT = "Let me think step by step about six times seven, then answer forty two."


def config(server: FakeVLLMServer, tmp_path: Path | None = None, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": server.url,
        "model": server.model,
        "max_turns": 1,
        "check_invariants": True,
        "router_policy": "consistent_hash",
        "use_rollout_routing_replay": True,
        "num_layers": DIMS[0],
        "moe_router_topk": DIMS[1],
    }
    if tmp_path is not None:
        values.update(trace=str(tmp_path / "run.jsonl"), record=True)
    values.update(overrides)
    return RolloutConfig(**values)


async def run_with_updates(
    server: FakeVLLMServer, holds: tuple[int, ...], versions: list[str], tmp_path: Path | None = None
) -> Sample:
    """One turn held after ``holds[0]`` tokens (and its continuations after ``holds[1:]`` more); each hold is cut
    by a weight update to the next of ``versions``."""
    turn = ScriptedTurn(text=TEXT, hang=True, held_after=holds[0], held_again_after=holds[1:])
    server.script([turn], session="s0")
    async with RolloutRunner(
        config(server, tmp_path), sampling_params=SAMPLING, tokenizer=server.tokenizer, env_factory=ScriptedEnvFactory()
    ) as runner:
        run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0, session_id="s0")))
        for version in versions:
            await server.wait_until_waiting(1)  # the request is held with its tokens so far
            async with runner.weight_update(version=version):
                pass
        return await run


def expected_routes(bounds: list[tuple[str, int, int]]) -> Any:
    return np.concatenate([version_routes(version, start, end, DIMS) for version, start, end in bounds])


def routes(sample: Sample) -> Any:
    assert sample.rollout_routed_experts is not None
    return sample.rollout_routed_experts


def generate_ids(server: FakeVLLMServer) -> list[str]:
    return [str(request.body["request_id"]) for request in server.requests_to(GENERATE_PATH)]


@pytest.mark.parametrize(
    ("holds", "versions"),
    [((5,), ["v1"]), ((4, 6), ["v1", "v2"]), ((0, 3), ["v1", "v2"])],
    ids=["one-suspension", "two-suspensions", "cut-before-any-token"],
)
async def test_each_row_comes_from_the_request_that_sampled_its_token(
    tokenizer: Any, holds: tuple[int, ...], versions: list[str]
) -> None:
    async with FakeVLLMServer(tokenizer, routed_experts=DIMS, routes_on_abort=True) as server:
        sample = await run_with_updates(server, holds, versions)
        ids = generate_ids(server)
    assert sample.response_length > sum(holds)  # the last request produced tokens too
    prompt = len(sample.tokens) - sample.response_length
    rows = len(sample.tokens) - 1
    all_versions = ["default", *versions]
    # the requests whose tokens the turn kept (one cut before any token leaves nothing), with their prompt lengths;
    # each owns the rows from its prompt length less one (the pass that produced its first token), the first from 0
    kept = [k for k in range(len(all_versions)) if k == len(holds) or holds[k] > 0]
    prompts = {k: prompt + sum(holds[:k]) for k in kept}
    starts = [0, *(prompts[k] - 1 for k in kept[1:])]
    bounds = [(all_versions[k], starts[i], [*starts, rows][i + 1]) for i, k in enumerate(kept)]
    assert np.array_equal(routes(sample), expected_routes(bounds))
    assert sample.metadata["routed_expert_spans"] == [
        {"request_id": ids[k], "weight_version": version, "start": start, "end": end}
        for k, (version, start, end) in zip(kept, bounds, strict=True)
    ]
    # the token logprobs' versions agree with the routes' versions
    token_versions = [(span["version"], span["start"], span["end"]) for span in sample.metadata["weight_version_spans"]]
    assert [version for version, _, _ in token_versions] == [v for v, start, end in bounds if end > prompt - 1]


async def test_without_routes_on_abort_the_next_request_fills_the_rows_and_says_so(tokenizer: Any) -> None:
    """vLLM's abort answer carries no routes: the rows of the tokens sampled before the cut are the continuation's
    (computed under the new version), and the spans name the continuation for them."""
    async with FakeVLLMServer(tokenizer, routed_experts=DIMS) as server:
        sample = await run_with_updates(server, (5,), ["v1"])
        ids = generate_ids(server)
    rows = len(sample.tokens) - 1
    assert np.array_equal(routes(sample), version_routes("v1", 0, rows, DIMS))
    assert sample.metadata["routed_expert_spans"] == [
        {"request_id": ids[1], "weight_version": "v1", "start": 0, "end": rows}
    ]
    assert [span["version"] for span in sample.metadata["weight_version_spans"]] == ["default", "v1"]


async def test_a_request_frozen_across_an_update_splits_its_rows_by_version(tokenizer: Any) -> None:
    async with FakeVLLMServer(tokenizer, routed_experts=DIMS) as server:
        server.script([ScriptedTurn(text=TEXT, hang=True, held_after=4)], session="s0")
        async with RolloutRunner(
            config(server, weight_update_strategy="keep"),
            sampling_params=SAMPLING,
            tokenizer=tokenizer,
            env_factory=ScriptedEnvFactory(),
        ) as runner:
            run = asyncio.ensure_future(runner.run(Sample(prompt="p", index=0, session_id="s0")))
            await server.wait_until_waiting(1)
            async with runner.weight_update(version="v1"):
                pass
            (request_id,) = server.held_request_ids
            server.release(request_id)
            sample = await run
    prompt = len(sample.tokens) - sample.response_length
    rows = len(sample.tokens) - 1
    cut = prompt - 1 + 4
    assert np.array_equal(routes(sample), expected_routes([("default", 0, cut), ("v1", cut, rows)]))
    assert [(s["weight_version"], s["start"], s["end"]) for s in sample.metadata["routed_expert_spans"]] == [
        ("default", 0, cut),
        ("v1", cut, rows),
    ]


def test_the_fake_refuses_routes_of_a_bad_shape(tokenizer: Any) -> None:
    for dims in [(0, 2), (2,), [2, 2], (2, 2.0)]:
        with pytest.raises(ValueError, match="routed_experts must be"):
            FakeVLLMServer(tokenizer, routed_experts=dims)  # type: ignore[arg-type]


async def test_a_replayed_tape_splices_the_same_routes(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reexecute = importlib.import_module("fsm_rollout.replay.reexecute")

    async with FakeVLLMServer(tokenizer, routed_experts=DIMS, routes_on_abort=True) as server:
        recorded = await run_with_updates(server, (4, 6), ["v1", "v2"], tmp_path)
    get_tracer(str(tmp_path / "run.jsonl")).close()  # the sink is shared per path: close it before reading
    replayed: list[Any] = []

    class Capturing(Rollout):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            replayed.append(self)

    monkeypatch.setattr(reexecute, "Rollout", Capturing)
    report = await replay_async(tmp_path / "run.jsonl", tokenizer=tokenizer)
    assert report.counts() == {"identical": 1}, report.render(verbose=True)
    (rollout,) = replayed
    assert len(recorded.metadata["routed_expert_spans"]) == 3
    assert rollout.sample.metadata["routed_expert_spans"] == recorded.metadata["routed_expert_spans"]
    assert np.array_equal(routes(rollout.sample), routes(recorded))
