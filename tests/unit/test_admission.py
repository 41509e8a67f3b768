"""Admission before work, on plain data: per-key concurrency, tokens per minute and priority, the pending limit, the
tokenizer pool's bounded and fair queue, and API keys with their tenants."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.config import AuthConfig, KeyLimits
from deploy.serve.admission import Admission
from deploy.serve.auth import KeySet, Tenant
from deploy.serve.openai_api import APIError
from deploy.serve.tokenizing import TokenizerPool, max_chars_per_token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str = "a", **limits) -> Tenant:
    return Tenant(name, KeyLimits(**limits))


def status(fn, *args, **kwargs) -> tuple[int, str | None, dict]:
    with pytest.raises(APIError) as err:
        fn(*args, **kwargs)
    return err.value.status, err.value.code, err.value.headers


def test_a_keys_concurrency_counts_choices_and_is_given_back_once() -> None:
    adm = Admission(max_pending=100, retry_after_s=1)
    a, b = tenant("a", max_concurrent=4), tenant("b", max_concurrent=4)
    assert status(adm.admit, a, 5)[:2] == (400, "limit_exceeded")  # n above the limit: never admissible
    t1 = adm.admit(a, 3)
    assert status(adm.admit, a, 2)[:2] == (429, "too_many_concurrent_requests")
    adm.admit(a, 1)
    assert status(adm.precheck, a)[0] == 429  # 4 of 4 in flight: refused before the body is read
    adm.admit(b, 4)  # another key is not held back
    t1.release()
    t1.release()  # idempotent
    assert adm.by_tenant == {"a": 1, "b": 4} and adm.in_flight == 5
    adm.precheck(a)


def test_a_body_being_read_holds_a_slot_of_its_key_until_its_request_is_admitted() -> None:
    """A slow body holds its key's slot from before its first byte (precheck's ticket), so one key cannot hold more
    connections reading bodies than its max_concurrent; the slot passes to its request's ticket at admission."""
    adm = Admission(max_pending=100, retry_after_s=1)
    a = tenant("a", max_concurrent=2)
    h1, h2 = adm.precheck(a), adm.precheck(a)
    assert status(adm.precheck, a)[:2] == (429, "too_many_concurrent_requests")
    adm.precheck(tenant("b"))  # another key still reads its bodies
    h1.release()
    h1.release()  # idempotent
    t = adm.admit(a, 2, held=h2)  # the body's slot passes to its request: n = 2 fits a limit of 2
    assert h2.released and adm.by_tenant["a"] == 2
    t.release()
    assert adm.by_tenant.get("a", 0) == 0 and adm.in_flight == 1  # b's read


def test_the_replicas_pending_limit_holds_for_all_keys_together() -> None:
    adm = Admission(max_pending=5, retry_after_s=3)
    adm.admit(tenant("a"), 3)
    code, reason, headers = status(adm.admit, tenant("b"), 3)
    assert (code, reason, headers) == (429, "too_many_pending_requests", {"Retry-After": "3"})


def test_tokens_per_minute_is_a_bucket_refilled_over_a_minute() -> None:
    clock = Clock()
    adm = Admission(max_pending=100, retry_after_s=1, clock=clock)
    a = tenant(tokens_per_minute=600)  # 10 tokens a second
    assert status(adm.admit, a, 1, min_tokens=601)[:2] == (400, "limit_exceeded")  # more than a minute's worth
    t = adm.admit(a, 1, min_tokens=100)
    adm.charge(t, 500)
    code, reason, headers = status(adm.charge, adm.admit(a, 1), 200)
    assert (code, reason) == (429, "tokens_per_minute_exceeded") and headers["Retry-After"] == "10"  # 100 left
    clock.now = 10.0  # 100 more
    adm.charge(adm.admit(a, 1), 200)
    assert status(adm.precheck, a)[0] == 429  # empty: refused before the body is read
    clock.now = 1000.0
    adm.charge(adm.admit(a, 1), 600)  # full again, never beyond capacity


def test_priority_is_capped_per_key() -> None:
    adm = Admission(max_pending=10, retry_after_s=1)
    adm.check_priority(tenant(), 0)
    adm.check_priority(tenant(), -(2**31))
    assert status(adm.check_priority, tenant(), 1)[:2] == (400, "priority_not_allowed")
    adm.check_priority(tenant(max_priority=10**6), 10**6)


def run(coro):
    return asyncio.run(coro)


def test_the_tokenizer_pools_queue_is_bounded_and_a_full_queue_is_a_429() -> None:
    async def scenario() -> None:
        pool = TokenizerPool(tokenizer="tok", workers=2, queue_limit=2, retry_after_s=2)
        gate = threading.Event()
        started = threading.Semaphore(0)

        def blocked(tok: str, x: int) -> int:
            started.release()
            gate.wait(10)
            return x

        running = [asyncio.ensure_future(pool.run(t, blocked, i)) for i, t in enumerate(["a", "b"])]
        await asyncio.to_thread(started.acquire)
        await asyncio.to_thread(started.acquire)
        queued = [asyncio.ensure_future(pool.run("c", blocked, 10 + i)) for i in range(2)]
        await asyncio.sleep(0)
        assert (pool.busy, pool.queued) == (2, 2)
        with pytest.raises(APIError) as err:
            await pool.run("d", blocked, 99)
        assert err.value.status == 429 and err.value.code == "tokenizer_queue_full"
        assert err.value.headers == {"Retry-After": "2"}
        gate.set()
        assert await asyncio.gather(*running, *queued) == [0, 1, 10, 11]
        assert (pool.busy, pool.queued) == (0, 0)
        pool.shutdown()

    run(scenario())


def test_one_key_holds_at_most_all_threads_but_one_and_waiting_keys_take_turns() -> None:
    async def scenario() -> None:
        pool = TokenizerPool(tokenizer="tok", workers=2, queue_limit=10, retry_after_s=1)
        gates = {name: threading.Event() for name in ("a1", "a2", "b1", "c1")}
        order: list[str] = []

        def job(tok: str, name: str) -> str:
            order.append(name)
            assert gates[name].wait(10)
            return name

        a1 = asyncio.ensure_future(pool.run("a", job, "a1"))
        a2 = asyncio.ensure_future(pool.run("a", job, "a2"))  # waits although a thread is free: a's share is 1
        await asyncio.sleep(0.05)
        assert order == ["a1"] and (pool.busy, pool.queued) == (1, 1)
        b1 = asyncio.ensure_future(pool.run("b", job, "b1"))  # another key gets the free thread at once
        await asyncio.sleep(0.05)
        assert order == ["a1", "b1"]
        c1 = asyncio.ensure_future(pool.run("c", job, "c1"))  # queued behind a2, on its own turn
        await asyncio.sleep(0.05)
        gates["b1"].set()
        await b1
        await asyncio.sleep(0.05)
        assert order[2] == "c1"  # the freed thread goes to c: a, though it waited first, already holds its share
        for g in gates.values():
            g.set()
        assert await asyncio.gather(a1, a2, c1) == ["a1", "a2", "c1"]
        pool.shutdown()

    run(scenario())


def test_a_waiter_cancelled_in_the_queue_frees_its_place() -> None:
    async def scenario() -> None:
        pool = TokenizerPool(tokenizer="tok", workers=1, queue_limit=1, retry_after_s=1)
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run("a", lambda tok: gate.wait(10)))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(pool.run("b", lambda tok: "b"))
        await asyncio.sleep(0)
        assert pool.queued == 1
        waiting.cancel()
        await asyncio.sleep(0)
        assert pool.queued == 0
        gate.set()
        await first
        assert await pool.run("b", lambda tok: "again") == "again"
        pool.shutdown()

    run(scenario())


def test_the_length_bound_is_sound_for_byte_level_bpe(tiny_models) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    chars = max_chars_per_token(tok)
    assert chars is not None and chars >= 1
    for text in ("hello world " * 50, "ñandú 日本語 🎉" * 20, "x" * 500, " " * 300):
        assert len(tok.encode(text, add_special_tokens=False)) * chars >= len(text)


def test_keys_map_to_tenants_with_their_limits(tmp_path, monkeypatch) -> None:
    (tmp_path / "vip").write_text("sk-vip\n")
    (tmp_path / "bulk").write_text("sk-1, sk-2\nsk-3\n")  # commas or lines (a Kubernetes Secret mounted as a file)
    for name in ("vip", "bulk"):
        (tmp_path / name).chmod(0o600)
    monkeypatch.setenv("TEAM_KEY", "sk-team")
    cfg = AuthConfig(api_keys_file=str(tmp_path / "bulk"), limits=KeyLimits(max_concurrent=8),
                     keys=({"name": "vip", "key_file": str(tmp_path / "vip"), "max_priority": 5},
                           {"name": "team", "key_env": "TEAM_KEY", "tokens_per_minute": 1000}))
    keys = KeySet.load(cfg)
    vip, team, bulk = (keys.match(f"Bearer {k}") for k in ("sk-vip", "sk-team", "sk-2"))
    assert (vip.name, vip.limits.max_priority) == ("vip", 5)
    assert (team.name, team.limits.tokens_per_minute) == ("team", 1000)
    assert bulk.name.startswith("key-") and "sk-2" not in bulk.name and bulk.limits.max_concurrent == 8
    assert keys.match("Bearer sk-4") is None and keys.match("sk-vip") is None
    with pytest.raises(ValueError, match="exactly one"):
        AuthConfig(keys=({"name": "x"},))
