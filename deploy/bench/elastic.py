"""`specfleet bench elastic`: a load that rises and falls, against a fixed fleet of the maximum size, a fixed fleet of
the minimum size, and the autoscaled one (fleet.autoscaling, deploy/serve/autoscaler.py), on the local cluster.

The same Poisson arrivals (rates stepped up, then down: `--rates`, each held `--phase-s`) of real prompts go to each
fleet through the API's own frontend and a router actor, as `bench migration` drives them. For each fleet: p99 time
to first token and inter-token latency against the target, instance-seconds used (instances registered or starting,
integrated over the run), streams lost (not ended at their length: the goal is 0), failovers, and for the autoscaled
fleet every scale step with its reason. Outputs are greedy: every fleet's must be the same, token for token.

Goals (issue 42): the autoscaled fleet meets the TTFT target where the minimum fleet does not, with at most 70% of
the maximum fleet's instance-seconds, and loses no stream in scale-in. On a machine whose instances share a few
cores, more instances add little capacity: read the figures with the load average beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import ray

from actors.serving.server import InstanceServer
from actors.model.loader import load_model
from cluster.autoscale import AutoscaleTarget, AutoscalingConfig
from cluster.config import (CacheConfig, EngineConfig, MigrationConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpeculationConfig)
from cluster.disagg import Role
from cluster.migration_policy import POLICIES
from cluster.router_client import RouterClient
from deploy.bench.local_fleet import Bench, add_cluster_flags, add_model_flags
from deploy.bench.output import pct, save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError, parse_numbers
from deploy.infra import local_cluster
from deploy.model_store import resolve_model
from deploy.serve.autoscaler import Autoscaler, Launched
from deploy.serve.ttft_reporter import TtftReporter
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--min-instances", type=int, default=1)
    p.add_argument("--max-instances", type=int, default=3)
    p.add_argument("--rates", default="0.3,1.5,0.3", help="requests/s of each phase, comma-separated")
    p.add_argument("--phase-s", type=float, default=30.0, help="how long each rate is held")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=4, help="requests one instance runs at once (max_batch_size)")
    p.add_argument("--ttft-target-s", type=float, default=2.0)
    p.add_argument("--queue-target", type=float, default=1.0)
    p.add_argument("--up-after-s", type=float, default=2.0)
    p.add_argument("--down-after-s", type=float, default=5.0)
    p.add_argument("--fleets", default="max,min,autoscaled", help="which fleets to run, comma-separated")
    p.add_argument("--predict", action=argparse.BooleanOptionalAction, default=True,
                   help="the autoscaler's predictive step up (fleet.autoscaling.predict; --no-predict: reactive alone)")
    p.add_argument("--measured-ttft", action=argparse.BooleanOptionalAction, default=True,
                   help="the autoscaler's TTFT is the frontend's measured one, as the served API reports it "
                        "(--no-measured-ttft: predicted from the queue, the fallback)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--migration-policies", default="queue",
                   help="the router's migration policies in every fleet, comma-separated (default queue: a request "
                        "waiting on a busy instance moves to an idle one, such as the one a scale-out just added; "
                        "empty: none)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin each node to a core of its own (node i to core i), as separate hosts: a starting "
                        "instance then takes no CPU from the serving ones")
    add_cluster_flags(p)


class NodeLauncher:
    """Starts the autoscaler's instances as the bench starts its own: the whole model in one actor, nodes in turn."""

    def __init__(self, bench: Bench, nodes: list[str]) -> None:
        self.bench, self.nodes = bench, nodes

    async def launch(self, instance_id: str, index: int, taken: set[tuple[str, int]], role: Role = "both") -> Launched:
        began = time.monotonic()
        b = self.bench
        node = self.nodes[(index + 1) % len(self.nodes)]
        spec = InstanceSpec(instance_id=instance_id, executor="local", num_cpus=b.num_cpus, engine=b.cfg, role=role,
                            layout=ShardLayout(stages=(StageSlot(node=node, layers=(0, b.num_layers)),)))
        taken.update(spec.layout.places)
        server = InstanceServer.spawn(spec)
        info = await asyncio.wait_for(server.info.remote(), 600)
        return Launched(spec, server, info, time.monotonic() - began)


async def drive(b: Bench, prompts: list[list[int]], gaps: list[float], args, autoscaler: Autoscaler | None) -> dict:
    """The load through one fleet; its figures."""
    counted: list[tuple[float, int]] = []  # (time, instances registered or starting)
    stop = asyncio.Event()

    async def count() -> None:
        while not stop.is_set():
            rows = await b.router.instances.remote()
            last = autoscaler.last if autoscaler is not None else None
            starting = last.count if last is not None and last.action == "up" else 0
            counted.append((time.perf_counter(), len(rows) + starting))
            await asyncio.sleep(0.25)

    counter = asyncio.create_task(count())
    scaler = asyncio.create_task(autoscaler.run()) if autoscaler is not None else None
    reporter = None  # the frontend's first tokens to the autoscaler, as an API replica sends them (in process here)
    if autoscaler is not None and args.measured_ttft:
        async def send(report) -> None:
            autoscaler.report_ttft(report)
        reporter = asyncio.create_task(TtftReporter(b.frontend.first_tokens, "bench", send,
                                                    autoscaler.cfg.interval_s).run())
    t0 = time.perf_counter()
    tasks = []
    for p, gap in zip(prompts, gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(b.stream(p, args.max_tokens)))
    done = await asyncio.gather(*tasks, return_exceptions=True)
    end = time.perf_counter()
    if autoscaler is not None:  # the load gone: let it come back down to its floor (this counts too)
        deadline = time.monotonic() + 120
        while autoscaler.size > args.min_instances and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        end = time.perf_counter()
        scaler.cancel()
        if reporter is not None:
            reporter.cancel()
    stop.set()
    await counter
    instance_s = sum(n * (b_t - a_t) for (a_t, n), (b_t, _) in zip(counted, counted[1:]))
    ok = [s for s in done if not isinstance(s, BaseException)]
    ttft = [s.ttft_s for s in ok if s.arrivals]
    itl = [g for s in ok for g in (b2 - a2 for a2, b2 in zip(s.arrivals, s.arrivals[1:]))]
    migrations = await b.router.migration_stats.remote()
    row = {"requests": len(done), "lost": len(done) - sum(s.finish == "length" for s in ok),
           "ttft_s_p50": pct(ttft, 50), "ttft_s_p90": pct(ttft, 90), "ttft_s_p99": pct(ttft, 99),
           # SLO attainment (DistServe, Zhong et al., OSDI 2024): the share of requests whose first token came within
           # the target; a scale-out's start shows here as the few requests that waited for it
           "ttft_within_target": round(sum(t <= args.ttft_target_s for t in ttft) / max(len(ttft), 1), 3),
           "itl_s_p99": pct(itl, 99),
           "instance_s": round(instance_s, 1), "duration_s": round(end - t0, 1),
           "failovers": migrations.failovers, "migrations": migrations.by_status.get("finished", 0),
           "outputs": [s.tokens if not isinstance(s, BaseException) else None for s in done]}
    if autoscaler is not None:
        row["steps"] = [{"action": e.action, "instance": e.instance_id, "outcome": e.outcome, "reason": e.reason,
                         "migrated": e.migrated, "duration_s": round(e.duration_s, 1)} for e in autoscaler.events]
    return row


def run(args: argparse.Namespace) -> int:
    rates = parse_numbers(args.rates, "--rates", float, "rates like 0.3,1.5,0.3")
    fleets = [f for f in args.fleets.split(",") if f]
    policies = tuple(p for p in args.migration_policies.split(",") if p)
    if unknown := set(policies) - set(POLICIES):
        raise UsageError(f"--migration-policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if not set(fleets) <= {"max", "min", "autoscaled"} or not rates or min(rates) <= 0:
        raise UsageError("--fleets: choose from max, min, autoscaled; --rates: positive requests/s")
    scaling = AutoscalingConfig(min_instances=args.min_instances, max_instances=args.max_instances,
                                target=AutoscaleTarget(ttft_p99_s=args.ttft_target_s,
                                                       queue_per_instance=args.queue_target),
                                up_after_s=args.up_after_s, down_after_s=args.down_after_s, cooldown_s=1.0,
                                predict=args.predict,
                                interval_s=0.5, window_s=10.0, drain_timeout_s=120.0)  # validates the bounds
    state = local_cluster.read_state(args.state)
    nodes = [n.spec.name for n in state.nodes]
    local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    pinned = local_cluster.pin_nodes(state) if args.pin_cores else {}
    if pinned:
        print("pinned: " + ", ".join(f"{n} to core {c}" for n, c in pinned.items()), flush=True)
    target = resolve_model(args.model, args.dtype)
    tok = load_model(target, args.dtype)
    # the batch-invariant forward, as the default app runs: a request moved between instances, or batched with
    # other requests, gives the same tokens, so the fleets' outputs can be compared token for token in bf16 too
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype), deterministic=True,
                       speculation=SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=args.slots),
                       cache=CacheConfig(block_size=16, num_blocks=args.slots * (args.prompt_tokens + args.max_tokens
                                                                                 + 32) // 16 + 2))
    router_cfg = RouterConfig(stats_interval_s=0.2, migration=MigrationConfig(policies=policies, interval_s=0.5))
    rng = random.Random(args.seed)
    gaps, t = [], 0.0
    for phase, rate in enumerate(rates):
        while True:
            gap = rng.expovariate(rate)
            if t + gap >= (phase + 1) * args.phase_s:
                break
            t += gap
            gaps.append(gap)
    texts = load_prompts([DATASETS / "mt_bench_questions.jsonl"], min(len(gaps), 80))  # MT-Bench has 80: reused
    prompts = [(tok.encode(texts[i % len(texts)]) * 64)[:args.prompt_tokens] for i in range(len(gaps))]
    report: dict = {"model": target, "rates": rates, "phase_s": args.phase_s, "requests": len(gaps),
                    "autoscaling": scaling.model_dump(), "pinned": pinned, "migration_policies": policies,
                    "fleets": {}}
    try:
        for fleet in fleets:
            size = args.max_instances if fleet == "max" else args.min_instances
            b = Bench(cfg, tok.num_layers, args.num_cpus, router_cfg)
            autoscaler = None
            try:
                for i in range(size):
                    b.start(f"inst-{i}", nodes[i % len(nodes)])
                asyncio.run(b.stream(prompts[0][:16], 2))  # warm-up
                if fleet == "autoscaled":
                    autoscaler = Autoscaler(scaling, args.slots, RouterClient(b.router), NodeLauncher(b, nodes),
                                            floor=args.min_instances)
                row = asyncio.run(drive(b, prompts, gaps, args, autoscaler))
            finally:
                if autoscaler is not None:
                    autoscaler.stop_all()
                b.close()
            report["fleets"][fleet] = row
            print(f"{fleet}: TTFT p99 {row['ttft_s_p99']:.2f} s (target {args.ttft_target_s:g}; "
                  f"{row['ttft_within_target']:.1%} within it), p90 {row['ttft_s_p90']:.2f} s, ITL p99 "
                  f"{row['itl_s_p99']:.3f} s, {row['instance_s']:.0f} instance-s, {row['lost']} lost, "
                  f"{row['failovers']} failovers, {row['migrations']} migrations"
                  + (f", {len(row['steps'])} scale steps" if "steps" in row else ""), flush=True)
    finally:
        ray.shutdown()
    outputs = [r.pop("outputs") for r in report["fleets"].values()]
    report["identical"] = all(o == outputs[0] for o in outputs)
    f = report["fleets"]
    if {"max", "autoscaled"} <= set(f):
        report["instance_s_vs_max"] = round(f["autoscaled"]["instance_s"] / f["max"]["instance_s"], 3)
    print(f"identical outputs across fleets: {report['identical']}; autoscaled/max instance-seconds: "
          f"{report.get('instance_s_vs_max')}")
    save(report, args.json, None, lambda *_: None)
    return 0
