"""A replica's view of the fleet for its unauthenticated routes (/health, /metrics, gRPC Health), reused ~1 s.

Those routes need no key, and each used to call the single router actor on every hit: anyone who can reach the
port could keep the router busy answering them. `Cached` makes one call per `ttl_s` per replica whatever the
rate of hits; callers that arrive while a call is under way wait for it (a lock, no task of its own). An error is
not kept: the next caller tries again. An admin action through this replica (drain, undrain, ...) `invalidate`s
it, so the replica that made a change shows it at once; another replica may show the old state for up to `ttl_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
TTL_S = 1.0


class Cached(Generic[T]):
    """The latest result of `fetch`, reused for `ttl_s`."""

    def __init__(self, fetch: Callable[[], Awaitable[T]], ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.ttl_s, self.clock = fetch, ttl_s, clock
        self._lock = asyncio.Lock()
        self._value: T | None = None
        self._at: float | None = None

    def invalidate(self) -> None:
        """The next `get` fetches anew (a change this replica made must show at once)."""
        self._at = None

    async def get(self) -> T:
        async with self._lock:
            if self._at is None or self.clock() - self._at >= self.ttl_s:
                self._value = await self.fetch()
                self._at = self.clock()
            return self._value
