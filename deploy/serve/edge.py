"""The API replica's edge: what a request passes, in order, before any work is done for it (HTTP and gRPC alike).

    held = edge.precheck(tenant)     # before the body is read; released however the request goes on
    call = await edge.start(tenant, n=..., priority=..., max_tokens=..., encode=..., prepare=..., held=held)

0. before the body is read: 429 if the key or the replica has no room for even one more choice, or the key's
   tokens-per-minute bucket is empty (a key at its limit costs no body transfer or parsing); else the read holds
   one choice of the key's room (`held`), so a key with slow bodies holds at most `max_concurrent` connections
   reading them, and passes it to the request's admission;
1. the key's priority cap, and n * max_tokens when max_tokens is given (400);
2. admission (deploy/serve/admission.py): the key's concurrency, the replica's pending limit, and whether the
   key's tokens-per-minute bucket could take even the tokens known so far (429 with Retry-After);
3. tokenization, on the bounded pool fair among keys (deploy/serve/tokenizing.py; 429 when its queue is full);
4. the prompt's and sampling fields' checks (`prepare`: 400), n * max_tokens as resolved (400), and the cost in
   tokens taken from the key's bucket (429);
5. routing (`Frontend.start`: 429 / 503 from the router).

The admission ticket is released when the call closes, however it ends, or at once if a step above fails.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from cluster.config import EdgeConfig, ServeConfig
from deploy.serve.admission import Admission, Ticket
from deploy.serve.auth import Tenant
from deploy.serve.frontend import Call, Frontend, Prepared
from deploy.serve.openai_api import APIError


class Edge:
    """Admission and the order of checks for one API replica."""

    def __init__(self, cfg: ServeConfig, frontend: Frontend) -> None:
        self.cfg: EdgeConfig = cfg.edge
        self.frontend = frontend
        self.admission = Admission(cfg.max_pending_requests, cfg.retry_after_s)

    def precheck(self, tenant: Tenant) -> Ticket:
        """The body's ticket (admission.py `precheck`): release it if the request ends before `start`."""
        return self.admission.precheck(tenant)

    def check_messages(self, count: int) -> None:
        if count > self.cfg.max_messages:
            raise APIError(400, f"{count} messages: at most {self.cfg.max_messages} (serve.edge.max_messages)",
                           param="messages", code="limit_exceeded")

    def _check_generated(self, n: int, max_tokens: int) -> None:
        if n * max_tokens > self.cfg.max_generated_tokens:
            raise APIError(400, f"n * max_tokens = {n} * {max_tokens} exceeds this server's limit of "
                                f"{self.cfg.max_generated_tokens} generated tokens per request; lower max_tokens "
                                f"(without it, a chat request may run to the end of the context) or n",
                           param="max_tokens", code="limit_exceeded")

    async def start(self, tenant: Tenant, *, n: int, priority: int, max_tokens: int | None,
                    encode: Callable[[], Awaitable[list[int]]], prepare: Callable[[list[int]], Prepared],
                    held: Ticket | None = None) -> Call:
        """Admit, tokenize, check and route one request; see the module docstring for the order. `held` (its
        body's ticket) is released whatever happens."""
        try:
            self.admission.check_priority(tenant, priority)
            if max_tokens is not None:
                self._check_generated(n, max_tokens)
            ticket = self.admission.admit(tenant, n, min_tokens=n * (max_tokens or 1), held=held)
        finally:
            if held is not None:
                held.release()
        try:
            ids = await encode()
            prep = prepare(ids)
            self._check_generated(n, prep.params[0].max_tokens)
            self.admission.charge(ticket, len(ids) + sum(p.max_tokens for p in prep.params))
            call = await self.frontend.start(prep)
        except BaseException:
            ticket.release()
            raise
        call.on_close(ticket.release)
        return call
