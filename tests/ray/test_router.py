"""Many servers behind the real ``vllm-router`` (consistent hashing on ``x-session-id``): every turn of a sample
reaches one server, an abort reaches the server holding the request, a ``keep`` suspension pauses every server
listed in ``servers_behind_router``, and a server taken down mid-run fails only its own samples.

The router is started here on loopback in front of two fake servers, and of two embedded engines, and stopped at
the end. It runs with its own retries and circuit breaker off, so what happens to a dead server's samples is the
library's retry policy alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from conftest import MODEL, SAMPLING, pool_config, router_binary
from process_groups import start_group, stop_group

from fsm_rollout import RolloutRunner, Sample, Status
from fsm_rollout.engine.local import LocalEngine
from fsm_rollout.testing.fake_vllm import GENERATE_PATH, FakeVLLMServer, ScriptedTurn
from fsm_rollout.testing.tokenizer import load_qwen_tokenizer, qwen_tokenizer_dir

pytestmark = pytest.mark.asyncio(loop_scope="module")

TWO_TURNS = {"scripted_env": {"steps": [["go on", False], ["ok", True]]}}
ROUTER_START_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def router(worker_urls: list[str], log: Path) -> AsyncIterator[str]:
    """``vllm-router`` on a free loopback port in front of ``worker_urls``; yields its URL, stops it at the end."""
    port = _free_port()
    command = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
               "--policy", "consistent_hash", "--request-id-headers", "x-session-id",
               "--disable-retries", "--disable-circuit-breaker", "--log-level", "warning",
               # its metrics listener too, on loopback and a free port: two routers at once must not clash
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]  # fmt: skip
    process = _spawn(command, log)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, process, log)
        yield url
    finally:
        stop_group(process)


def _spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """The router in a process group of its own, killed with this process whatever ends it
    (tests/process_groups.py)."""
    with log.open("wb") as out:
        return start_group(command, stdout=out, stderr=subprocess.STDOUT)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once the router answers ``/health``. It first waits for its workers' health, which the servers in this
    event loop answer only while this waits without blocking the loop."""
    deadline = time.monotonic() + ROUTER_START_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"vllm-router exited with {process.returncode}:\n{_tail(log)}")
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as answer:
                    if answer.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)  # a child process's start-up: nothing to wait on but its port
    pytest.fail(f"vllm-router did not become healthy in {ROUTER_START_S:g} s:\n{_tail(log)}")


# --------------------------------------------------------------------------- two fake servers


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fakes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[FakeVLLMServer, FakeVLLMServer, str]]:
    router_binary()
    tokenizer = load_qwen_tokenizer()
    log = tmp_path_factory.mktemp("router") / "router.log"
    async with (
        FakeVLLMServer(tokenizer, model=MODEL) as a,
        FakeVLLMServer(tokenizer, model=MODEL) as b,
        router([a.url, b.url], log) as url,
    ):
        yield a, b, url


def runner_behind(url: str, servers: list[str], **overrides: Any) -> RolloutRunner:
    config = pool_config(url, str(qwen_tokenizer_dir()), servers_behind_router=servers, **overrides)
    return RolloutRunner(config, sampling_params=SAMPLING, tokenizer=load_qwen_tokenizer())


def script_everywhere(servers: tuple[FakeVLLMServer, ...], session: str, turns: list[ScriptedTurn]) -> None:
    """Script a session on every server: the router, not the test, decides which one answers it."""
    for server in servers:
        server.script(turns, session=session)


def sessions_by_server(servers: tuple[FakeVLLMServer, ...], prefix: str) -> list[dict[str, int]]:
    """How many generate requests of each session ``<prefix>*`` each server received, routing probes left out."""
    counts: list[dict[str, int]] = []
    for server in servers:
        seen: dict[str, int] = defaultdict(int)
        for request in server.requests_to(GENERATE_PATH):
            session = request.headers.get("x-session-id", "")
            if session.startswith(prefix) and not _is_probe(request.body):
                seen[session] += 1
        counts.append(dict(seen))
    return counts


async def until_held(servers: tuple[FakeVLLMServer, ...], prefix: str, n: int) -> None:
    """Return once ``n`` requests of sessions ``<prefix>*`` are held over all the servers. A server wakes only its
    own watchers, and the last request may arrive at any of them, so each server gets one."""

    def all_held() -> bool:
        return sum(1 for server in servers for rid in server.held_request_ids if prefix in rid) >= n

    watchers = [asyncio.ensure_future(server.wait_until(all_held)) for server in servers]
    try:
        await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()


def two_turn_samples(sessions: list[str]) -> list[Sample]:
    return [Sample(prompt=f"q{i}", index=i, session_id=session, metadata=dict(TWO_TURNS))
            for i, session in enumerate(sessions)]  # fmt: skip


PROBE_CANDIDATES = 64


def _is_probe(body: Any) -> bool:
    return isinstance(body, dict) and body.get("routing_probe") is True


def spread_over_both(where: dict[str, int], n: int) -> list[str]:
    """``n`` of the probed sessions, taken in turn from server 0 and server 1 so that both serve some.

    The ring of consistent hashing depends on the servers' URLs, whose ports change each run: which server a
    session name lands on is decided by the router, so tests ask it rather than assume a split.
    """
    by_server: list[list[str]] = [[], []]
    for session, server in where.items():
        by_server[server].append(session)
    if not by_server[0] or not by_server[1]:
        pytest.fail(f"the router sent all {len(where)} probed sessions to one server: {by_server}")
    chosen: list[str] = []
    while len(chosen) < n and (by_server[0] or by_server[1]):
        for names in by_server:
            if names and len(chosen) < n:
                chosen.append(names.pop(0))
    assert len(chosen) == n, f"only {len(chosen)} probed sessions for {n} samples"
    return chosen


async def sessions_on_both_fakes(url: str, servers: tuple[FakeVLLMServer, FakeVLLMServer], prefix: str,
                                 n: int) -> list[str]:  # fmt: skip
    """``n`` session names ``<prefix><k>`` that the router spreads over both fake servers. Each candidate is sent
    once through the router as a probe that its server refuses with a 400 before any scripted turn is used."""
    for server in servers:
        server.fail_next(GENERATE_PATH, status=400, times=PROBE_CANDIDATES)
    try:
        async with aiohttp.ClientSession() as http:
            for k in range(PROBE_CANDIDATES):
                headers = {"x-session-id": f"{prefix}{k}"}
                body = {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1},
                        "routing_probe": True}  # fmt: skip
                async with http.post(url + GENERATE_PATH, json=body, headers=headers) as answer:
                    await answer.read()
    finally:
        for server in servers:
            server.clear_faults()
    where: dict[str, int] = {}
    for i, server in enumerate(servers):
        for request in server.requests_to(GENERATE_PATH):
            session = request.headers.get("x-session-id", "")
            if _is_probe(request.body) and session.startswith(prefix):
                where[session] = i
    assert len(where) == PROBE_CANDIDATES, f"{PROBE_CANDIDATES - len(where)} probes reached no server"
    return spread_over_both(where, n)


async def sessions_on_both_engines(url: str, model: str, versions: tuple[str, str], prefix: str, n: int) -> list[str]:
    """``n`` session names that the router spreads over both embedded engines, told apart by the weight version
    each labels its tokens with. A probe is a one-token generate through the router."""
    where: dict[str, int] = {}
    async with aiohttp.ClientSession() as http:
        for k in range(PROBE_CANDIDATES // 2):
            body = {"model": model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "temperature": 0}}
            async with http.post(url + GENERATE_PATH, json=body, headers={"x-session-id": f"{prefix}{k}"}) as answer:
                assert answer.status == 200, await answer.text()
                spans = (await answer.json())["choices"][0]["weight_versions"]
            where[f"{prefix}{k}"] = versions.index(spans[0]["version"])
    return spread_over_both(where, n)


async def test_every_turn_of_a_sample_reaches_the_same_server(
    fakes: tuple[FakeVLLMServer, FakeVLLMServer, str],
) -> None:
    a, b, url = fakes
    sessions = await sessions_on_both_fakes(url, (a, b), "sticky", 12)
    for session in sessions:
        script_everywhere((a, b), session, [ScriptedTurn(text="one"), ScriptedTurn(text="two")])
    async with runner_behind(url, [a.url, b.url]) as runner:
        done = await runner.run_batch(two_turn_samples(sessions))
    assert all(sample.status == Status.COMPLETED for sample in done)
    at_a, at_b = sessions_by_server((a, b), "sticky")
    assert not set(at_a) & set(at_b), "a session was split over the two servers"
    assert set(at_a) | set(at_b) == set(sessions)
    assert at_a and at_b, "the router sent every session to one server"
    assert set(at_a.values()) | set(at_b.values()) == {2}  # both turns' generates, at one server


async def test_an_abort_reaches_the_server_holding_the_request(
    fakes: tuple[FakeVLLMServer, FakeVLLMServer, str],
) -> None:
    a, b, url = fakes
    for i in range(6):
        script_everywhere((a, b), f"held{i}", [ScriptedTurn(text="never", hang=True)])
    async with runner_behind(url, [a.url, b.url]) as runner:
        batch = asyncio.ensure_future(runner.run_batch(two_turn_samples([f"held{i}" for i in range(6)])))
        await until_held((a, b), "held", 6)
        held = {server.url: {r for r in server.held_request_ids if "held" in r} for server in (a, b)}
        await runner.abort("cancelled")
        done = await batch
    assert {sample.status for sample in done} == {Status.ABORTED}
    for server in (a, b):
        named = {rid for rid in server.aborted_request_ids if "held" in rid}
        assert held[server.url] <= {alias for rid in named for alias in (rid, rid.removeprefix("generate-tokens-"))}
        assert not [r for r in server.held_request_ids if "held" in r]


async def test_a_keep_suspension_pauses_every_listed_server_and_resumes_them(
    fakes: tuple[FakeVLLMServer, FakeVLLMServer, str],
) -> None:
    a, b, url = fakes
    async with runner_behind(url, [a.url, b.url], weight_update_strategy="keep") as runner:
        await runner.suspend()
        assert (a.pause_mode, b.pause_mode) == ("keep", "keep")
        await runner.resume()
        assert not a.paused and not b.paused


async def test_a_weight_update_aborts_at_every_server_and_sets_every_version(
    fakes: tuple[FakeVLLMServer, FakeVLLMServer, str],
) -> None:
    a, b, url = fakes
    for i in range(6):
        script_everywhere((a, b), f"upd{i}", [ScriptedTurn(text="partly then all", hang=True, held_after=1)])
    async with runner_behind(url, [a.url, b.url]) as runner:
        batch = asyncio.ensure_future(runner.run_batch([Sample(prompt="p", index=i, session_id=f"upd{i}",
                                                               metadata={"scripted_env": {"steps": [["ok", True]]}})
                                                        for i in range(6)]))  # fmt: skip
        await until_held((a, b), "upd", 6)
        async with runner.weight_update(version="9"):
            pass
        done = await batch
    assert all(sample.response == "partly then all" for sample in done)
    assert (a.weight_version, b.weight_version) == ("9", "9")
    for sample in done:
        assert [span["version"] for span in sample.metadata["weight_version_spans"]] == ["default", "9"]


async def test_a_server_taken_down_mid_run_fails_only_its_own_samples(
    fakes: tuple[FakeVLLMServer, FakeVLLMServer, str],
) -> None:
    a, b, url = fakes
    sessions = await sessions_on_both_fakes(url, (a, b), "down", 8)
    for session in sessions:
        script_everywhere((a, b), session, [ScriptedTurn(text="first", hang=True), ScriptedTurn(text="second")])
    async with runner_behind(url, [a.url, b.url]) as runner:
        batch = asyncio.ensure_future(runner.run_batch(two_turn_samples(sessions)))
        await until_held((a, b), "down", 8)
        on_b = set(sessions_by_server((b,), "down")[0])
        assert on_b and len(on_b) < 8
        b.fail_next(GENERATE_PATH, reset=True, times=100)  # from now on b drops every generate, as a dead server
        for server in (a, b):
            for request_id in server.held_request_ids:
                server.release(request_id)
        done = await batch
    b.clear_faults()
    for sample in done:
        if sample.session_id in on_b:
            assert sample.status == Status.FAILED, sample.metadata
            assert sample.metadata["rollout_error"]["type"].startswith("Engine")
        else:
            assert sample.status == Status.COMPLETED and sample.response.endswith("second")


# --------------------------------------------------------------------------- two embedded engines


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[LocalEngine, LocalEngine, str]]:
    router_binary()
    async with LocalEngine() as a, LocalEngine() as b:
        # each engine labels its tokens with its own weight version, so a sample's spans tell which one served it
        await a.update_weight_version("engine-a")
        await b.update_weight_version("engine-b")
        async with router([a.url, b.url], tmp_path_factory.mktemp("router") / "router.log") as url:
            yield a, b, url


async def test_embedded_engines_behind_the_router_keep_each_sample_on_one_engine_and_pause_both(
    engines: tuple[LocalEngine, LocalEngine, str],
) -> None:
    a, b, url = engines
    config = pool_config(url, str(a.model_dir), model=a.served_model_name, servers_behind_router=[a.url, b.url],
                         weight_update_strategy="keep")  # fmt: skip
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "seed": 5}
    async with RolloutRunner(config, sampling_params=sampling) as runner:
        sessions = await sessions_on_both_engines(url, a.served_model_name, ("engine-a", "engine-b"), "engines", 12)
        done = await runner.run_batch(two_turn_samples(sessions))
        await runner.suspend()
        assert a.is_paused and b.is_paused
        await runner.resume()
        assert not a.is_paused and not b.is_paused
    served_by = []
    for sample in done:
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata.get("rollout_error")
        versions = {span["version"] for span in sample.metadata["weight_version_spans"]}
        assert len(versions) == 1, f"sample {sample.index} was served by both engines: {versions}"
        served_by.append(versions.pop())
    assert set(served_by) == {"engine-a", "engine-b"}
