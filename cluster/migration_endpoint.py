"""What the migration coordinator (cluster/migration.py) sees of an instance: the Endpoint protocol, its Ray
implementation over an instance actor's handle, and `Deadlined`, which bounds every call of a migration.

A migration's calls go to two other processes over the network; any of them can hang (a frozen process, a cut
link, a node that died without a word). `Deadlined` gives each call `step_timeout_s`, after which it raises
`StepTimeout` and the coordinator aborts the migration as it would for that end's failure.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from cluster.request import Request


class StepTimeout(TimeoutError):
    """A call of a migration to one instance did not answer within its deadline."""


@dataclass(frozen=True)
class Link:
    """One pair of stages whose layers overlap: source stage `src` sends its KV of `layers` to destination stage
    `dst` over a two-rank group that the source end hosts at `address` (on its node)."""

    link_id: str  # unique among every open link: the migration's channel, the pipeline, the pair
    src: int
    dst: int
    layers: tuple[int, ...]
    address: str = ""


@dataclass(frozen=True)
class BlockNames:
    """The names of a request's full KV blocks at its source (cluster/prefix.py), the target's and the draft's: the
    destination starts the request with those its prefix cache holds, and they are not copied."""

    target: tuple[int, ...] = ()
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """The destination's yes to a migration's handshake: room is held for the request, and the KV of its first
    `cached_tokens` tokens (`draft_cached_tokens` of the draft's) is already here, in its prefix cache."""

    cached_tokens: int = 0
    draft_cached_tokens: int = 0
    kv_bytes_per_token: int = 0  # of the target's KV, every layer, K and V: what a token copied moves


class Endpoint(Protocol):
    """One instance's side of a migration (every method is awaited; each runs between two engine steps)."""

    async def migrate_length(self, request_id: str) -> int | None:
        """Source: tokens of the request's KV now; None if it does not run here."""
        ...

    async def migrate_names(self, request_id: str) -> BlockNames:
        """Source: the names of the full blocks of the request's KV now (none without prefix caching)."""
        ...

    async def migrate_reserve(self, request_id: str, tokens: int, lease_s: float,
                              names: BlockNames = BlockNames()) -> Reservation | None:
        """Destination: hold blocks for `tokens` tokens of the request, starting it with the cached blocks of the
        leading `names`; None: it refuses. If no call of this migration comes for `lease_s` while it is not
        committed, the destination drops what it holds for it on its own."""
        ...

    async def migrate_export(self, request_id: str, start: int, end: int, via: str | None = None
                             ) -> tuple[object, int] | None:
        """Source: the request's KV from `start` to `end` (or to what it holds, if less), and where that ends;
        None if it ended meanwhile. With `via` (this migration's channel) its tensors go over that channel."""
        ...

    async def migrate_import(self, kv: object) -> bool:
        """Destination: append KV; False if out of blocks."""
        ...

    async def migrate_export_draft(self, request_id: str, start: int, end: int, via: str | None = None
                                   ) -> tuple[object, int] | None:
        """Source: the request's draft KV from `start` to `end` (or to what it holds) as it stands, and where that
        ends; None without a draft model, or draft KV beyond `start`."""
        ...

    async def migrate_import_draft(self, kv: object) -> bool:
        """Destination: append the arriving request's draft KV; False if it cannot (its draft catches up there)."""
        ...

    async def migrate_stop(self, request_id: str, start: int, via: str | None, lease_s: float
                           ) -> tuple[Request, object, int, float] | None:
        """Source: take the request out of its step loop (KV kept) and return it, as a request that resumes,
        with its KV from `start`, where that ends, and the seconds the stop waited for the step under way to
        end (the request still decoded meanwhile); None if it ended meanwhile. If no release comes within
        `lease_s`, the source resumes the request on its own (the coordinator is gone)."""
        ...

    async def migrate_commit(self, request: Request) -> bool:
        """Destination: the request resumes here on the KV imported for it; its stream waits for its client (for
        the lease given at the reservation: a copy nobody follows is aborted, its KV freed)."""
        ...

    async def migrate_release(self, request_id: str, committed: bool, destination: object) -> bool:
        """Source: committed: free the request's KV and end its stream pointing at `destination`; else resume it.
        False if the source no longer holds the request stopped (its client left meanwhile, or its lease ran out
        and it resumed there): then nothing follows a committed copy, which must be cancelled."""
        ...

    async def migrate_drop(self, request_id: str) -> None:
        """Destination: forget a request that was not committed (free its KV)."""
        ...

    async def migrate_cancel(self, request_id: str) -> None:
        """Destination: end a request committed here whose source failed before its release (its KV freed, its
        waiting stream dropped): its client's stream fails over instead."""
        ...

    # ---- the migration's links (only with `transfer: torch`)
    async def kv_stages(self, pipeline: str) -> list[tuple[int, ...]] | None:
        """Both: the layers of each stage of `pipeline` ("target" or "draft"); None if it has none, or its KV
        cannot go stage to stage (then it goes through the object store)."""
        ...

    async def kv_device(self, pipeline: str) -> str:
        """Both: the device type ("cuda" or "cpu") the stages of `pipeline` keep their KV on."""
        ...

    async def link_addresses(self, pipeline: str, stages: list[int]) -> list[str]:
        """Source: a rendezvous address for each of `stages` (one per link it will host), on that stage's node."""
        ...

    async def links_open(self, channel: str, pipeline: str, links: list[Link], side: str, timeout_s: float,
                         backend: str) -> None:
        """Both: join every link of `pipeline` its stages take part in (`side` "src": as rank 0, "dst": as rank 1)
        over `backend` (gloo or nccl); both ends are called at once. Afterwards, `via=channel` sends over them."""
        ...

    async def channel_close(self, channel: str) -> None:
        """Both: forget every link of the migration's channel (and anything received on them and not imported)."""
        ...


class RayEndpoint:
    """An Endpoint over an instance actor's handle (actors/serving/server.py, InstanceServer): each method is one
    call of the actor's method of the same name, awaited. The coordinator bounds every call with a deadline
    (`Deadlined`, below); tests/unit/test_migration_endpoint.py holds InstanceServer to the protocol."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def migrate_length(self, request_id: str) -> int | None:
        return await self.handle.migrate_length.remote(request_id)

    async def migrate_names(self, request_id: str) -> BlockNames:
        return await self.handle.migrate_names.remote(request_id)

    async def migrate_reserve(self, request_id: str, tokens: int, lease_s: float,
                              names: BlockNames = BlockNames()) -> Reservation | None:
        return await self.handle.migrate_reserve.remote(request_id, tokens, lease_s, names)

    async def migrate_export(self, request_id: str, start: int, end: int, via: str | None = None
                             ) -> tuple[object, int] | None:
        return await self.handle.migrate_export.remote(request_id, start, end, via)

    async def migrate_import(self, kv: object) -> bool:
        return await self.handle.migrate_import.remote(kv)

    async def migrate_export_draft(self, request_id: str, start: int, end: int, via: str | None = None
                                   ) -> tuple[object, int] | None:
        return await self.handle.migrate_export_draft.remote(request_id, start, end, via)

    async def migrate_import_draft(self, kv: object) -> bool:
        return await self.handle.migrate_import_draft.remote(kv)

    async def migrate_stop(self, request_id: str, start: int, via: str | None, lease_s: float
                           ) -> tuple[Request, object, int, float] | None:
        return await self.handle.migrate_stop.remote(request_id, start, via, lease_s)

    async def migrate_commit(self, request: Request) -> bool:
        return await self.handle.migrate_commit.remote(request)

    async def migrate_release(self, request_id: str, committed: bool, destination: object) -> bool:
        return await self.handle.migrate_release.remote(request_id, committed, destination)

    async def migrate_drop(self, request_id: str) -> None:
        return await self.handle.migrate_drop.remote(request_id)

    async def migrate_cancel(self, request_id: str) -> None:
        return await self.handle.migrate_cancel.remote(request_id)

    async def kv_stages(self, pipeline: str) -> list[tuple[int, ...]] | None:
        return await self.handle.kv_stages.remote(pipeline)

    async def kv_device(self, pipeline: str) -> str:
        return await self.handle.kv_device.remote(pipeline)

    async def link_addresses(self, pipeline: str, stages: list[int]) -> list[str]:
        return await self.handle.link_addresses.remote(pipeline, stages)

    async def links_open(self, channel: str, pipeline: str, links: list[Link], side: str, timeout_s: float,
                         backend: str) -> None:
        return await self.handle.links_open.remote(channel, pipeline, links, side, timeout_s, backend)

    async def channel_close(self, channel: str) -> None:
        return await self.handle.channel_close.remote(channel)


class Deadlined:
    """An Endpoint whose every call answers within `timeout_s` or raises StepTimeout (naming the call and the end).

    A call that times out is not taken back: the instance may still carry it out later, after the coordinator
    gave up. Each end therefore also lets go on its own of what a migration leaves behind (the leases of
    `migrate_reserve` and `migrate_stop`, actors/serving/server.py)."""

    def __init__(self, endpoint: Endpoint, side: str, timeout_s: float) -> None:
        self.endpoint, self.side, self.timeout_s = endpoint, side, timeout_s

    async def _bounded(self, call, what: str, timeout_s: float | None = None):
        limit = timeout_s or self.timeout_s
        try:
            return await asyncio.wait_for(call, limit)
        except asyncio.TimeoutError:
            raise StepTimeout(f"the {self.side}'s {what} did not answer within {limit:g} s") from None

    async def migrate_length(self, request_id):
        return await self._bounded(self.endpoint.migrate_length(request_id), "migrate_length")

    async def migrate_names(self, request_id):
        return await self._bounded(self.endpoint.migrate_names(request_id), "migrate_names")

    async def migrate_reserve(self, request_id, tokens, lease_s, names=BlockNames()):
        return await self._bounded(self.endpoint.migrate_reserve(request_id, tokens, lease_s, names),
                                   "migrate_reserve")

    async def migrate_export(self, request_id, start, end, via=None):
        return await self._bounded(self.endpoint.migrate_export(request_id, start, end, via), "migrate_export")

    async def migrate_import(self, kv):
        return await self._bounded(self.endpoint.migrate_import(kv), "migrate_import")

    async def migrate_export_draft(self, request_id, start, end, via=None):
        return await self._bounded(self.endpoint.migrate_export_draft(request_id, start, end, via),
                                   "migrate_export_draft")

    async def migrate_import_draft(self, kv):
        return await self._bounded(self.endpoint.migrate_import_draft(kv), "migrate_import_draft")

    async def migrate_stop(self, request_id, start, via, lease_s):
        return await self._bounded(self.endpoint.migrate_stop(request_id, start, via, lease_s), "migrate_stop")

    async def migrate_commit(self, request):
        return await self._bounded(self.endpoint.migrate_commit(request), "migrate_commit")

    async def migrate_release(self, request_id, committed, destination):
        return await self._bounded(self.endpoint.migrate_release(request_id, committed, destination),
                                   "migrate_release")

    async def migrate_drop(self, request_id):
        return await self._bounded(self.endpoint.migrate_drop(request_id), "migrate_drop")

    async def migrate_cancel(self, request_id):
        return await self._bounded(self.endpoint.migrate_cancel(request_id), "migrate_cancel")

    async def kv_stages(self, pipeline):
        return await self._bounded(self.endpoint.kv_stages(pipeline), "kv_stages")

    async def kv_device(self, pipeline):
        return await self._bounded(self.endpoint.kv_device(pipeline), "kv_device")

    async def link_addresses(self, pipeline, stages):
        return await self._bounded(self.endpoint.link_addresses(pipeline, stages), "link_addresses")

    async def links_open(self, channel, pipeline, links, side, timeout_s, backend):
        # opening waits for the other end up to `timeout_s` by itself: the deadline leaves it that long and more
        return await self._bounded(self.endpoint.links_open(channel, pipeline, links, side, timeout_s, backend),
                                   "links_open", max(self.timeout_s, timeout_s + 5))

    async def channel_close(self, channel):
        return await self._bounded(self.endpoint.channel_close(channel), "channel_close")
