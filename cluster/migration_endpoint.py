"""What the migration coordinator (cluster/migration.py) sees of an instance: the Endpoint protocol (one call that
takes a message of cluster/migration_messages.py), its Ray implementation over an instance actor's handle, and
`Deadlined`, the one deadline wrapper that bounds every call of a migration.

A migration's calls go to two other processes over the network; any of them can hang (a frozen process, a cut
link, a node that died without a word). `Deadlined` gives each call `step_timeout_s`, after which it raises
`StepTimeout` and the coordinator aborts the migration as it would for that end's failure.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from cluster.migration_messages import (BlockNames, Link, MigrationMessage, OpenLinks, Reservation, Side)

__all__ = ["BlockNames", "Deadlined", "Endpoint", "Link", "RayEndpoint", "Reservation", "StepTimeout"]


class StepTimeout(TimeoutError):
    """A call of a migration to one instance did not answer within its deadline."""


class Endpoint(Protocol):
    """One instance's side of a migration: each message is answered between two engine steps; what each message
    returns is written on its class (cluster/migration_messages.py)."""

    async def migration(self, msg: MigrationMessage) -> object:
        """Carry out `msg` at this instance and return its answer; a message this end does not know raises TypeError."""
        ...


class RayEndpoint:
    """An Endpoint over an instance actor's handle (actors/serving/server.py, InstanceServer): each message is one
    call of the actor's `migration`, awaited. The coordinator bounds every call with a deadline (`Deadlined`)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def migration(self, msg: MigrationMessage) -> object:
        return await self.handle.migration.remote(msg)


class Deadlined:
    """An Endpoint whose every call answers within `timeout_s` or raises StepTimeout (naming the message and the end).

    A call that times out is not taken back: the instance may still carry it out later, after the coordinator
    gave up. Each end therefore also lets go on its own of what a migration leaves behind (the leases of `Reserve`
    and `Stop`, actors/serving/server.py)."""

    def __init__(self, endpoint: Endpoint, side: Side, timeout_s: float) -> None:
        self.endpoint, self.side, self.timeout_s = endpoint, side, timeout_s

    async def migration(self, msg: MigrationMessage) -> object:
        limit = self.timeout_s
        if isinstance(msg, OpenLinks):  # opening waits for the other end up to its own timeout: leave it that and more
            limit = max(self.timeout_s, msg.timeout_s + 5)
        try:
            return await asyncio.wait_for(self.endpoint.migration(msg), limit)
        except asyncio.TimeoutError:
            raise StepTimeout(f"the {self.side.word}'s {type(msg).__name__} did not answer within {limit:g} s"
                              ) from None
