"""What the fault benchmark and the fault tests share: hosts, the app served on them, a streaming load, the checks.

    hosts = Hosts(root)                 # head here + 3 workers, each in a network namespace (or on loopback)
    hosts.start()                       # cluster up, this process its driver, Serve started
    app = hosts.deploy(app_config(target, draft, instances=2))
    run = await app.load(prompts, tokens, fault=some_fault, context=ctx)   # streams; the fault lands mid-stream
    hosts.close()

Hosts (deploy/infra/netns.py): the head runs in this process's namespace at the fabric's bridge address, each
worker in a namespace of its own, so Ray, gloo and the KV links cross a veth and a bridge that a fault can cut or
degrade. Where namespaces cannot be made (no root, no iproute2), every node runs on loopback and `note` says so in
one line; a cut link is then a frozen node (SIGSTOP), and a degraded link cannot be made.

The API's and the instance deployments' replicas are kept on the head (as the Serve proxies are, proxy_location
HeadOnly), so a fault on a worker hits instances and shards, never the streams' API end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray

from cluster.config import SpecfleetConfig, parse_config
from cluster.router import INSTANCE_ACTOR_PREFIX, NAMESPACE, ROUTER_NAME
from deploy.infra import local_cluster, netns, ray_node
from placement.inventory import Inventory, NodeSpec

WORKERS = Inventory(nodes=[NodeSpec(name=f"w{i}", accelerator="l4-24g", count=1, memory_gb=24, speed=1.0)
                           for i in range(3)])
API_KEY, ADMIN_KEY = "sk-faults-api", "sk-faults-admin"
MODEL = "tiny-llama"
HOLD_S = 120.0  # the longest a held load keeps its instances paused (App.load), should nothing resume them
RESUME_TIMEOUT_S = 10.0
HEAD_ONLY = {"node:__internal_head__": 0.001}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(target: Path, draft: Path | None, *, instances: int, stages: int = 1, wait_s: float = 60.0,
               engine: dict | None = None) -> SpecfleetConfig:
    """The model pair (k = 3, fp32; `engine` overrides parts of the engine config) over `instances` instances of
    `stages` pipeline stages each, polled often."""
    model = {"target": str(target), "name": MODEL, **({"draft": str(draft)} if draft is not None else {})}
    return parse_config({
        "engine": {"model": model, "speculation": {"policy": "fixed", "k": 3}, "scheduler": {"max_batch_size": 8},
                   "cache": {"block_size": 16, "num_blocks": 512}, **(engine or {})},
        "fleet": {"instances": instances, "pipeline_stages": stages, "instance_num_cpus": 0.5},
        "router": {"stats_interval_s": 0.2, "failover": {"wait_s": wait_s}},
        "serve": {"max_pending_requests": 64, "auth": {"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]}},
    })


class Hosts:
    """A Ray cluster of a head and `workers`, each worker a host of its own, and this process its driver."""

    def __init__(self, root: Path, workers: Inventory = WORKERS, use_netns: bool = True) -> None:
        self.root, self.workers = root, workers
        self.state_path = root / "cluster.json"
        why = netns.probe() if use_netns else "namespaces not asked for"
        self.fabric: netns.Fabric | None = None
        self.why_not = why
        self.state: local_cluster.ClusterState | None = None
        self.frozen: set[int] = set()
        self.http_port = free_port()  # Serve's proxy: every app deployed here answers on it

    @property
    def note(self) -> str:
        if self.fabric is not None:
            return (f"fault hosts: {len(self.workers.nodes)} workers in network namespaces of their own on "
                    f"{self.fabric.network} (the head at {self.fabric.host_ip})")
        return f"fault hosts: no network namespaces here ({self.why_not}): the faults run on the loopback cluster"

    def start(self) -> None:
        if self.why_not is None:
            try:
                self.fabric = netns.Fabric.create(len(self.workers.nodes))
            except netns.FabricError as e:
                self.why_not = str(e)
        self.state = netns.up(self.workers, self.state_path, self.fabric, num_cpus=2, timeout_s=180.0)
        for key, value in local_cluster.client_env(self.state).items():  # its auth (none: a private fabric)
            os.environ[key] = value
        ray_node.reload_auth()
        ray.init(address=self.state.address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        from ray import serve

        serve.start(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": self.http_port})

    def close(self) -> None:
        from ray import serve

        try:
            for i in sorted(self.frozen):
                self.restore(i)
            serve.shutdown()
        finally:
            ray.shutdown()
            if self.state_path.exists():
                local_cluster.down(self.state_path)
            if self.fabric is not None:
                self.fabric.remove()

    # ---- the app ---------------------------------------------------------------------------------------------
    def deploy(self, cfg: SpecfleetConfig, target: Path, timeout_s: float = 300.0, start_delay_s: float = 0.0
               ) -> "App":
        """Deploy `cfg`'s app; `start_delay_s`: every instance start (the first and each replacement) made that much
        slower on purpose."""
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        from actors.serving.server import START_DELAY_ENV
        from deploy.serve.app import APP_NAME, compose

        # the API's and the instances' replicas on the head: a worker's fault hits engines, not the streams' API end
        env = {START_DELAY_ENV: str(start_delay_s)} if start_delay_s > 0 else None
        serve.run(compose(cfg, replica_resources=HEAD_ONLY, instance_env=env), name=APP_NAME, route_prefix="/",
                  blocking=False)
        deadline = time.monotonic() + timeout_s
        while (status := serve.status().applications.get(APP_NAME)) is None or \
                status.status != ApplicationStatus.RUNNING:
            if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
                raise RuntimeError(f"the fault app failed to deploy: {status.message}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fault app is not running after {timeout_s:.0f} s")
            time.sleep(0.5)
        served = App(self, cfg, f"http://127.0.0.1:{self.http_port}", target)
        served.wait_instances(cfg.fleet.instances, timeout_s)
        return served

    def delete_app(self) -> None:
        from ray import serve

        from deploy.app import APP_NAME

        serve.delete(APP_NAME)

    # ---- faults on a worker -----------------------------------------------------------------------------------
    def kill_node(self, i: int) -> None:
        netns.kill_node(local_cluster.read_state(self.state_path), i)

    def restart_node(self, i: int, readdress: bool = False) -> None:
        """Start worker i again; with `readdress` at another address (a replacement pod's new IP)."""
        netns.restart_node(self.state_path, i, self.fabric, readdress=readdress, num_cpus=2)

    def node_alive(self, i: int) -> bool:
        state = local_cluster.read_state(self.state_path)
        node = state.nodes[i + 1]
        return local_cluster._is_running(node.pid, node.create_time)

    def cut(self, i: int) -> None:
        """Worker i's link down (on loopback: the node frozen, which looks the same from outside)."""
        if self.fabric is not None:
            self.fabric.cut(i)
        else:
            self._signal(i, signal.SIGSTOP)
        self.frozen.add(i)

    def restore(self, i: int) -> None:
        if self.fabric is not None:
            self.fabric.restore(i)
        else:
            self._signal(i, signal.SIGCONT)
        self.frozen.discard(i)

    def degrade(self, i: int) -> str:
        """Worker i's link slow and lossy; what was applied. Not possible on loopback (no link of its own)."""
        if self.fabric is None:
            raise NotImplementedError("a degraded link needs a network namespace per node")
        return self.fabric.degrade(i)

    def heal(self, i: int) -> None:
        if self.fabric is not None:
            self.fabric.heal(i)

    def _signal(self, i: int, sig: int) -> None:
        state = local_cluster.read_state(self.state_path)
        for proc in local_cluster.node_processes(state, state.nodes[i + 1]):
            proc.send_signal(sig)


# ---- the served app under load --------------------------------------------------------------------------------
@dataclass
class Streamed:
    """One client's stream: its text, finish, error (an error event or a non-200 answer), and chunk arrival times."""

    prompt_tokens: int = 0
    request_id: str | None = None  # the router's id for it (its chunks' "id")
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@dataclass
class LoadRun:
    streams: list[Streamed]
    fault_at: float | None  # when the fault landed (time.monotonic)
    served_again_s: float | None  # from the fault to the first new request answered in full


class App:
    """The app served on the hosts: streams, admin reads, and the router and instance actors behind it."""

    def __init__(self, hosts: Hosts, cfg: SpecfleetConfig, url: str, target: Path) -> None:
        self.hosts, self.cfg, self.url, self.target = hosts, cfg, url, target

    def client(self, key: str = API_KEY, timeout: float = 300.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    # ---- admin reads (HTTP) and actors (Ray) --------------------------------------------------------------
    def instances(self) -> list[dict]:
        r = httpx.get(f"{self.url}/admin/instances", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        r.raise_for_status()
        return r.json()["instances"]

    def wait_instances(self, n: int, timeout_s: float = 120.0) -> list[dict]:
        """Until `n` instances accept requests (a replaced one is back); their rows."""
        rows = self._wait_rows(lambda rows: sum(r["accepting"] for r in rows) >= n,
                               f"{n} instances were not up", timeout_s)
        return [r for r in rows if r["accepting"]]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until the router sees every instance idle: nothing in flight, and its last stats poll found no request
        and no KV block in use (a load started earlier, the router's least-load dispatch reads figures of the last
        one and sends the new streams away from an instance that only looks busy)."""
        self._wait_rows(lambda rows: all(r["in_flight"] == 0 and r["stats"] is not None
                                         and r["stats"]["running"] == r["stats"]["waiting"] == 0
                                         and r["stats"]["kv_blocks_used"] == 0 for r in rows),
                        "the fleet was not idle", timeout_s)

    def _wait_rows(self, ok: Callable[[list[dict]], bool], what: str, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                rows = self.instances()
                if ok(rows):
                    return rows
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout_s:.0f} s")
            time.sleep(0.3)

    def incarnation(self, instance_id: str) -> str:
        return next(r["incarnation"] for r in self.instances() if r["instance_id"] == instance_id)

    def wait_replaced(self, instance_id: str, was: str, timeout_s: float = 300.0) -> dict:
        """Until another incarnation of the instance than `was` accepts requests; its row."""
        return self._wait_row(lambda r: r["instance_id"] == instance_id and r["accepting"] and r["incarnation"] != was,
                              f"{instance_id} was not replaced", timeout_s)

    def _wait_row(self, ok: Callable[[dict], bool], what: str, timeout_s: float) -> dict:
        rows = self._wait_rows(lambda rows: any(ok(r) for r in rows), what, timeout_s)
        return next(r for r in rows if ok(r))

    def wait_placed(self, instance_id: str, away_from: int, timeout_s: float = 300.0) -> dict:
        """Until the instance serves again with none of its stages on worker `away_from` (it was planned again
        elsewhere); its row."""
        return self._wait_row(lambda r: r["instance_id"] == instance_id and r["accepting"]
                              and f"w{away_from}" not in {s["node"] for s in r["place"]["stages"]},
                              f"{instance_id} was not planned away from w{away_from}", timeout_s)

    def worker_of(self, instance_id: str, stage: int = 0) -> int:
        """Which worker (index) runs stage `stage` of an instance, as its place says."""
        row = next(r for r in self.instances() if r["instance_id"] == instance_id)
        return int(row["place"]["stages"][stage]["node"].removeprefix("w"))

    @staticmethod
    def router():
        return ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)

    @staticmethod
    def actor(prefix: str, suffix: str = ""):
        """The live named actor whose name starts with `prefix` (and ends with `suffix`), over all namespaces."""
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(prefix) and a["name"].endswith(suffix):
                try:
                    return ray.get_actor(a["name"], namespace=a["namespace"])
                except ValueError:  # it died since the listing
                    continue
        raise LookupError(f"no actor named {prefix}...{suffix}")

    def instance_actor(self, instance_id: str):
        return self.actor(f"{INSTANCE_ACTOR_PREFIX}{instance_id}/")

    # ---- load --------------------------------------------------------------------------------------------
    async def stream(self, client: httpx.AsyncClient, prompt: list[int], tokens: int, out: Streamed,
                     min_chunks: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    out.request_id = event.get("id", out.request_id)
                    if "error" in event:
                        out.error = event["error"]["message"]
                        continue
                    choice = event["choices"][0]
                    if choice["text"]:
                        out.text += choice["text"]
                        out.chunks += 1
                        out.arrivals.append(time.monotonic())
                        if out.chunks >= min_chunks:
                            out.started.set()
                    if choice["finish_reason"]:
                        out.finish = choice["finish_reason"]
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.started.set()  # a stream that ended early must not hold the fault back

    async def load(self, prompts: list[list[int]], tokens: int,
                   fault: Callable[[asyncio.Event, list[Streamed]], Awaitable[None]] | None = None,
                   min_chunks: int = 8, hold: bool = False) -> LoadRun:
        """Stream every prompt at once; once every stream has `min_chunks` chunks, run `fault(hit, streams)` (it sets
        `hit` when the fault lands, then may heal it), and from `hit` on probe with small new requests until one is
        answered in full. Returns when every stream and the fault are done.

        `hold`: every instance pauses between two steps before the fault and resumes once it landed, so that no
        stream can end in between (tests: a fault then always strikes streams mid-stream); the pause shows in the
        streams' gaps, so a benchmark of latencies leaves it off."""
        await asyncio.to_thread(self.wait_idle)  # or stale figures of the last load may send every stream one way
        async with self.client() as client:
            streams = [Streamed(len(p)) for p in prompts]
            tasks = [asyncio.create_task(self.stream(client, p, tokens, s, min_chunks))
                     for p, s in zip(prompts, streams)]
            fault_at = served_again = None
            if fault is not None:
                await asyncio.gather(*(s.started.wait() for s in streams))
                held = await self.pause_all() if hold else []
                hit = asyncio.Event()
                faulting = asyncio.create_task(fault(hit, streams))
                await asyncio.wait([faulting, asyncio.create_task(hit.wait())], return_when=asyncio.FIRST_COMPLETED)
                if faulting.done():
                    faulting.result()  # a fault that failed before landing
                fault_at = time.monotonic()
                await self.resume_all(held)
                served_again = await self.served_again(client, prompts[0], fault_at)
                await faulting
            await asyncio.gather(*tasks)
        return LoadRun(streams, fault_at, served_again)

    async def pause_all(self, seconds: float = HOLD_S) -> list[str]:
        """Pause every instance between two steps (for at most `seconds`); the ids paused."""
        ids = [r["instance_id"] for r in await asyncio.to_thread(self.instances)]
        await asyncio.gather(*(self.instance_actor(i).pause.remote(seconds) for i in ids))
        return ids

    async def resume_all(self, ids: list[str]) -> None:
        """Resume the paused instances the fault left reachable. One the fault killed or cut off answers with an
        error or not at all (its own pause deadline ends it if it comes back); that is reported, not raised."""
        async def resume(instance_id: str) -> None:
            try:
                await asyncio.wait_for(self.instance_actor(instance_id).resume.remote(), RESUME_TIMEOUT_S)
            except (ray.exceptions.RayError, LookupError, TimeoutError) as e:
                print(f"{instance_id} not resumed (the fault's victim): {type(e).__name__}")
        await asyncio.gather(*(resume(i) for i in ids))

    async def served_again(self, client: httpx.AsyncClient, prompt: list[int], since: float,
                           timeout_s: float = 180.0) -> float | None:
        """Seconds from `since` until a new small request is answered in full (200, not an error); None if never."""
        while time.monotonic() - since < timeout_s:
            try:
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                               "temperature": 0})
                if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"):
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
        return None

    # ---- afterwards ----------------------------------------------------------------------------------------
    def leaks(self, timeout_s: float = 60.0) -> tuple[int, int, int]:
        """(requests the router still has running, its pending count, KV blocks in use over every instance) once
        they reach zero, or as they stand after `timeout_s` (releases and stats polls take a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = httpx.get(f"{self.url}/admin/requests", params={"status": "running"},
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60).json()["requests"]
            pending = ray.get(self.router().pending.remote(), timeout=60)
            blocks = sum(sum(ray.get(self.instance_actor(r["instance_id"]).kv_blocks_used.remote(), timeout=60))
                         for r in self.instances())
            if (len(running), pending, blocks) == (0, 0, 0) or time.monotonic() > deadline:
                return len(running), pending, blocks
            time.sleep(0.3)
