"""An engine's load read from ``/metrics`` text as vLLM writes it, and written back the same way."""

from __future__ import annotations

import aiohttp
import pytest

from fsm_rollout.engine.load import EngineLoad, format_metrics, parse_metrics

# The shape of vLLM's (V1 engine) /metrics page: prometheus_client's text format, every series labelled by engine
# and model, histograms and process metrics beside the gauges; two engines (data parallel) publish a sample each.
VLLM_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12765.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.8125
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7650232e+09
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-0.6B"} 40.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 41.0
vllm:request_queue_time_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 41.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.25
"""


def test_a_vllm_page_is_summed_over_engines_and_the_fullest_kv_cache_counts() -> None:
    assert parse_metrics(VLLM_PAGE) == EngineLoad(running=12, waiting=3, kv_cache_usage=0.8125, preemptions=3)


def test_the_legacy_kv_name_is_read_when_the_new_one_is_absent() -> None:
    page = 'vllm:num_requests_running{model_name="m"} 1.0\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_metrics(page) == EngineLoad(running=1, waiting=0, kv_cache_usage=0.5, preemptions=0)


@pytest.mark.parametrize(
    "page",
    ["", "# HELP x y\n", "process_resident_memory_bytes 1000.0\n", "<html>404 Not Found</html>", '{"detail":"x"}'],
)
def test_a_page_without_the_request_gauges_is_no_load(page: str) -> None:
    assert parse_metrics(page) is None


def test_written_as_vllm_writes_it_and_read_back() -> None:
    load = EngineLoad(running=4, waiting=9, kv_cache_usage=0.25, preemptions=2)
    text = format_metrics(load, model_name='odd "name"')
    assert "# TYPE vllm:num_preemptions_total counter" in text.splitlines()
    assert 'vllm:num_requests_waiting{engine="0",model_name="odd \\"name\\""} 9.0' in text.splitlines()
    assert parse_metrics(text) == load


async def test_an_engine_registered_in_process_is_read_without_http_until_unregistered() -> None:
    from fsm_rollout.engine.load import LoadReader, local_source, register_local, unregister_local

    url = "http://127.0.0.1:9/"  # nothing listens: a read over HTTP fails
    load = EngineLoad(running=3, waiting=2, kv_cache_usage=0.25, preemptions=1)
    reader = LoadReader(timeout_s=2.0)
    register_local(url, lambda: load)
    try:
        assert local_source("http://127.0.0.1:9") is not None  # the trailing slash does not matter
        assert await reader.read(url) == load
    finally:
        unregister_local(url)
    assert local_source(url) is None
    with pytest.raises(aiohttp.ClientError):  # refused: the read went over HTTP
        await reader.read(url)
    await reader.close()
