"""RolloutRunner: batches, streams, groups, sticky hashing, abort, cancellation, error isolation, metrics."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_rollout import RetryPolicy, RolloutConfig, Sample, Status
from fsm_rollout.cli import main as cli_main
from fsm_rollout.errors import ConfigError
from fsm_rollout.replay import replay
from fsm_rollout.runtime import gc_policy
from fsm_rollout.runtime.hashring import ConsistentHashRing
from fsm_rollout.runtime.runner import RolloutRunner, group_members
from fsm_rollout.runtime.scheduling import SampleQueue
from fsm_rollout.testing.envs import ScriptedEnvFactory
from fsm_rollout.testing.fake_vllm import ABORT_PATH, GENERATE_PATH, RENDER_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.trace import TRANSITION_EVENT

SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


def config_for(url: str, **overrides: Any) -> RolloutConfig:
    values: dict[str, Any] = {
        "engine_url": url,
        "model": "fake-model",
        "max_turns": 2,
        "router_policy": "consistent_hash",
        "check_invariants": True,
        "retry": RetryPolicy(max_attempts=2, base_delay_s=0.001),
    }
    values.update(overrides)
    return RolloutConfig(**values)


def runner_for(server: FakeVLLMServer, tokenizer: Any, **kwargs: Any) -> RolloutRunner:
    envs = kwargs.pop("envs", ScriptedEnvFactory())
    config = kwargs.pop("config", None) or config_for(server.url, **kwargs.pop("config_overrides", {}))
    return RolloutRunner(config, sampling_params=SAMPLING, tokenizer=tokenizer, env_factory=envs, **kwargs)


async def wait_for_generates(server: FakeVLLMServer, count: int) -> None:
    for _ in range(12000):  # up to 120 s: a loaded machine can be slow to get there
        if len(server.requests_to(GENERATE_PATH)) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} generate requests never arrived")


def samples(n: int) -> list[Sample]:
    return [Sample(prompt=f"question {i}", index=i, session_id=f"s{i}") for i in range(n)]


async def test_batch_returns_samples_in_input_order(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    for i in range(6):
        fake_vllm.script([ScriptedTurn(text=f"answer {i}", delay=0.05 * (6 - i))], session=f"s{i}")
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        done = await runner.run_batch(samples(6), concurrency=6)
    assert [sample.index for sample in done] == list(range(6))
    assert [sample.response for sample in done] == [f"answer {i}" for i in range(6)]
    assert all(sample.status == Status.COMPLETED for sample in done)


async def test_stream_yields_samples_as_they_finish(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.script([ScriptedTurn(text="slow", delay=0.4)], session="s0")
    for i in range(1, 4):
        fake_vllm.script([ScriptedTurn(text="fast")], session=f"s{i}")
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        order = [sample.index async for sample in runner.stream(samples(4), concurrency=4)]
    assert sorted(order) == [0, 1, 2, 3]
    assert order[-1] == 0


async def test_concurrency_bounds_requests_in_flight(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    for i in range(8):
        fake_vllm.script([ScriptedTurn(text="x", delay=0.1)], session=f"s{i}")
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    peak = 0
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        task = asyncio.ensure_future(runner.run_batch(samples(8), concurrency=3))
        while not task.done():
            snapshot = runner.metrics()
            running = snapshot.in_flight - snapshot.occupancy.get("pending", 0)
            peak = max(peak, running)
            await asyncio.sleep(0.01)
        await task
    assert 1 <= peak <= 3


async def test_group_copies_share_a_group_index_and_get_their_own_sessions(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="g")] * 4)
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    source = Sample(prompt="q", index=5)
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        group = await runner.run_group(source, 4)
    assert len(group) == 4
    assert {sample.group_index for sample in group} == {5}
    assert len({sample.session_id for sample in group}) == 4
    assert all(sample.status == Status.COMPLETED for sample in group)
    assert source.status == Status.PENDING
    assert sorted(sample.metadata["group_member"] for sample in group) == [0, 1, 2, 3]


async def test_a_seeded_group_sends_each_member_its_own_seed_on_every_turn(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="g")] * 6)
    envs = ScriptedEnvFactory(steps=[("more", False), ("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs, config_overrides={"max_turns": 2}) as runner:
        group = await runner.run_group(Sample(prompt="q", index=2), 3, seed=40)
        with pytest.raises(ConfigError, match="seed"):
            await runner.run_group(Sample(prompt="q", index=3), 2, seed="7")  # type: ignore[arg-type]
    seeds: dict[str, list[int]] = {}
    for request in fake_vllm.requests_to(GENERATE_PATH):
        session = next(sample.session_id for sample in group if str(request.body["request_id"]).startswith(
            str(sample.session_id)))  # fmt: skip
        seeds.setdefault(str(session), []).append(request.body["sampling_params"]["seed"])
    by_member = {sample.metadata["group_member"]: seeds[str(sample.session_id)] for sample in group}
    assert by_member == {0: [40, 40], 1: [41, 41], 2: [42, 42]}
    assert "seed" not in SAMPLING  # the runner's own parameters are left as they were


async def test_a_batch_of_group_members_sends_each_its_seed_by_position(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    # several groups under one concurrency limit, as `fsm-rollout run --n-samples-per-prompt` runs them
    fake_vllm.script([ScriptedTurn(text="g")] * 4)
    groups = [group_members(Sample(prompt="q", index=index), 2) for index in (0, 1)]
    members = [copy for copies, _ in groups for copy in copies]
    names = [name for _, ids in groups for name in ids]  # "0.0" ...: without them two samples would share a name
    async with runner_for(fake_vllm, tokenizer, envs=ScriptedEnvFactory(steps=[("ok", True)])) as runner:
        done = await runner.run_batch(members, concurrency=2, sample_ids=names, seeds=[7, 8, 7, 8])
    sent = {str(request.body["request_id"]): request.body["sampling_params"]["seed"]
            for request in fake_vllm.requests_to(GENERATE_PATH)}  # fmt: skip
    by_sample = {(sample.index, sample.metadata["group_member"]): [seed for request_id, seed in sent.items()
                 if request_id.startswith(str(sample.session_id))] for sample in done}  # fmt: skip
    assert by_sample == {(0, 0): [7], (0, 1): [8], (1, 0): [7], (1, 1): [8]}


@pytest.fixture
async def three_servers(tokenizer: Any) -> AsyncIterator[list[FakeVLLMServer]]:
    servers = [FakeVLLMServer(tokenizer, model="fake-model") for _ in range(3)]
    for server in servers:
        await server.start()
    yield servers
    for server in servers:
        await server.stop()


async def test_several_engines_keep_each_session_on_one_server(
    three_servers: list[FakeVLLMServer], tokenizer: Any
) -> None:
    for server in three_servers:
        server.script([ScriptedTurn(text="t")] * 200)
    urls = [server.url for server in three_servers]
    runner = RolloutRunner(
        config_for(urls[0]),
        sampling_params=SAMPLING,
        tokenizer=tokenizer,
        env_factory=ScriptedEnvFactory(),
        engine_urls=urls,
    )
    batch = [Sample(prompt="q", index=i) for i in range(30)]
    async with runner:
        await runner.run_batch(batch, concurrency=10)
    owners: dict[str, set[int]] = {}
    for position, server in enumerate(three_servers):
        for request in server.requests:
            if request.path in ("/health", "/v1/models"):  # the runner's start-up check of each engine
                continue
            owners.setdefault(request.headers["x-session-id"], set()).add(position)
    assert len(owners) == 30
    assert all(len(servers) == 1 for servers in owners.values())
    assert len({next(iter(servers)) for servers in owners.values()}) > 1


def test_hash_ring_moves_few_keys_when_a_server_joins() -> None:
    keys = [f"session-{i}" for i in range(2000)]
    before = ConsistentHashRing(["http://a", "http://b", "http://c"])
    after = ConsistentHashRing(["http://a", "http://b", "http://c", "http://d"])
    moved = sum(before.url_for(key) != after.url_for(key) for key in keys)
    assert all(after.url_for(key) == "http://d" for key in keys if before.url_for(key) != after.url_for(key))
    assert moved < len(keys) * 0.4


async def test_abort_ends_running_and_queued_samples_and_nothing_is_sent_after(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    for i in range(6):
        fake_vllm.script([ScriptedTurn(text="never", hang=True)], session=f"s{i}")
    async with runner_for(fake_vllm, tokenizer) as runner:
        task = asyncio.ensure_future(runner.run_batch(samples(6), concurrency=3))
        await wait_for_generates(fake_vllm, 3)
        await runner.abort("weight_update")
        sent = len(fake_vllm.requests)
        done = await task
        await asyncio.sleep(0.1)
        assert len(fake_vllm.requests) == sent
        snapshot = runner.metrics()
    assert [sample.status for sample in done] == [Status.ABORTED] * 6
    # the three in flight end with the abort's reason; the three that waited for a slot say they never started
    assert [sample.metadata["rollout_reason"] for sample in done] == ["weight_update"] * 3 + ["not_started"] * 3
    assert all(sample.response == "" and sample.response_length == 0 for sample in done[3:])
    counts = Counter(request.path for request in fake_vllm.requests)
    # one start-up check of the engine, then the three rollouts' requests and their aborts
    assert counts == {"/health": 1, "/v1/models": 1, RENDER_PATH: 3, GENERATE_PATH: 3, ABORT_PATH: 3}
    assert snapshot.in_flight == 0 and snapshot.queued == 0
    assert snapshot.reasons == {"weight_update": 3, "not_started": 3}


async def test_cancelling_a_batch_aborts_its_samples_as_cancelled(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    for i in range(3):
        fake_vllm.script([ScriptedTurn(text="never", hang=True)], session=f"s{i}")
    batch = samples(3)
    async with runner_for(fake_vllm, tokenizer) as runner:
        task = asyncio.ensure_future(runner.run_batch(batch, concurrency=3))
        await wait_for_generates(fake_vllm, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [sample.metadata["rollout_reason"] for sample in batch] == ["cancelled"] * 3
    assert {"s0-turn0", "s1-turn0", "s2-turn0"} <= set(fake_vllm.aborted_request_ids)


async def test_a_failing_sample_does_not_stop_the_batch(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    fake_vllm.script([ScriptedTurn(status=400)], session="s1")
    for i in (0, 2):
        fake_vllm.script([ScriptedTurn(text="ok")], session=f"s{i}")
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        done = await runner.run_batch(samples(3))
        snapshot = runner.metrics()
    assert [sample.status for sample in done] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    assert done[1].metadata["rollout_error"]["type"] == "EngineHTTPError"
    assert snapshot.statuses == {"completed": 2, "failed": 1}


async def test_raise_on_error_propagates(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    from fsm_rollout.errors import EngineHTTPError

    fake_vllm.script([ScriptedTurn(status=400)], session="s0")
    async with runner_for(fake_vllm, tokenizer, raise_on_error=True) as runner:
        with pytest.raises(EngineHTTPError):
            await runner.run(samples(1)[0])


async def test_a_sample_that_cannot_start_is_reported_and_the_batch_goes_on(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")], session="s0")
    batch = samples(2)
    batch[1].status = Status.COMPLETED
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        done = await runner.run_batch(batch)
    assert done[0].status == Status.COMPLETED
    assert done[1].status == Status.COMPLETED
    assert done[1].metadata["rollout_error"]["type"] == "SampleStateError"


async def test_occupancy_always_sums_to_the_samples_in_flight(fake_vllm: FakeVLLMServer, tokenizer: Any) -> None:
    for i in range(10):
        fake_vllm.script([ScriptedTurn(text="a", delay=0.02), ScriptedTurn(text="b", delay=0.03)], session=f"s{i}")
    snapshots = []
    async with runner_for(fake_vllm, tokenizer) as runner:
        task = asyncio.ensure_future(runner.run_batch(samples(10), concurrency=4))
        while not task.done():
            snapshots.append(runner.metrics())
            await asyncio.sleep(0.005)
        await task
        final = runner.metrics()
    assert all(sum(s.occupancy.values()) == s.in_flight for s in snapshots)
    assert any(s.in_flight > 0 for s in snapshots)
    assert final.in_flight == 0
    assert final.samples_done == 10
    assert final.turns == 20
    assert final.tokens_generated == 20
    assert final.reasons == {"max_turns": 10}
    assert set(final.dwell_ms_mean) >= {"pending", "rendered", "generating", "stepping", "observing"}
    assert final.samples_per_s > 0


@pytest.mark.parametrize("tune_gc", [True, False])
async def test_batches_groups_and_streams_tune_the_collector_from_before_their_rollouts_are_made(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tune_gc: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch makes its rollouts and their tasks before any of them starts: with thousands, that alone can set
    off a full collection unless the collector is tuned from the start, and stays tuned until the last one ends
    (it is released once per call, not whenever no rollout happens to be running)."""
    before = gc.get_threshold()
    expected = gc_policy.tuned_thresholds(before) if tune_gc else before
    assert (expected != before) == tune_gc
    seen_while_making: list[tuple[int, int, int]] = []
    released: list[int] = []
    prepare, ended = SampleQueue.prepare, gc_policy.rollout_ended

    def noting_prepare(queue: SampleQueue, batch: Any, *ids: Any) -> Any:
        seen_while_making.append(gc.get_threshold())
        return prepare(queue, batch, *ids)

    def noting_end() -> None:
        ended()
        if not gc_policy._running:
            released.append(1)

    monkeypatch.setattr(SampleQueue, "prepare", noting_prepare)
    monkeypatch.setattr(gc_policy, "rollout_ended", noting_end)
    fake_vllm.script([ScriptedTurn(text="answer", delay=0.02 * (i % 3)) for i in range(9)])
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs, config_overrides={"tune_gc": tune_gc}) as runner:
        done = await runner.run_batch(samples(3), concurrency=1)
        assert gc.get_threshold() == before
        group = await runner.run_group(samples(1)[0], 3, concurrency=1)
        streamed = [sample async for sample in runner.stream(samples(3), concurrency=1)]
    assert seen_while_making == [expected] * 3
    # released once per call, not after each rollout (one runs at a time); never taken with tune_gc off
    assert len(released) == (3 if tune_gc else 0)
    assert [sample.status for sample in done + group + streamed] == [Status.COMPLETED] * 9
    assert gc.get_threshold() == before


async def test_a_pending_sample_whose_rollout_cannot_be_built_ends_failed_with_its_data_kept(
    fake_vllm: FakeVLLMServer, tokenizer: Any
) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")], session="s0")
    batch = samples(2)
    batch[1].metadata = ["not", "a", "dict"]  # type: ignore[assignment]  # what a buggy data loader hands over
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs) as runner:
        done = await runner.run_batch(batch)
        metrics = runner.metrics()
    assert done[0].status == Status.COMPLETED
    assert done[1].status == Status.FAILED
    assert done[1].prompt == "question 1" and done[1].session_id == "s1"
    assert done[1].metadata["rollout_error"]["type"] == "SampleStateError"
    assert done[1].metadata["rollout_reason"] == "error"
    assert metrics.statuses == {"completed": 1, "failed": 1}


async def test_an_unbuildable_sample_leaves_pending_by_a_traced_fail_edge_that_replay_and_inspect_accept(
    fake_vllm: FakeVLLMServer, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_vllm.script([ScriptedTurn(text="ok")], session="s0")
    batch = samples(2)
    batch[1].metadata = ["not", "a", "dict"]  # type: ignore[assignment]
    trace = tmp_path / "run.jsonl"
    config = config_for(fake_vllm.url, trace=str(trace), record=True)
    envs = ScriptedEnvFactory(steps=[("ok", True)])
    async with runner_for(fake_vllm, tokenizer, envs=envs, config=config) as runner:
        done = await runner.run_batch(batch)
        metrics = runner.metrics()
    assert done[1].status == Status.FAILED and done[1].metadata["rollout_error"]["state"] == "pending"
    assert metrics.statuses == {"completed": 1, "failed": 1} and metrics.in_flight == 0
    events = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    failed = [event for event in events if event.get("sample_id") == "1" and event.get("event") == TRANSITION_EVENT]
    assert [(e["src"], e["trigger"], e["dst"], e["reason"]) for e in failed] == [("pending", "fail", "failed", "error")]
    assert failed[0]["error_type"] == "SampleStateError" and failed[0]["failed_trigger"] is None
    report = await asyncio.to_thread(replay, trace, tokenizer=tokenizer)
    assert report.counts() == {"identical": 2}, report.render(verbose=True)
    assert report.sample("1").verdict == "identical"
    assert await asyncio.to_thread(cli_main, ["inspect", str(trace), "--sample", "1", "--color", "never"]) == 0
    shown = capsys.readouterr().out
    assert "pending --fail--> failed" in shown and "error_type=SampleStateError" in shown, shown


@pytest.mark.parametrize("how", ["batch", "group", "stream"])
async def test_no_finished_batch_returns_a_pending_sample_when_no_rollout_can_be_built(
    fake_vllm: FakeVLLMServer, tokenizer: Any, how: str
) -> None:
    stale = samples(3)
    for sample in stale:  # pending, but holding a response already: each rollout refuses it as it is built
        sample.response = "stale"
    async with runner_for(fake_vllm, tokenizer) as runner:
        if how == "batch":
            done = await runner.run_batch(stale)
        elif how == "group":
            done = await runner.run_group(stale[0], 3)
        else:
            done = [sample async for sample in runner.stream(stale)]
    assert [sample.status for sample in done] == [Status.FAILED] * 3
    assert {sample.metadata["rollout_error"]["type"] for sample in done} == {"SampleStateError"}
    assert [sample.response for sample in done] == ["stale"] * 3  # the sample's data is kept
    assert not fake_vllm.requests_to(RENDER_PATH) and not fake_vllm.requests_to(GENERATE_PATH)
