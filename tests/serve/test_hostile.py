"""One API key floods the app while another sends ordinary requests: the ordinary ones all complete, and their p99
time to first token stays within 2x of its unloaded value, both measured in this test's own run (a ratio).

The hostile key (tests/serve/conftest.py: max_concurrent 4, tokens_per_minute 600, max_priority 0) sends from a
process of its own, on many threads at once and over and over: ~1 MB prompts, chat requests with `n: 16`, no
max_tokens and `ignore_eos` (16 full-context sequences), the top priority, prompts of thousands of tokens,
back-to-back generations, full-context streams it never reads, and bodies sent a byte at a time on SLOW_BODIES
connections (each holds one of the key's slots until the body timeout's 408); a refused request is sent again
after RETRY_S. The ordinary key sends one streamed completion at a time. Unloaded and flooded phases alternate
over several rounds, so that other load on the machine weighs on both alike.

Two runs of it: the shorter, in the default suite (`test_a_keys_slow_bodies_and_floods_...`: FAST_REQUESTS ordinary
requests a phase in FAST_ROUNDS rounds, two tokens each, slow bodies in the flood: under a minute on this 2-core
machine; it checks the refusals and reports the ratio, a wall-time figure a loaded machine moves); the longer one
(`-m slow`: ROUNDS rounds, eight tokens each, the 2x ratio asserted) is the measurement docs/benchmarks.md
quotes ("Hostile tenant"), from `pytest -m slow -s tests/serve/test_hostile.py` (the printed line;
SPECFLEET_HOSTILE_REPORT=FILE also writes it as JSON).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from tests.serve.conftest import API_KEY, LIMITED_KEYS, MODEL, ServedApp
from tests.unit.helpers import load, text_prompts

ORDINARY_REQUESTS = 100  # per phase, in ROUNDS parts: the 99th percentile is the second-worst, not the worst
ROUNDS = 5
# the default suite's run: every kind of the flood in each flooded phase, no ratio asserted (so no p99 of 200 to wait for)
FAST_REQUESTS, FAST_ROUNDS = 40, 2
MAX_RATIO = 2.0
# a refused hostile request is sent again after this long (Retry-After says 1 s). Without any pause the hostile
# threads spend the machine's 2 cores on having requests refused (docs/benchmarks.md gives that figure too)
RETRY_S = float(os.environ.get("SPECFLEET_HOSTILE_RETRY_S", "0.25"))
SLOW_BODIES, SLOW_BODY_BYTE_S = 16, 0.25  # connections the hostile key keeps sending bodies on, a byte at a time


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def ordinary_ttfts(app: ServedApp, prompts: list[list[int]], max_tokens: int = 8) -> list[float]:
    """One streamed completion at a time; each must finish. Returns each one's time to its first token."""
    out = []
    with app.client(API_KEY) as c:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            first, finish, done = None, None, False
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        if choice["text"] and first is None:
                            first = time.perf_counter() - t0
                        finish = choice["finish_reason"] or finish
            assert done and finish in ("stop", "length") and first is not None
            out.append(first)
    return out


class Flood:
    """The hostile key's traffic, from a process of its own (so that its client work does not slow the ordinary
    client's measurements here), on threads until `stop`; every reply's status is counted there."""

    def __init__(self, app: ServedApp, kinds: tuple[str, ...] = ()) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.ready = ctx.Event()
        self.results = ctx.Queue()
        self.process = ctx.Process(target=_flood, args=(app.url, LIMITED_KEYS["hostile"][0], self.stop, self.ready,
                                                         self.results, kinds), daemon=True)
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []

    def __enter__(self) -> "Flood":
        self.process.start()
        assert self.ready.wait(120), "the flood did not get under way"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.statuses, self.errors = self.results.get(timeout=180)
        self.process.join(timeout=60)


def _flood(url: str, key: str, stop, ready, results, kinds: tuple[str, ...]) -> None:  # noqa: ANN001
    """Run in the flood's process: every sender (of `kinds`; all if empty) on its own thread until `stop`; put
    (statuses, errors). The process runs at the lowest CPU priority: on this one machine the hostile client's own
    work (building megabyte bodies, say) would otherwise take CPU from the server, as a client elsewhere could not."""
    os.nice(19)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    statuses: Counter = Counter()
    errors: list[str] = []
    lock = threading.Lock()

    answered: Counter = Counter()  # replies per kind of sender

    def count(status: int, kind: str) -> None:  # noqa: E306
        with lock:
            statuses[status] += 1
            answered[kind, status] += 1

    def post(c: httpx.Client, route: str, body: dict) -> int | None:
        return c.post(route, json=body).status_code

    def unread_stream(c: httpx.Client) -> int:
        """Two full-context choices streamed to a client that reads nothing until the flood ends (slow reads)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "ignore_eos": True,
                "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 200:
                stop.wait()
            else:
                r.read()
            return r.status_code

    def slow_body(c: httpx.Client) -> int | None:
        """A body sent one byte every SLOW_BODY_BYTE_S, never finished: read until the body timeout (408), or refused
        at once (429); None if the flood ended first."""
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                + key.encode() + b"\r\nContent-Length: 65536\r\n\r\n{")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(head)
            while not select.select([sock], [], [], SLOW_BODY_BYTE_S)[0]:
                if stop.is_set():
                    return None
                sock.sendall(b" ")  # JSON whitespace, a byte at a time
            reply = sock.recv(65536)
        return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0

    chat = lambda **kw: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}  # noqa: E731
    huge = "a hostile prompt " * 60_000  # ~1 MB, the body limit's size
    every: dict[str, Callable[[httpx.Client], int | None]] = {
        "huge": lambda c: post(c, "/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 4}),
        "n16": lambda c: post(c, "/v1/chat/completions", chat(n=16, ignore_eos=True)),
        "top_priority": lambda c: post(c, "/v1/chat/completions", chat(priority=2**31 - 1, max_tokens=64)),
        "long": lambda c: post(c, "/v1/completions", {"model": MODEL, "prompt": "x " * 4000, "max_tokens": 64}),
        "busy": lambda c: post(c, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 64,
                                                      "ignore_eos": True}),
        "unread": unread_stream, "slow_body": slow_body,
    }
    copies = {"unread": 2, "slow_body": SLOW_BODIES}  # threads of a kind (one where not named)
    senders = [(name, send) for name, send in every.items() if not kinds or name in kinds
               for _ in range(copies.get(name, 1))]

    def loop(kind: str, send: Callable[[httpx.Client], int | None]) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    status = send(c)
                except httpx.HTTPError as e:  # a transport failure is a finding too: reported and asserted on
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    stop.wait(0.1)
                    continue
                if status is None:
                    continue
                count(status, kind)
                if status != 200:
                    stop.wait(RETRY_S)

    threads = [threading.Thread(target=loop, args=s, daemon=True) for s in senders]
    for t in threads:
        t.start()

    def under_way() -> bool:
        """Every kind answered (an unread stream let in answers only at the end), a few times in all, and a slow
        body held one of the key's slots until the body timeout (408): the whole flood weighs on the phase, on a
        fast machine as on a slow one."""
        with lock:
            kinds_answered = {kind for kind, _ in answered}
            held = not any(name == "slow_body" for name, _ in senders) or answered["slow_body", 408] > 0
        return (kinds_answered >= {name for name, _ in senders} - {"unread"} and held
                and sum(statuses.values()) >= 3 * len(senders))

    deadline = time.monotonic() + 60
    while not under_way() and time.monotonic() < deadline:
        time.sleep(0.1)
    ready.set()
    stop.wait()
    for t in threads:
        t.join(timeout=120)
    results.put((dict(statuses), errors))


def hostile_run(app: ServedApp, per_phase: int, rounds: int, kinds: tuple[str, ...] = (), max_tokens: int = 8) -> dict:
    """`rounds` rounds of an unloaded phase then a flooded one (of `kinds`; all if empty), `per_phase` ordinary
    requests per phase in all; asserts what every run must show and returns the report (its p99 ratio)."""
    prompts = text_prompts(load(app.target), per_phase, offset=40)
    ordinary_ttfts(app, prompts[:5])  # warm-up
    unloaded, loaded, statuses, errors = [], [], Counter(), []
    for r in range(rounds):  # unloaded and flooded phases alternate, so that other load weighs on both alike
        part = prompts[r::rounds]
        unloaded += ordinary_ttfts(app, part, max_tokens)
        with Flood(app, kinds) as flood:
            loaded += ordinary_ttfts(app, part, max_tokens)
        statuses.update(flood.statuses)
        errors += flood.errors
    ratio = p99(loaded) / p99(unloaded)
    ms = lambda x: round(1e3 * x, 1)  # noqa: E731
    report = {"ordinary_requests": len(loaded), "unloaded_ttft_p50_ms": ms(sorted(unloaded)[len(unloaded) // 2]),
              "unloaded_ttft_p99_ms": ms(p99(unloaded)), "loaded_ttft_p50_ms": ms(sorted(loaded)[len(loaded) // 2]),
              "loaded_ttft_p99_ms": ms(p99(loaded)), "p99_ratio": round(ratio, 2),
              "hostile_replies": {str(k): v for k, v in sorted(statuses.items())}, "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg()[0]}
    print(f"\nhostile tenant: {json.dumps(report)}")
    if path := os.environ.get("SPECFLEET_HOSTILE_REPORT"):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    assert not errors, errors[:5]
    assert set(statuses) <= {200, 400, 408, 429}, statuses  # refused with clear errors, never a 5xx
    assert statuses.get(429)  # the key met its limits
    if not kinds or "slow_body" in kinds:
        assert statuses.get(408)  # slow bodies were read until the body timeout: they held the key's slots
    return report


def test_a_keys_slow_bodies_and_floods_get_clear_refusals_while_another_key_is_served(served_app: ServedApp) -> None:
    """Every kind of the flood, slow bodies on SLOW_BODIES connections among them, in FAST_ROUNDS rounds of
    FAST_REQUESTS ordinary requests a phase: the hostile key is refused with clear errors (429, 408, 400; never a
    5xx) and every ordinary request is served (`hostile_run`'s checks). The 2x TTFT guarantee itself is a ratio of
    wall times, which a loaded machine moves (3.66x at load average 6.4 on 2 cores, 2026-11-28): it is held by the
    measurement below (`-m slow`, docs/benchmarks.md), not in the default suite (issue 36: no timing assertions)."""
    report = hostile_run(served_app, FAST_REQUESTS, FAST_ROUNDS, max_tokens=2)  # TTFT is what is held
    assert report["ordinary_requests"] == FAST_REQUESTS and report["p99_ratio"] > 0, report


@pytest.mark.slow
def test_a_hostile_key_cannot_slow_another_keys_first_token_beyond_twice(served_app: ServedApp) -> None:
    """The measurement docs/benchmarks.md quotes: more requests and rounds, the p99 the second-worst of 100."""
    report = hostile_run(served_app, ORDINARY_REQUESTS, ROUNDS)
    assert report["hostile_replies"].get("400")  # the huge prompts' refusals
    assert report["p99_ratio"] <= MAX_RATIO, report
