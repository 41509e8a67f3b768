"""A pool's threads shared fairly among tenants: at most `workers` jobs at once, one tenant on at most all but one.

The rules of the API replica's tokenizer pool (deploy/serve/tokenizing.py) and an instance's grammar compiler
(actors/serving/grammar_pool.py), kept in one place:

- at most `workers` jobs run at once (the pool's threads);
- one tenant runs at most `workers - 1` of them (all, with one worker), so a thread stays free for the others;
- at most `queue_limit` jobs wait for a thread, served round-robin by tenant; one more gets `full(busy, queued)`
  raised (the caller's own error: a 429 at the edge, a refusal at an instance);
- the bookkeeping runs on the event loop; a thread's slot is given back when its job ends, even if the request
  that waited for it was cancelled meanwhile (a thread cannot be stopped, so its slot stays taken until then);
- a waiter cancelled while queued never takes a slot, even when a slot frees between its cancellation and its task
  running (that slot once went to the cancelled waiter and was never given back: one client cut at that moment left a
  tenant holding no thread yet unable to start one, and its requests waited for good).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class FairSlots:
    """Slots of a `workers`-thread executor, taken per tenant; see the module docstring for the rules."""

    def __init__(self, workers: int, queue_limit: int, full: Callable[[int, int], Exception]) -> None:
        self.workers, self.queue_limit, self._full = workers, queue_limit, full
        self.share = max(1, workers - 1)  # threads one tenant may hold at once
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # tenant -> its jobs' gates, in arrival order
        self._queued = 0
        self._turn: deque[str] = deque()  # tenants in round-robin order

    @property
    def busy(self) -> int:
        return sum(self._running.values())

    @property
    def queued(self) -> int:
        return self._queued

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    async def submit(self, executor: Executor, tenant: str, fn: Callable[..., T], *args: Any) -> Future:
        """Wait for a slot of `tenant`'s (fn's error if the queue is full), then run `fn(*args)` on `executor`; the
        slot is given back when the job ends. Returns the job's future."""
        loop = asyncio.get_running_loop()
        await self.acquire(tenant)
        try:
            job = executor.submit(fn, *args)
        except BaseException:
            self.release(tenant)
            raise
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self.release, tenant))
        return job

    async def acquire(self, tenant: str) -> None:
        """Take a slot for `tenant`, waiting for its turn; `full(...)` raised when the queue is full."""
        if self.busy < self.workers and self.running(tenant) < self.share:
            self._running[tenant] = self.running(tenant) + 1
            return
        if self._queued >= self.queue_limit:
            raise self._full(self.busy, self._queued)
        gate = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(gate)
        if tenant not in self._turn:
            self._turn.append(tenant)
        self._queued += 1
        try:
            await gate
        except asyncio.CancelledError:
            # whoever takes a gate out of the queue counts it out: here if it still waits, else `release` did (and
            # gave it the slot, or, cancelled before its turn came, dropped it)
            gates = self._waiting.get(tenant)
            if gates is not None and gate in gates:
                gates.remove(gate)
                self._queued -= 1
            elif gate.done() and not gate.cancelled():  # a slot was given to us just now: hand it on
                self.release(tenant)
            raise

    def release(self, tenant: str) -> None:
        """A job of `tenant` ended: give its slot to the next waiting tenant in turn that may take one."""
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        for _ in range(len(self._turn)):
            if self.busy >= self.workers:
                return
            who = self._turn[0]
            self._turn.rotate(-1)
            gates = self._waiting.get(who)
            while gates and gates[0].done():  # cancelled before its turn came, its task not run yet: no slot for it
                gates.popleft()
                self._queued -= 1
            if not gates:
                self._turn.remove(who)
                self._waiting.pop(who, None)
                continue
            if self.running(who) >= self.share:
                continue
            gate = gates.popleft()
            self._queued -= 1
            self._running[who] = self.running(who) + 1
            gate.set_result(None)
            return
