"""The router's polling: every instance's stats, health, request states and prefix-cache events, read side by side
with one deadline; an instance that reports unhealthy or does not answer in time is removed (its requests fail over).

The router (cluster/router.py) holds the registry and the instances' handles; `InstancePoller` reads them through
the same objects, and keeps the removed instances' rows for `specfleet instances --removed`. No Ray import here: a
handle is anything with the instance's methods as `.remote()` calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, MutableMapping

from cluster.config import RouterConfig
from cluster.instances import InstanceRow
from cluster.registry import Registry
from cluster.start_times import StartHistory
from cluster.stats import FailedRounds

log = logging.getLogger(__name__)


class InstancePoller:
    """Polls the instances in `handles` (the router's own dict: instances come and go in it) every
    `cfg.stats_interval_s`, each within `timeout_s`; `moving`: the requests migrating, which reconciliation spares;
    `failed`: where a poll that raised is counted (the router's figures)."""

    def __init__(self, cfg: RouterConfig, registry: Registry, handles: MutableMapping[str, object], starts: StartHistory,
                 timeout_s: float, moving: Mapping[str, object], failed: FailedRounds | None = None) -> None:
        self.cfg, self.registry, self.handles, self.starts = cfg, registry, handles, starts
        self.timeout_s, self.moving = timeout_s, moving
        self.failed = failed if failed is not None else FailedRounds()
        self.removed: list[InstanceRow] = []  # instances taken out for failing health, newest last (the last 100)

    async def poll(self) -> None:
        """Refresh every instance's stats, health and prefix-cache events once; remove the ones that fail."""
        probed = dict(self.handles)
        ids = list(probed)
        asked = {i: sorted(self.registry.instances[i].in_flight) if i in self.registry.instances else [] for i in ids}
        index = self.registry.prefix
        results = await asyncio.gather(*(self._probe(probed[i], asked[i], index.wants_snapshot(i)) for i in ids),
                                       return_exceptions=True)
        index.expire(time.time())
        for instance_id, result in zip(ids, results):
            if isinstance(result, BaseException):
                self.remove_failed(instance_id, f"{type(result).__name__}: {result}")
                continue
            stats, health, states, events = result
            now = time.time()
            self.registry.update(instance_id, stats, health.healthy, health.error, now)
            if not health.healthy:
                self.remove_failed(instance_id, health.error or "unhealthy")
                continue
            if self.handles.get(instance_id) == probed[instance_id]:  # not replaced meanwhile (its own numbering)
                index.apply(instance_id, events)
            for r in self.registry.reconcile(instance_id, asked[instance_id], states, now, self.cfg.orphan_grace_s,
                                             moving=self.moving):
                log.warning("request %s was still running at the router, but its instance %s %s; closed as %s",
                            r.request_id, r.instance_id, "ended it" if r.seen_by_instance else "never received it",
                            r.status.value)

    async def _probe(self, handle, asked: list[str], snapshot: bool):  # noqa: ANN001 - an instance's actor handle
        return await asyncio.wait_for(asyncio.gather(handle.stats.remote(), handle.health.remote(),
                                                     handle.request_states.remote(asked),
                                                     handle.cache_events.remote(snapshot)), self.timeout_s)

    def remove_failed(self, instance_id: str, error: str) -> None:
        """Take out an instance that failed its health check or did not answer; its requests fail over."""
        if instance_id not in self.registry.instances:
            return
        self.registry.mark_unhealthy(instance_id, error)
        self.starts.lost(instance_id, time.monotonic())  # its replacement's registration says how long that took
        entry = self.registry.remove(instance_id, time.time())  # its requests fail over (or were closed as failed)
        self.handles.pop(instance_id, None)
        self.removed.append(entry.row(removed_at=time.time()))
        del self.removed[:-100]

    async def run_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as e:  # noqa: BLE001 - a bad poll must not stop polling; the next one retries (counted)
                self.failed.record("health_poll", e)
                log.exception("polling the instances failed")
            await asyncio.sleep(self.cfg.stats_interval_s)
