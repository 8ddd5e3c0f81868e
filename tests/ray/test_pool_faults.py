"""RayRolloutPool when things go wrong: a worker killed mid-batch, bad input, workers that cannot start, and the
cluster a pool starts itself when none is connected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, SAMPLING, pool_config, samples

from fsm_rollout.distributed import WORKER_LOST, RayRolloutPool
from fsm_rollout.errors import ConfigError, EnvironmentLoadError, PoolError, SamplingParamsError
from fsm_rollout.sample import Status
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir


async def test_a_killed_worker_fails_its_samples_worker_lost_with_their_data_and_the_pool_goes_on(
    ray_cluster: Any,
) -> None:
    async with FakeVLLMServer(load_qwen_tokenizer(), model=MODEL) as server:
        for i in range(4):
            server.script([ScriptedTurn(text=f"answer {i}", hang=True)], session=f"kill{i}")
        config = pool_config(server.url, str(qwen_tokenizer_dir()))
        async with RayRolloutPool(config, sampling_params=SAMPLING, num_workers=2) as pool:
            sent = samples("kill", 4, note="from the trainer")
            stream = pool.stream(sent, concurrency=2)  # samples 0 and 2 on worker 0, 1 and 3 on worker 1
            await server.wait_until_waiting(4)
            victim = pool.workers[0]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            lost = [await anext(stream), await anext(stream)]  # only the killed worker's samples can end now
            for request_id in server.held_request_ids:
                server.release(request_id)
            finished = [sample async for sample in stream]

            assert sorted(sample.index for sample in lost) == [0, 2]
            for sample in lost:
                assert sample.status == Status.FAILED
                assert sample.metadata["rollout_reason"] == WORKER_LOST
                assert f"worker 0 (pid {victim.pid}) was lost" in sample.metadata["rollout_error"]["message"]
                original = sent[sample.index]
                assert (sample.prompt, sample.session_id) == (original.prompt, original.session_id)
                assert sample.metadata["note"] == "from the trainer" and not sample.tokens
            assert sorted(sample.index for sample in finished) == [1, 3]
            assert all(sample.status == Status.COMPLETED for sample in finished)

            assert [worker.alive for worker in pool.workers] == [False, True]
            for i in range(4):
                server.script([ScriptedTurn(text=f"again {i}")], session=f"again{i}")
            again = await pool.run_batch(samples("again", 4))
            assert [sample.response for sample in again] == [f"again {i}" for i in range(4)]
            metrics = pool.metrics()
            assert (metrics.workers_alive, metrics.workers_lost) == (1, 1)
            assert metrics.reasons.get(WORKER_LOST) == 2
    assert ray_cluster.is_initialized()


async def test_bad_pool_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    config = pool_config("http://127.0.0.1:9", str(tmp_path))
    with pytest.raises(ConfigError, match="num_workers must be a positive integer"):
        RayRolloutPool(config, sampling_params=SAMPLING, num_workers=0)
    with pytest.raises(ConfigError, match="reward_fn is a callable"):
        RayRolloutPool(pool_config("http://127.0.0.1:9", str(tmp_path), reward_fn=lambda sample: 1.0),
                       sampling_params=SAMPLING)  # fmt: skip
    with pytest.raises(ConfigError, match="a sequence of 2"):
        RayRolloutPool(config, sampling_params=SAMPLING, num_workers=2, worker_options=[{"num_cpus": 1}])
    with pytest.raises(SamplingParamsError, match="max_new_tokens"):
        RayRolloutPool(config, sampling_params={"temperature": 1.0, "top_p": 1.0})
    with pytest.raises(PoolError, match="async with RayRolloutPool"):
        await RayRolloutPool(config, sampling_params=SAMPLING).run_batch(samples("never", 1))


async def test_a_missing_environment_module_fails_the_start_with_the_loader_error(ray_cluster: Any) -> None:
    config = pool_config("http://127.0.0.1:9", str(qwen_tokenizer_dir()), env_path="no_such_package.env")
    with pytest.raises(EnvironmentLoadError, match="no_such_package"):
        async with RayRolloutPool(config, sampling_params=SAMPLING, num_workers=1):
            pass
    assert ray_cluster.is_initialized()


async def test_workers_the_cluster_cannot_place_fail_the_start_naming_the_resources(ray_cluster: Any) -> None:
    config = pool_config("http://127.0.0.1:9", str(qwen_tokenizer_dir()))
    pool = RayRolloutPool(config, sampling_params=SAMPLING, num_workers=1, worker_options={"num_cpus": 3},
                          start_timeout_s=2)  # fmt: skip
    with pytest.raises(PoolError, match=r"did not start within 2 s.*'num_cpus': 3"):
        async with pool:
            pass
    assert ray_cluster.available_resources().get("CPU") == 2.0  # nothing left holding the cluster's CPUs


OWN_CLUSTER_SCRIPT = """
import asyncio, logging, sys
import ray
from fsm_rollout import RolloutConfig, Sample
from fsm_rollout.distributed import RayRolloutPool
from fsm_rollout.testing.fake_vllm import FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir

logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(name)s %(message)s")

async def main():
    async with FakeVLLMServer(load_qwen_tokenizer()) as server:
        server.script([ScriptedTurn(text="hello")])
        config = RolloutConfig(engine_url=server.url, model="fake-model", max_turns=1,
                               tokenizer_path=str(qwen_tokenizer_dir()), env_path="fsm_rollout.testing.envs")
        sampling = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
        async with RayRolloutPool(config, sampling_params=sampling, num_workers=1,
                                  ray_init={"num_cpus": 1, "_temp_dir": sys.argv[1], "log_to_driver": False}) as pool:
            print("INSIDE", ray.is_initialized(), (await pool.run(Sample(prompt="hi", index=0))).response)
        # nothing of the pool's outlives it: a task reading a worker's stream after ray.shutdown() ends the process
        print("LEFT", [task for task in asyncio.all_tasks() if task is not asyncio.current_task()])
    print("AFTER", ray.is_initialized())

asyncio.run(main())
"""


def test_without_a_cluster_the_pool_starts_a_local_one_says_so_and_shuts_it_down(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Run in a process of its own: this test process has a cluster of its own for the other tests."""
    ray_dir = tmp_path_factory.mktemp("own")  # short: Ray's socket paths under it must fit in 107 bytes
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OWN_CLUSTER_SCRIPT), str(ray_dir)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("LOG fsm_rollout.distributed.pool") and "starting a local one" in line
               for line in lines), result.stdout  # fmt: skip
    assert "INSIDE True hello" in lines
    assert "LEFT []" in lines
    assert "AFTER False" in lines
    assert ray_dir.is_dir(), "the local cluster did not use the temp dir it was given"
