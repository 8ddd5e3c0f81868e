"""An engine's load, as vLLM publishes it on ``GET /metrics`` (Prometheus text).

Four of vLLM's series say how full a server is: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
(gauges), ``vllm:kv_cache_usage_perc`` (a gauge, a fraction from 0 to 1) and ``vllm:num_preemptions_total`` (a
counter). vLLM writes one sample per label set (``engine="0"``, ``model_name=...``; several with data parallelism):
the counts are summed over them and the KV use is the fullest one's. vLLM before the V1 engine named the KV series
``vllm:gpu_cache_usage_perc``; it is read when the new name is absent.

:func:`parse_metrics` reads the text, :func:`format_metrics` writes it as vLLM does (the embedded engine and the
fake server publish their load with it), and :class:`LoadReader` fetches it from a server: ``None`` when the
server has no ``/metrics`` (a 404, or a page without these series), so its caller can fall back.

An engine running in this very process (the embedded one) can be read without HTTP: :func:`register_local` names
the function that gives its load for its URL, and :class:`LoadReader` calls it instead. Reading ``/metrics`` over
loopback costs the engine's own process a request on its front-end and the reader's event loop a round trip each
time, which a reader polling often takes from decoding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp

METRICS_PATH: Final = "/metrics"
RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"
PREEMPTIONS: Final = "vllm:num_preemptions_total"
LEGACY_KV_CACHE_USAGE: Final = "vllm:gpu_cache_usage_perc"

_HELP: Final = {
    RUNNING: ("gauge", "Number of requests in model execution batches."),
    WAITING: ("gauge", "Number of requests waiting to be processed."),
    KV_CACHE_USAGE: ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    PREEMPTIONS: ("counter", "Cumulative number of preemption from the engine."),
}


@dataclass(frozen=True)
class EngineLoad:
    """One reading of a server's load."""

    running: int
    waiting: int
    kv_cache_usage: float
    """The fraction of the KV cache in use, 0 to 1."""
    preemptions: int
    """Preemptions since the server started (a counter: compare two readings)."""


def parse_metrics(text: str) -> EngineLoad | None:
    """The load in a ``/metrics`` page, or None when the page has neither request gauge (not a vLLM server)."""
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, value = _sample(line)
        if name is None or value is None or math.isnan(value):
            continue
        if name in (RUNNING, WAITING, PREEMPTIONS):
            sums[name] = sums.get(name, 0.0) + value
        elif name in (KV_CACHE_USAGE, LEGACY_KV_CACHE_USAGE):
            kv[name] = max(kv.get(name, 0.0), value)
    if RUNNING not in sums and WAITING not in sums:
        return None
    usage = kv.get(KV_CACHE_USAGE, kv.get(LEGACY_KV_CACHE_USAGE, 0.0))
    return EngineLoad(
        running=round(sums.get(RUNNING, 0.0)),
        waiting=round(sums.get(WAITING, 0.0)),
        kv_cache_usage=min(max(usage, 0.0), 1.0),
        preemptions=round(sums.get(PREEMPTIONS, 0.0)),
    )


def _sample(line: str) -> tuple[str | None, float | None]:
    """``(metric name, value)`` of one sample line (``name{labels} value [timestamp]``)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None, None
        name, rest = line[:brace], line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not fields:
        return None, None
    try:
        return name.strip(), float(fields[0])
    except ValueError:
        return None, None


def format_metrics(load: EngineLoad, *, model_name: str, engine: str = "0") -> str:
    """``load`` as vLLM's ``/metrics`` writes these series (``# HELP``, ``# TYPE``, one labelled sample each)."""
    labels = f'{{engine="{engine}",model_name="{_escape(model_name)}"}}'
    values = {
        RUNNING: float(load.running),
        WAITING: float(load.waiting),
        KV_CACHE_USAGE: float(load.kv_cache_usage),
        PREEMPTIONS: float(load.preemptions),
    }
    lines: list[str] = []
    for name, value in values.items():
        kind, doc = _HELP[name]
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{labels} {value!r}"]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_local: dict[str, Callable[[], EngineLoad]] = {}


def _key(base_url: str) -> str:
    return base_url.rstrip("/")


def register_local(base_url: str, source: Callable[[], EngineLoad]) -> None:
    """Read the load of the engine at ``base_url`` by calling ``source`` (it runs in this process) instead of over
    HTTP; until :func:`unregister_local`."""
    _local[_key(base_url)] = source


def unregister_local(base_url: str) -> None:
    """``base_url`` is read over HTTP again (its engine stopped)."""
    _local.pop(_key(base_url), None)


def local_source(base_url: str) -> Callable[[], EngineLoad] | None:
    """The in-process load of the engine at ``base_url``, when one was registered."""
    return _local.get(_key(base_url))


class LoadReader:
    """Reads servers' ``/metrics`` over one pooled session of its own (never recorded: it is not rollout I/O), or
    in process for an engine registered with :func:`register_local`."""

    def __init__(self, *, timeout_s: float = 5.0, api_key: str | None = None) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def read(self, base_url: str) -> EngineLoad | None:
        """The server's load; None when it publishes none (404, or no vLLM series). Network errors raise."""
        source = local_source(base_url)
        if source is not None:
            return source()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        async with self._session.get(base_url.rstrip("/") + METRICS_PATH, headers=self._headers) as answer:
            if answer.status in (404, 405):
                return None
            answer.raise_for_status()
            return parse_metrics(await answer.text())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


__all__ = [
    "KV_CACHE_USAGE",
    "METRICS_PATH",
    "PREEMPTIONS",
    "RUNNING",
    "WAITING",
    "EngineLoad",
    "LoadReader",
    "format_metrics",
    "local_source",
    "parse_metrics",
    "register_local",
    "unregister_local",
]
