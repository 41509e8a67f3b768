"""Serve's HTTP proxy answers a key refused as a whole until its Retry-After, without calling the replica."""

from __future__ import annotations

import asyncio
import json

from starlette.middleware import Middleware

from deploy.serve.admission import Admission
from cluster.config import KeyLimits
from deploy.serve.auth import Tenant
from deploy.serve.openai_api import APIError
from deploy.serve.proxy_guard import KEY_REFUSED, RefusalMemo, key_refused_header, middlewares


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replica:
    """An ASGI app that answers each request with the next reply it is given, and counts the requests it saw."""

    def __init__(self, *replies: tuple[int, dict[str, str]]) -> None:
        self.replies, self.calls = list(replies), 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        status, headers = self.replies.pop(0) if self.replies else (200, {})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": b"{}"})


def request(memo: RefusalMemo, key: str = "sk-a", path: str = "/v1/completions", method: str = "POST"):
    """One request through `memo`: (status, headers, body)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]}
    asyncio.run(memo(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def refused(seconds: float = 1.0, code: str = "too_many_concurrent_requests") -> tuple[int, dict[str, str]]:
    return 429, {"retry-after": "1", **key_refused_header(seconds, code)}


def test_a_key_refused_as_a_whole_is_answered_by_the_proxy_until_its_retry_after() -> None:
    clock = Clock()
    replica = Replica(refused(1.5))
    memo = RefusalMemo(replica, clock=clock)
    status, headers, _ = request(memo)
    assert status == 429 and KEY_REFUSED not in headers  # the mark is for the proxy, not passed on
    clock.now += 0.4
    status, headers, body = request(memo)
    assert replica.calls == 1 and memo.answered == 1  # not asked again
    error = json.loads(body)["error"]
    assert status == 429 and headers["retry-after"] == "2"  # 1.1 s left, in whole seconds
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_concurrent_requests"
    assert "retry after 2 s" in error["message"]
    clock.now += 1.2  # past the deadline: the replica decides again
    assert request(memo)[0] == 200 and replica.calls == 2


def test_only_that_keys_generation_requests_are_answered_so() -> None:
    clock = Clock()
    replica = Replica(refused())
    memo = RefusalMemo(replica, clock=clock)
    request(memo, key="sk-a")
    assert request(memo, key="sk-b")[0] == 200  # another key
    assert request(memo, key="sk-a", path="/v1/models", method="GET")[0] == 200  # not a generation route
    assert request(memo, key="sk-a", path="/v1/chat/completions")[0] == 429  # every generation route
    assert replica.calls == 3


def test_unmarked_refusals_are_not_remembered() -> None:
    """The replica's pending limit, or one request's cost in tokens, may pass on another replica or for a smaller
    request: such 429s carry no mark and the next request goes to the replica."""
    replica = Replica((429, {"retry-after": "1"}))
    memo = RefusalMemo(replica, clock=Clock())
    assert request(memo)[0] == 429
    assert request(memo)[0] == 200 and replica.calls == 2 and not memo.refused


def test_the_memo_keeps_at_most_max_keys_digests_and_no_key() -> None:
    clock = Clock()
    memo = RefusalMemo(Replica(*[refused(30.0)] * 6), max_keys=4, clock=clock)
    for i in range(6):
        request(memo, key=f"sk-{i}")
    assert len(memo.refused) == 4
    assert all(len(d) == 16 and b"sk-" not in d for d in memo.refused)
    assert request(memo, key="sk-0")[0] == 200  # the oldest was dropped first
    assert request(memo, key="sk-5")[0] == 429


def test_admission_marks_the_keys_own_refusals_only() -> None:
    """precheck's refusals of the key (its concurrency, its empty bucket) carry the mark; the replica's pending
    limit does not."""
    clock = Clock()
    admission = Admission(max_pending=3, retry_after_s=1, clock=clock)
    tenant = Tenant("a", KeyLimits(max_concurrent=1, tokens_per_minute=None, max_priority=0))
    admission.precheck(tenant)
    try:
        admission.precheck(tenant)
    except APIError as e:
        assert e.status == 429 and e.headers[KEY_REFUSED] == "1.000 too_many_concurrent_requests"
    else:
        raise AssertionError("a second body of a key at max_concurrent 1 was let in")
    others = [Tenant(f"o{i}", KeyLimits(max_concurrent=4, tokens_per_minute=None, max_priority=0)) for i in range(3)]
    admission.precheck(others[0])
    admission.precheck(others[1])
    try:
        admission.precheck(others[2])
    except APIError as e:
        assert e.status == 429 and e.code == "too_many_pending_requests" and KEY_REFUSED not in e.headers
    else:
        raise AssertionError("the replica's pending limit let a fourth body in")


def test_serves_proxy_callback_gives_starlette_middleware() -> None:
    [m] = middlewares()
    assert isinstance(m, Middleware) and m.cls is RefusalMemo
