"""A router handle that outlives the router: each call has a deadline, and a router found dead is found again by name.

    router = RouterClient(lambda: get_or_create_router(cfg), reconnect_s=cfg.reconnect_s)
    instance_id, handle = await router.call(lambda r: r.route.remote(rid, 0, model, limit), timeout_s=30)

The router (cluster/router.py) restarts when its process dies; Ray then answers calls meanwhile with
ActorUnavailableError, and retries those under way on the new process where the method is idempotent. An actor
killed for good raises ActorDiedError on every later call through the old handle: then `resolve` (which creates the
router again if nobody has yet) gives the new one. Either way the call is tried again, with a growing pause, until
`reconnect_s` have passed since it began; then the last error is raised. API replicas and instance deployments
(deploy/serve/) hold one of these.

Every call is submitted outside the caller's contextvars (a fresh Context), so it is never a child of a Serve
request that `ray.cancel` may cancel recursively (deploy/serve/frontend.py explains why that matters).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError

log = logging.getLogger(__name__)
GONE = (ActorDiedError, ActorUnavailableError)  # the router is restarting, or dead: try again (anew)
FIRST_PAUSE_S, MAX_PAUSE_S = 0.2, 2.0


class RouterClient:
    """A router handle with deadlines and re-resolution. `resolve` gives the current router (None: a fixed handle
    that is never replaced, e.g. a test's own router; calls still get deadlines)."""

    def __init__(self, handle: ActorHandle, resolve: Callable[[], ActorHandle] | None = None,
                 reconnect_s: float = 20.0, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self._resolve = resolve
        self.reconnect_s, self.timeout_s = reconnect_s, timeout_s

    @classmethod
    def resolving(cls, resolve: Callable[[], ActorHandle], reconnect_s: float = 20.0,
                  timeout_s: float = 60.0) -> "RouterClient":
        return cls(resolve(), resolve, reconnect_s, timeout_s)

    async def call(self, fn: Callable[[ActorHandle], ObjectRef], *, timeout_s: float | None = None,
                   retry: bool = True) -> Any:
        """`fn(router)`'s result, awaited for at most `timeout_s` (default: the client's); a router that is gone
        is tried again (re-resolved if dead) until `reconnect_s` have passed, unless `retry` is False (a call that
        must not run twice)."""
        deadline = time.monotonic() + self.reconnect_s
        pause = FIRST_PAUSE_S
        while True:
            handle = self.handle
            try:
                ref = contextvars.Context().run(fn, handle)
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s or self.timeout_s)
            except GONE as e:
                if not retry or time.monotonic() + pause > deadline:
                    raise
                log.warning("the router is gone (%s); trying again in %.1f s", type(e).__name__, pause)
                await asyncio.sleep(pause)
                if isinstance(e, ActorDiedError):
                    await asyncio.to_thread(self._reresolve, handle)
                pause = min(2 * pause, MAX_PAUSE_S)

    def call_blocking(self, fn: Callable[[ActorHandle], ObjectRef], *, timeout_s: float | None = None) -> Any:
        """`call` for synchronous code (a deployment's constructor): the same deadline and retries."""
        deadline = time.monotonic() + self.reconnect_s
        pause = FIRST_PAUSE_S
        while True:
            handle = self.handle
            try:
                return ray.get(fn(handle), timeout=timeout_s or self.timeout_s)
            except GONE as e:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("the router is gone (%s); trying again in %.1f s", type(e).__name__, pause)
                time.sleep(pause)
                if isinstance(e, ActorDiedError):
                    self._reresolve(handle)
                pause = min(2 * pause, MAX_PAUSE_S)

    def _reresolve(self, dead: ActorHandle) -> None:
        if self._resolve is not None and self.handle == dead:  # another call may have found the new one already
            self.handle = self._resolve()
