"""Internal: session-sticky consistent hashing of keys (session ids) over several engine URLs.

Adding or removing a URL moves only about 1/N of the keys, so a sample's requests keep reaching the server whose
prefix cache holds its history.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from fsm_rollout.errors import ConfigError

__all__ = ["ConsistentHashRing"]


class ConsistentHashRing:
    """Maps keys (session ids) to one of several engine URLs; stable when URLs are added or removed."""

    def __init__(self, urls: Sequence[str], *, replicas: int = 64) -> None:
        if not urls:
            raise ConfigError("at least one engine URL is needed")
        self._points: list[int] = []
        self._owners: list[str] = []
        for url in sorted(set(urls)):
            for replica in range(replicas):
                self._points.append(self._hash(f"{url}#{replica}"))
                self._owners.append(url)
        order = sorted(range(len(self._points)), key=self._points.__getitem__)
        self._points = [self._points[i] for i in order]
        self._owners = [self._owners[i] for i in order]

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def url_for(self, key: str) -> str:
        """The engine URL that owns ``key``."""
        index = bisect.bisect(self._points, self._hash(key)) % len(self._points)
        return self._owners[index]
