"""Internal: a runner's engine clients: one :class:`~fsm_rollout.engine.client.VLLMClient` per engine URL, the
servers behind a router that weight updates reach directly, and session-sticky consistent hashing over the URLs (a
sample's requests always go to the same server; adding a server moves only about 1/N of the sessions)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from fsm_rollout.config import RolloutConfig
from fsm_rollout.engine.client import VLLMClient
from fsm_rollout.runtime.hashring import ConsistentHashRing
from fsm_rollout.sample import Sample


class EngineClients:
    """The clients of ``urls`` (and of ``config.servers_behind_router``), opened by :meth:`open` and closed by
    :meth:`close`; the dicts are kept (emptied, not replaced) so that views of them stay current."""

    def __init__(self, config: RolloutConfig, urls: Sequence[str]) -> None:
        self.config = config
        self.urls = list(urls)
        self.ring = ConsistentHashRing(self.urls)
        self.clients: dict[str, VLLMClient] = {}
        self.servers: dict[str, VLLMClient] = {}
        """The servers behind a router (``config.servers_behind_router``), which weight updates reach directly."""

    def open(self) -> None:
        for url in self.urls:
            self.clients[url] = VLLMClient.from_config(self.config, base_url=url)
        for url in self.config.servers_behind_router:
            self.servers[url] = VLLMClient.from_config(self.config, base_url=url)

    async def close(self) -> None:
        for client in [*self.clients.values(), *self.servers.values()]:
            await client.close()
        self.clients.clear()
        self.servers.clear()

    def url_for(self, sample: Sample) -> str:
        """The URL ``sample`` is pinned to; with several engines a sample without a session id gets one."""
        if len(self.clients) > 1 and not sample.session_id:
            sample.session_id = str(uuid.uuid4())
        if len(self.clients) == 1:
            return next(iter(self.clients))
        return self.ring.url_for(sample.session_id or "")

    def at(self, session_id: str | None) -> VLLMClient:
        """The client a sample of ``session_id`` is pinned to."""
        if len(self.clients) == 1:
            return next(iter(self.clients.values()))
        return self.clients[self.ring.url_for(session_id or "")]


__all__ = ["EngineClients"]
