"""Leases on what a migration leaves at an instance, so that an instance lets go of it when its coordinator is gone.

A live migration (cluster/migration.py) leaves state at both ends between its calls: blocks reserved at the
destination, a request stopped at the source, a copy committed at the destination that waits for its client's
stream. The coordinator ends each with a later call, but it may never come: the router died or restarted, its
call timed out and was dropped, the client left. Each piece of state therefore holds a lease that the next call
renews or ends; when it runs out, the instance ends the state itself (drops the reservation, resumes the request,
aborts the copy nobody follows).

Timers run on the actor's event loop (`loop.call_later`); an expiry's work runs in a task this object supervises
(an exception is logged with its cause, never lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    seconds: float
    expire: Callable[[], Awaitable[None]]
    timer: asyncio.TimerHandle


class Leases:
    """Named leases: `grant` starts one, `renew` restarts its clock, `end` takes it back; on expiry its `expire`
    coroutine runs once. Call from the event loop's thread only."""

    def __init__(self) -> None:
        self._leases: dict[Hashable, _Lease] = {}
        self._expiring: set[asyncio.Task] = set()

    def grant(self, key: Hashable, seconds: float, expire: Callable[[], Awaitable[None]]) -> None:
        self.end(key)
        timer = asyncio.get_running_loop().call_later(seconds, self._fire, key)
        self._leases[key] = _Lease(seconds, expire, timer)

    def renew(self, key: Hashable) -> bool:
        """Restart a lease's clock; False if there is none (it was ended, or already ran out)."""
        lease = self._leases.get(key)
        if lease is None:
            return False
        self.grant(key, lease.seconds, lease.expire)
        return True

    def end(self, key: Hashable) -> bool:
        """Take a lease back before it runs out; False if there was none."""
        lease = self._leases.pop(key, None)
        if lease is None:
            return False
        lease.timer.cancel()
        return True

    def held(self, key: Hashable) -> bool:
        return key in self._leases

    def seconds(self, key: Hashable) -> float | None:
        lease = self._leases.get(key)
        return None if lease is None else lease.seconds

    def _fire(self, key: Hashable) -> None:
        lease = self._leases.pop(key, None)
        if lease is None:
            return
        log.warning("lease %s ran out after %.1f s: letting go of it", key, lease.seconds)
        task = asyncio.get_running_loop().create_task(lease.expire(), name=f"lease-{key}")
        self._expiring.add(task)
        task.add_done_callback(self._expired)

    def _expired(self, task: asyncio.Task) -> None:
        self._expiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("letting go of %s failed", task.get_name(), exc_info=task.exception())
