"""`specfleet bench faults`: each fault the fleet must survive, injected under a steady streaming load; a row per fault.

    specfleet bench faults                      # SmolLM2-135M, n-gram drafts; needs root for network namespaces
    specfleet bench faults --faults router_killed,node_killed --streams 4 --max-tokens 256

The hosts (deploy/bench/fault_kit.py): a head and three workers, each worker in a network namespace of its own
(loopback where that cannot be done: said in one line). The apps are served in turn: "one" (a single instance of
two pipeline stages on two workers, the third spare), "two" (two single-stage instances) and "default" (`make
serve`'s engine on one single-stage instance). For each fault: an unfaulted run of the same streams first (the
reference outputs and latencies), then the faulted run, where the fault lands once every stream has its first chunks. A row: streams lost (ended in an error, or cut short), outputs that
differ from the unfaulted run (greedy: there must be none), seconds from the fault until a new request is answered,
the p99 gap between two chunks of the surviving streams minus the unfaulted run's, and what is left afterwards
(requests the router still has running, its pending count, KV blocks in use on the instances).

The faults are the ones tests/faults/ asserts on; the same functions inject them there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from cluster.config import MigrationConfig, SpecfleetConfig
from cluster.migration_messages import Length
from deploy.bench.fault_kit import MODEL as MODEL_NAME
from deploy.bench.fault_kit import App, Hosts, LoadRun, Streamed, app_config
from deploy.bench.output import pct

After = Callable[[], Awaitable[None]] | None  # what heals a fault once the streams are done (None: nothing)


@dataclass(frozen=True)
class Landed:
    """What a fault did: a note, what heals it after the streams, and the streams it must catch mid-stream (request
    ids; None: every stream, as a fault on the router or on every instance's path does)."""

    note: str
    after: After = None
    hits: frozenset[str] | None = None


@dataclass(frozen=True)
class Fault:
    """One fault: which app it needs ("one", "two" or "default"), and `inject(app, hit, streams)`, which sets `hit` when the
    fault lands and returns what it did (`streams`: the load's, as they stand)."""

    name: str
    app: str
    what: str
    inject: Callable[[App, asyncio.Event, list[Streamed]], Awaitable[Landed]]
    netns_only: bool = False


async def router_killed(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """The router killed for good (`ray.kill`): a new one is started by whoever finds it dead, and it rebuilds its
    registry and request table from the instances."""
    ray.kill(app.router(), no_restart=True)
    hit.set()
    return Landed("ray.kill, no restart")


async def instance_killed(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """SIGKILL on the instance process that runs the most streams (with one instance: the only one); it aims at the
    streams that instance runs."""
    running = await app.router().requests.remote("running")
    # what each instance still holds, not the router's table alone (it may list a request that just ended there)
    held = {i: await _held(app, i) for i in sorted({r.instance_id for r in running} | {"inst-0"})}
    victim = max(held, key=lambda i: (len(held[i]), i == "inst-0"))
    hits = held[victim]
    was = app.incarnation(victim)
    pid = await app.instance_actor(victim).pid.remote()
    os.kill(pid, signal.SIGKILL)
    hit.set()
    return Landed(f"SIGKILL {victim}", _until_back(app, victim, was), hits)


async def shard_killed(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """One pipeline stage's shard actor of instance 0 killed (`ray.kill`): the instance turns unhealthy, Serve
    replaces it."""
    was = app.incarnation("inst-0")
    ray.kill(app.actor("inst-0/", "/stage-1"), no_restart=True)
    hit.set()
    return Landed("ray.kill inst-0 stage 1", _until_back(app, "inst-0", was))


async def node_killed(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """The worker that runs instance 0's second stage killed whole (raylet and every process on it); the instance
    is planned again on the workers left. Afterwards the node comes back."""
    worker = app.worker_of("inst-0", stage=1)
    app.hosts.kill_node(worker)
    hit.set()

    async def back() -> None:
        await asyncio.to_thread(app.wait_placed, "inst-0", worker)
        app.hosts.restart_node(worker)  # on this thread: the node is this thread's child (it dies with it)
    return Landed(f"killed worker w{worker}", back)


async def link_cut(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """The link of instance 0's worker cut until Ray has given the node up and the router has taken the instance
    out, then restored. The raylet Ray gave up exits; it is started again at a
    new address (a KubeRay pod that replaces another), and the instance's replacement, which has no other room,
    lands on it. It aims at the streams instance 0 runs."""
    victim = "inst-0"  # one stage on one worker; instance 1 holds the other two (its stage and its draft's)
    was = app.incarnation(victim)
    worker = app.worker_of(victim)
    address = node_address(worker)
    hits = await _held(app, victim)
    app.hosts.cut(worker)
    hit.set()
    deadline = time.monotonic() + 120
    while _node_known_alive(app, worker) or any(r["instance_id"] == victim and r["incarnation"] == was
                                                 and r["accepting"] for r in await asyncio.to_thread(app.instances)):
        if time.monotonic() > deadline:
            raise AssertionError(f"w{worker} ({victim}) still counts as up with its link cut")
        await asyncio.sleep(0.2)
    app.hosts.restore(worker)

    async def back() -> None:
        app.hosts.restart_node(worker, True)  # on this thread: the node is this thread's child (it dies with it)
        await _until_back(app, victim, was)()
    return Landed(f"cut w{worker} at {address} ({victim}) until Ray and the router gave it up, then restored", back,
                  hits)


async def link_degraded(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """The link of the worker of the instance that holds the most streams slow and lossy for as long as the
    streams run; it aims at the streams that instance holds."""
    held = {i: await _held(app, i) for i in ("inst-0", "inst-1")}
    victim = max(held, key=lambda i: len(held[i]))
    worker, hits = app.worker_of(victim), held[victim]
    what = app.hosts.degrade(worker)
    hit.set()

    async def heal() -> None:
        app.hosts.heal(worker)
    return Landed(f"w{worker}: {what}", heal, hits)


async def migration_destination_killed(app: App, hit: asyncio.Event, streams: list[Streamed]) -> Landed:
    """The running request furthest from its end migrates to the other instance, and the destination's process is
    killed once a chunk has landed there: mid-copy. The copy goes one token a chunk (up to 64 stages, stopping only
    when nothing is left): a chunk is exported between two of the source's steps and each step adds at least a
    token, so the copy never catches up while the request decodes, and it is mid-copy when looked at whatever the
    destination's prefix cache already held of it (with 16-token chunks, a request whose prompt the destination had
    cached from an earlier failover had 3 tokens left to copy, done between two looks). The request carries on at its
    source; whatever the destination still runs fails over. The fault must catch the migrated request mid-stream;
    the other streams run at their instance's pace (the channel's setup takes a while) and must only end
    unharmed."""
    router = app.router()
    running = await router.requests.remote("running")
    if not running:
        raise AssertionError("no stream runs to migrate")
    prompt = {s.request_id: s.prompt_tokens for s in streams}
    # tokens generated so far, as each request's instance holds it now (the router's table may still list one that
    # just ended there)
    generated = {}
    for r in running:
        length = await app.instance_actor(r.instance_id).migration.remote(Length(r.request_id))
        if length is not None and r.request_id in prompt:
            generated[r.request_id] = (length - prompt[r.request_id], r.instance_id)
    if not generated:
        raise AssertionError(f"no instance holds a request the router lists running: {running}")
    rid = min(generated, key=lambda k: generated[k][0])
    src = generated[rid][1]
    dst = next(r["instance_id"] for r in app.instances() if r["instance_id"] != src)
    was = app.incarnation(dst)
    pid = await app.instance_actor(dst).pid.remote()
    cfg = MigrationConfig(max_stages=64, stop_copy_tokens=0, chunk_tokens=1, transfer="torch", step_timeout_s=30)
    moving = router.migrate.remote(rid, dst, cfg)
    deadline = time.monotonic() + 60
    while True:
        flights = await router.migrations_in_flight.remote()
        if any(p is not None and p.phase == "copying" for _, _, p in flights):
            break
        done, _ = ray.wait([moving], timeout=0)
        if done or time.monotonic() > deadline:
            raise AssertionError(f"the migration of {rid} (generated {generated}) never was mid-copy when looked at: "
                                 f"{ray.get(done) if done else flights}")
        await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    hit.set()
    result = await moving
    return Landed(f"migration {result.status.value} ({result.reason[:80]})", _until_back(app, dst, was),
                  frozenset({rid}))


async def _held(app: App, instance_id: str) -> frozenset[str]:
    """The requests the router lists running on an instance that the instance still holds (the table may list one
    that just ended there): those a fault on that instance must catch mid-stream. The streams elsewhere run at
    their own instance's pace and may end before it lands; they must only end unharmed."""
    running = await app.router().requests.remote("running")
    actor = app.instance_actor(instance_id)
    return frozenset([r.request_id for r in running if r.instance_id == instance_id
                      and await actor.migration.remote(Length(r.request_id)) is not None])


def _until_back(app: App, victim: str, was: str) -> After:
    """Until the fleet is whole again: `victim` replaced (another incarnation accepts requests), every instance up."""
    async def back() -> None:
        await asyncio.to_thread(app.wait_replaced, victim, was)
        await asyncio.to_thread(app.wait_instances, app.cfg.fleet.instances, 240.0)
    return back


def node_address(worker: int) -> str:
    """Where the live node of worker `worker` is reached now."""
    return next(n["NodeManagerAddress"] for n in ray.nodes()
                if n["Alive"] and n["Labels"].get("specfleet/node") == f"w{worker}")


def _node_known_alive(app: App, worker: int) -> bool:
    name = f"w{worker}"
    return any(n["Alive"] and n["Labels"].get("specfleet/node") == name for n in ray.nodes())


FAULTS = [
    Fault("router_killed", "one", "the router actor killed", router_killed),
    Fault("instance_killed_only", "one", "the only instance's process killed", instance_killed),
    Fault("default_instance_killed", "default", "the default app's only instance killed (issue 40's case)",
          instance_killed),
    Fault("shard_killed", "one", "a pipeline stage's shard killed", shard_killed),
    Fault("node_killed", "one", "a worker node killed, back later at a new address", node_killed),
    Fault("instance_killed_of_two", "two", "one of two instances killed", instance_killed),
    Fault("link_cut", "two", "a worker's link cut, then restored", link_cut),
    Fault("link_degraded", "two", "a worker's link slow and lossy", link_degraded, netns_only=True),
    Fault("migration_destination_killed", "two", "a migration's destination killed mid-copy",
          migration_destination_killed),
]
BY_NAME = {f.name: f for f in FAULTS}


@dataclass
class Outcome:
    """One row: a fault's cost."""

    fault: str
    streams: int
    hits: int  # streams the fault must catch mid-stream (every one, or those it aims at: a migrated request)
    in_flight: int  # of those, the ones still running when the fault landed
    lost: int  # ended in an error or cut short
    changed: int  # surviving streams whose output differs from the unfaulted run
    served_again_s: float | None
    p99_gap_added_s: float | None
    leaked_requests: int
    leaked_pending: int
    leaked_blocks: int
    note: str
    failover_wait_s: float | None = None  # the router's failover wait after the fault (cluster/start_times.py)
    slowest_start_s: float | None = None  # the slowest recent start or replacement it was learned from
    last_start: tuple[tuple[str, float], ...] = ()  # the last start's phases (actors/start_phases.py): a replacement's


NGRAM = {"speculation": {"method": "ngram", "policy": "fixed", "k": 3}}


def apps(target: Path, draft: Path | None, engine: dict | None = None, wait_s: float = 60.0,
         gguf: Path | None = None) -> dict[str, SpecfleetConfig]:
    """The apps the faults need: "one", a single instance of two pipeline stages drafting by n-gram lookup (two
    of the three workers, one spare); "two", two single-stage instances with `draft` (without one: `engine`), the
    second of which holds the third worker for its draft model; with `gguf` (the target's GGUF file), "default":
    `make serve`'s engine (deploy/configs/default.yaml: weights as stored, dtype auto) on one single-stage instance.
    A failed instance's streams wait for its replacement as long as the router learned a start takes, at least
    `wait_s` (the floor; the product's default)."""
    shapes = {"one": app_config(target, None, instances=1, stages=2, engine=engine or NGRAM, wait_s=wait_s),
              "two": app_config(target, draft, instances=2, stages=1, engine=engine, wait_s=wait_s)}
    if gguf is not None:
        shapes["default"] = app_config(gguf, None, instances=1, stages=1, engine=default_engine(gguf), wait_s=wait_s)
    return shapes


def default_engine(gguf: Path) -> dict:
    """deploy/configs/default.yaml's engine section, its model read from `gguf`."""
    import yaml

    engine = yaml.safe_load((Path(__file__).parents[1] / "configs" / "default.yaml").read_text())["engine"]
    return {**engine, "model": {**engine["model"], "target": str(gguf), "name": MODEL_NAME}}


async def run_fault(fault: Fault, app: App, prompts: list[list[int]], tokens: int, baseline: LoadRun,
                    hold: bool = False) -> Outcome:
    """The fault under the load of `prompts`; its row, against `baseline` (the same load unfaulted). `hold`: the
    instances pause while it is injected, so it strikes every stream mid-stream (App.load)."""
    landed = Landed("")

    async def inject(hit: asyncio.Event, streams: list[Streamed]) -> None:
        nonlocal landed
        landed = await fault.inject(app, hit, streams)

    run = await app.load(prompts, tokens, fault=inject, hold=hold)
    if landed.after is not None:
        await landed.after()
    running, pending, blocks = await asyncio.to_thread(app.leaks)
    survived = [(s, b) for s, b in zip(run.streams, baseline.streams) if s.error is None and s.finish == "length"]
    gaps = [g for s, _ in survived for g in s.gaps()]
    base = [g for s in baseline.streams for g in s.gaps()]
    p99 = pct(gaps, 99) - pct(base, 99) if gaps and base else None
    hit = [s for s in run.streams if landed.hits is None or s.request_id in landed.hits]
    in_flight = sum(bool(s.arrivals) and s.arrivals[-1] > run.fault_at for s in hit)
    wait = await asyncio.to_thread(lambda: ray.get(app.router().failover_wait.remote(), timeout=30.0))
    return Outcome(fault.name, len(prompts), len(prompts) if landed.hits is None else len(landed.hits), in_flight,
                   len(prompts) - len(survived), sum(s.text != b.text for s, b in survived), run.served_again_s, p99,
                   running, pending, blocks, landed.note, wait.wait_s, wait.slowest_s, tuple(wait.last_start))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="target model (catalog name, GGUF, folder)")
    p.add_argument("--faults", default=",".join(f.name for f in FAULTS),
                   help=f"comma-separated, from: {', '.join(f.name for f in FAULTS)}")
    p.add_argument("--streams", type=int, default=3, help="streams in flight when each fault lands")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens each stream generates")
    p.add_argument("--loopback", action="store_true", help="do not use network namespaces even where possible")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from deploy.bench.prompts import DATASETS, load_prompts
    from deploy.cli.flags import UsageError
    from deploy.model_store import resolve_model
    from actors.model.loader import load_metadata

    names = [n for n in args.faults.split(",") if n]
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        raise UsageError(f"--faults: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    target = Path(resolve_model(args.model, "fp32"))
    tokenizer = load_metadata(str(target), "fp32").tokenizer
    texts = load_prompts([DATASETS / "mt_bench_questions.jsonl"], args.streams)
    prompts = [tokenizer.encode(t)[:64] for t in texts]
    engine = {"speculation": {"method": "ngram", "policy": "goodput", "k": 4}}
    console = Console()
    rows: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="sf-faults-") as tmp:
        hosts = Hosts(Path(tmp), use_netns=not args.loopback)
        hosts.start()
        console.print(hosts.note)
        try:
            for app_name, cfg in apps(target, None, engine, gguf=Path(resolve_model(args.model))).items():
                todo = [BY_NAME[n] for n in names if BY_NAME[n].app == app_name]
                if not todo:
                    continue
                app = hosts.deploy(cfg, target)
                try:
                    for fault in todo:
                        if fault.netns_only and hosts.fabric is None:
                            console.print(f"{fault.name}: skipped: {hosts.note}")
                            continue
                        baseline = asyncio.run(app.load(prompts, args.max_tokens))
                        rows.append(asyncio.run(run_fault(fault, app, prompts, args.max_tokens, baseline)))
                        console.print(f"{fault.name}: {rows[-1]}")
                finally:
                    hosts.delete_app()
        finally:
            hosts.close()
    table = Table(title=f"faults under {args.streams} streams of {args.max_tokens} tokens ({target.name})")
    for col in ("fault", "lost", "changed", "served again (s)", "p99 gap added (s)", "leaked req/pending/blocks",
                "slowest start (s)", "failover wait (s)", "note"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.fault, f"{r.lost}/{r.streams}", str(r.changed), _s(r.served_again_s), _s(r.p99_gap_added_s),
                      f"{r.leaked_requests}/{r.leaked_pending}/{r.leaked_blocks}", _s(r.slowest_start_s),
                      _s(r.failover_wait_s), r.note)
    console.print(table)
    if args.json:
        import json

        args.json.write_text(json.dumps({"hosts": hosts.note, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
