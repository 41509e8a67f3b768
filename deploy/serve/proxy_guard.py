"""Serve's HTTP proxy answers a key the API replica just refused as a whole, until the Retry-After it was given.

A key at its limits (all of its `max_concurrent` in flight, or its tokens-per-minute bucket empty) is refused by the
replica before the body is read (deploy/serve/admission.py `precheck`), with Retry-After. A client that does not
wait and sends again at once still cost the proxy a call to the replica and the replica its ASGI stack: about 10 ms
of CPU a refusal here (docs/security.md), which a hostile client's hundreds of retries a second take from other keys.
So the replica marks such a refusal (`KEY_REFUSED`: the seconds and the reason's code), and `RefusalMemo`, a pure
ASGI middleware that Ray Serve runs in its HTTP proxy (`middlewares`, named by
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the Serve job's environment: deploy/serve/serve_env.py), remembers the
key until then and answers the key's generation requests itself in the meantime: the same 429, error type and
code, with the seconds still left. A client that honours Retry-After, as OpenAI's SDKs do, never meets it.

What it keeps: a 16-byte digest of each refused key's Authorization header (never the key), with its deadline, at
most `max_keys` of them (the expired are dropped first, then the oldest). Refusals of the whole replica (its pending
limit) and of one request (its cost in tokens) are not marked: another replica, or a smaller request, may be
admitted. Limits hold per API replica (admission.py), and a refusal is remembered per proxy.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_REFUSED = "x-specfleet-key-refused"  # "SECONDS CODE" on a replica's 429 that holds for the key as a whole
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})  # what precheck guards

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def key_refused_header(seconds: float, code: str) -> dict[str, str]:
    """The replica's mark on a 429 that refuses the key as a whole for `seconds`."""
    return {KEY_REFUSED: f"{seconds:.3f} {code}"}


class RefusalMemo:
    """ASGI middleware: remembers keys refused as a whole (`KEY_REFUSED`) and refuses their generation requests
    until then without calling the app behind it."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.max_keys, self.clock = app, max_keys, clock
        self.refused: OrderedDict[bytes, tuple[float, str]] = OrderedDict()  # key digest -> (deadline, code)
        self.answered = 0  # requests refused here, without the app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        digest = _key_digest(scope)
        if digest is None:
            return await self.app(scope, receive, send)
        now = self.clock()
        held = self.refused.get(digest)
        if held is not None:
            if held[0] > now:
                self.answered += 1
                return await _refuse(send, held[0] - now, held[1])
            del self.refused[digest]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                message["headers"] = self._note(digest, message.get("headers") or [])
            await send(message)

        await self.app(scope, receive, sending)

    def _note(self, digest: bytes, headers: list) -> list:
        """Remember the key if the replica marked its refusal; the mark itself is not passed on."""
        mark = KEY_REFUSED.encode()
        marks = [value for name, value in headers if name.lower() == mark]
        if not marks:
            return headers
        seconds, _, code = marks[0].decode("latin-1").partition(" ")
        self.refused[digest] = (self.clock() + float(seconds), code)
        self.refused.move_to_end(digest)
        self._bound()
        return [(name, value) for name, value in headers if name.lower() != mark]

    def _bound(self) -> None:
        if len(self.refused) <= self.max_keys:
            return
        now = self.clock()
        for digest in [d for d, (until, _) in self.refused.items() if until <= now]:
            del self.refused[digest]
        while len(self.refused) > self.max_keys:
            self.refused.popitem(last=False)


def _key_digest(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return hashlib.blake2b(value, digest_size=16).digest()
    return None


async def _refuse(send: Send, left_s: float, code: str) -> None:
    """The replica's refusal again: a 429 with the seconds still left (whole, at least 1)."""
    retry = max(1, math.ceil(left_s))
    body = json.dumps({"error": {
        "message": f"this API key is at its limits ({code}): the server refused it less than {retry} s ago; "
                   f"retry after {retry} s", "type": "rate_limit_error", "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry).encode())]})
    await send({"type": "http.response.body", "body": body})


def middlewares() -> list:
    """Serve's HTTP proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): the middlewares it runs."""
    from starlette.middleware import Middleware

    return [Middleware(RefusalMemo)]
