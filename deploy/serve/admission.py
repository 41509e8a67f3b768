"""Admission before any work: the replica's pending limit and each tenant's concurrency, tokens per minute and priority.

Pure (no Ray, no I/O); the API replica holds one `Admission` and asks it, in order, before it tokenizes a request
(`check_priority`, `admit`: 400 / 429 at once) and once it knows the request's cost in tokens (`charge`). The
ticket `admit` returns holds the request's share of the limits until it is released, exactly once, when the
request ends however it ends.

Concurrency counts choices (`n: 16` takes 16 of a key's `max_concurrent`), since each is a sequence the engine
runs. Tokens per minute is a token bucket per key (capacity `tokens_per_minute`, refilled at that rate): a
request costs its prompt plus n * max_tokens, charged at admission as OpenAI's limits count it, and is refused
with 429 and the seconds until the bucket holds enough (400 if it never could). Limits hold per API replica
(one by default); the router's `max_pending_requests` check at routing is the cluster-wide backstop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.serve.auth import Tenant
from deploy.serve.openai_api import APIError
from deploy.serve.proxy_guard import key_refused_header

KEY_WIDE = frozenset({"too_many_concurrent_requests", "tokens_per_minute_exceeded"})  # refusals of the key itself


def too_many(message: str, code: str, retry_after_s: float) -> APIError:
    """A 429 telling the client when to try again (whole seconds, at least 1)."""
    retry = str(max(1, math.ceil(retry_after_s)))
    return APIError(429, f"{message}; retry after {retry} s", type_="rate_limit_error", code=code,
                    headers={"Retry-After": retry})


class TokenBucket:
    """`capacity` tokens, refilled continuously at `capacity` per minute."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.rate = capacity / 60.0  # tokens per second
        self.at = now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait_s(self, cost: int, now: float) -> float:
        """Seconds until `cost` tokens are there (0: now)."""
        return max(0.0, (cost - self.refill(now)) / self.rate)


@dataclass
class Ticket:
    """A request's admission: `n` choices of its tenant's concurrency and of the replica's pending limit."""

    tenant: Tenant
    n: int
    _release: Callable[["Ticket"], None]
    released: bool = field(default=False)

    def release(self) -> None:
        """Give the request's share back (idempotent)."""
        if not self.released:
            self.released = True
            self._release(self)


class Admission:
    """One API replica's admission state: choices in flight, per tenant and in all, and each tenant's bucket."""

    def __init__(self, max_pending: int, retry_after_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.in_flight = 0
        self.by_tenant: dict[str, int] = {}
        self.buckets: dict[str, TokenBucket] = {}

    def check_priority(self, tenant: Tenant, priority: int) -> None:
        if priority > tenant.limits.max_priority:
            raise APIError(400, f"priority {priority} is above this API key's max_priority "
                                f"({tenant.limits.max_priority})", param="priority", code="priority_not_allowed")

    def precheck(self, tenant: Tenant) -> Ticket:
        """429 at once, before the body is even read, when no request of this key could be admitted now: the key
        or the replica has no room for one more choice, or the key's token bucket is empty. Otherwise the body's
        read holds one choice of the key's and the replica's room until it is released or passed to the request
        (`admit(held=)`): a key reads at most `max_concurrent` bodies at once, however slowly they arrive. A refusal
        of the key itself (not of the replica) is marked for Serve's proxy, which answers the key's requests until
        the Retry-After without asking the replica again (deploy/serve/proxy_guard.py)."""
        try:
            self._room(tenant, 1)
            self._check_tokens(tenant, 1, take=False)
        except APIError as e:
            if e.status == 429 and e.code in KEY_WIDE:
                e.headers.update(key_refused_header(float(e.headers["Retry-After"]), e.code))
            raise
        return self._take(tenant, 1)

    def _take(self, tenant: Tenant, n: int) -> Ticket:
        self.in_flight += n
        self.by_tenant[tenant.name] = self.by_tenant.get(tenant.name, 0) + n
        return Ticket(tenant, n, self._give_back)

    def _room(self, tenant: Tenant, n: int) -> None:
        limits = tenant.limits
        if self.by_tenant.get(tenant.name, 0) + n > limits.max_concurrent:
            raise too_many(f"this API key already has {self.by_tenant[tenant.name]} choices in flight, of "
                           f"max_concurrent {limits.max_concurrent}", "too_many_concurrent_requests",
                           self.retry_after_s)
        if self.in_flight + n > self.max_pending:
            raise too_many(f"the server is busy: {self.in_flight} choices pending, of max_pending_requests "
                           f"{self.max_pending}", "too_many_pending_requests", self.retry_after_s)

    def admit(self, tenant: Tenant, n: int, min_tokens: int = 0, held: Ticket | None = None) -> Ticket:
        """Admit a request of `n` choices that will cost at least `min_tokens` (known before tokenizing), or raise
        APIError: 400 if it can never be admitted under the key's limits, 429 if not now. `held`, the ticket its
        body's read held (`precheck`), is released first: its slot passes to the request."""
        if held is not None:
            held.release()
        limits = tenant.limits
        if n > limits.max_concurrent:
            raise APIError(400, f"n = {n} choices exceed this API key's max_concurrent ({limits.max_concurrent})",
                           param="n", code="limit_exceeded")
        self._room(tenant, n)
        if min_tokens:
            self._check_tokens(tenant, min_tokens, take=False)
        return self._take(tenant, n)

    def charge(self, ticket: Ticket, tokens: int) -> None:
        """Take a request's cost (prompt + n * max_tokens) from its tenant's bucket; APIError 429 / 400 if it
        does not fit (the ticket stays held: its owner releases it)."""
        self._check_tokens(ticket.tenant, tokens, take=True)

    def _check_tokens(self, tenant: Tenant, cost: int, take: bool) -> None:
        capacity = tenant.limits.tokens_per_minute
        if capacity is None:
            return
        if cost > capacity:
            raise APIError(400, f"the request may use {cost} tokens (prompt + n * max_tokens), more than this API "
                                f"key's tokens_per_minute ({capacity}): lower max_tokens or n",
                           param="max_tokens", code="limit_exceeded")
        now = self.clock()
        bucket = self.buckets.setdefault(tenant.name, TokenBucket(capacity, now))
        wait = bucket.wait_s(cost, now)
        if wait > 0:
            raise too_many(f"this API key's tokens_per_minute ({capacity}) is spent: the request may use {cost} "
                           f"tokens, {int(bucket.level)} are left", "tokens_per_minute_exceeded", wait)
        if take:
            bucket.level -= cost

    def _give_back(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.n
        left = self.by_tenant[ticket.tenant.name] - ticket.n
        if left:
            self.by_tenant[ticket.tenant.name] = left
        else:
            del self.by_tenant[ticket.tenant.name]
