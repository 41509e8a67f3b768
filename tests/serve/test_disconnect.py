"""A storm of concurrent streams over HTTP and gRPC with random client cuts leaves nothing behind (issue 12).

Clients leave at every point: while the request is being routed, right after the response headers, mid-stream,
and right after the last token (before `[DONE]`). Afterwards the router holds nothing running, its pending count
is 0, every KV block is free, and every stream that was not cut ended with a finish reason (and `[DONE]`).
The wait is shorter than the router's grace for requests that never reached their instance
(`router.orphan_grace_s`, 30 s), so a release the API loses between routing and sending fails this test.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import grpc
import httpx

from deploy.rpc import codegen

codegen.ensure()

from deploy.rpc import specfleet_pb2 as pb  # noqa: E402
from deploy.rpc import specfleet_pb2_grpc as pb_grpc  # noqa: E402
from tests.serve.conftest import ADMIN_KEY, API_KEY, MAX_PENDING, MODEL, ServedApp  # noqa: E402
from tests.serve.test_http import kv_blocks_used  # noqa: E402

HTTP_CUTS = ("early", "headers", "mid", "last", "none")
GRPC_CUTS = ("early", "mid", "none")
MAX_TOKENS = 48


@dataclass
class Outcome:
    transport: str
    cut: str
    finish_reason: str | None = None
    done: bool = False  # HTTP: the stream ended with `data: [DONE]`
    tokens: int = 0
    busy: int = 0  # 429 / RESOURCE_EXHAUSTED answers retried


async def http_stream(app: ServedApp, client: httpx.AsyncClient, cut: str, rng: random.Random) -> Outcome:
    out = Outcome("http", cut)
    body = {"model": MODEL, "prompt": f"storm {rng.random()}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = rng.choice([1, 2, 4])

    async def run() -> None:
        while True:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    out.busy += 1
                    await asyncio.sleep(1.0)
                    continue
                assert r.status_code == 200, await r.aread()
                if cut == "headers":
                    return
                seen = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        out.done = True
                        continue
                    event = json.loads(payload)
                    seen += 1
                    if event["choices"]:
                        out.finish_reason = event["choices"][0]["finish_reason"] or out.finish_reason
                    if event.get("usage"):
                        out.tokens = event["usage"]["completion_tokens"]
                    if cut == "mid" and seen == chunks or cut == "last" and out.finish_reason:
                        return
                return

    if cut == "early":  # the client goes away while the request is parsed, routed or about to start
        task = asyncio.ensure_future(run())
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        await run()
    return out


async def grpc_stream(stub, cut: str, rng: random.Random) -> Outcome:
    out = Outcome("grpc", cut)
    request = pb.GenerateRequest(model=MODEL, prompt=f"storm {rng.random()}", max_tokens=MAX_TOKENS, temperature=0,
                                 ignore_eos=True)
    chunks = rng.choice([1, 2, 4])
    while True:
        call = stub.GenerateStream(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=300)
        try:
            if cut == "early":
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                return out
            seen = 0
            async for chunk in call:
                seen += 1
                out.tokens += len(chunk.token_ids)
                out.finish_reason = chunk.finish_reason or out.finish_reason
                if cut == "mid" and seen == chunks:
                    return out
            return out
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            out.busy += 1
            await asyncio.sleep(1.0)
        finally:
            call.cancel()


async def storm(app: ServedApp, n_http: int, n_grpc: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(MAX_PENDING // 2)  # below the pending limit, with room for releases on their way
    plan = [("http", rng.choice(HTTP_CUTS)) for _ in range(n_http)] + [("grpc", rng.choice(GRPC_CUTS))
                                                                       for _ in range(n_grpc)]
    rng.shuffle(plan)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=app.url, headers=headers, timeout=300) as client, \
            grpc.aio.insecure_channel(app.grpc_target) as channel:
        stub = pb_grpc.SpecfleetStub(channel)

        async def one(transport: str, cut: str, r: random.Random) -> Outcome:
            async with gate:
                if transport == "http":
                    return await http_stream(app, client, cut, r)
                return await grpc_stream(stub, cut, r)

        return await asyncio.gather(*(one(t, c, random.Random(rng.random())) for t, c in plan))


def test_a_storm_of_streams_with_random_client_cuts_leaves_nothing_behind(served_app: ServedApp) -> None:
    began = time.time()
    outcomes = asyncio.run(storm(served_app, n_http=36, n_grpc=12, seed=12))
    assert {o.cut for o in outcomes if o.transport == "http"} == set(HTTP_CUTS)
    for o in outcomes:
        if o.cut == "none":  # every uncut stream ended properly
            assert o.finish_reason == "length" and o.tokens == MAX_TOKENS, o
            assert o.done or o.transport == "grpc", o
    deadline = time.monotonic() + 20  # below router.orphan_grace_s (see the module's docstring)
    with httpx.Client(base_url=served_app.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as c:
        while True:
            running = c.get("/admin/requests", params={"status": "running"}).json()["requests"]
            instances = c.get("/admin/instances").json()["instances"]
            pending = sum(i["in_flight"] for i in instances)
            held = [(i["stats"]["running"], i["stats"]["waiting"]) for i in instances]
            if not running and pending == 0 and held == [(0, 0), (0, 0)] and kv_blocks_used(served_app) == [0, 0]:
                break
            assert time.monotonic() < deadline, (running, instances)
            time.sleep(0.2)
        # a client that leaves is an abort, never a failure (a cancelled call once read as an instance failure)
        rows = [r for r in c.get("/admin/requests").json()["requests"] if r["created_at"] >= began]
        assert rows and {r["status"] for r in rows} <= {"finished", "aborted"}, [r for r in rows
                                                                                if r["status"] == "failed"]
    # and the app still serves: a fresh stream completes
    with httpx.Client(base_url=served_app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "after the storm", "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
