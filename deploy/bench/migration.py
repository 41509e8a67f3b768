"""`specfleet bench migration`: live migration against stopping and failing over, on instances of the local cluster.

Three parts, each side by side in one run, through the API's own frontend (its streams follow a migrated
request and fail over a dead instance's; deploy/serve/frontend.py) and a router actor:

1. Downtime by context length: a request of C prompt tokens is migrated after a few decoded tokens, staged
   (copies while it decodes, then a short stop) and stop-and-copy (`max_stages: 0`), its KV over a
   torch.distributed channel (the default) and through Ray's object store; for each, the
   coordinator's downtime (stop at the source to commit at the destination) and the gap the client saw
   (the longest wait between two tokens after the migration began), beside the unmigrated run's median
   inter-token gap. Every migrated output is compared token for token with the unmigrated one. With
   `--stages N` the two instances are N shard actors each, on different nodes and split differently, so
   the KV goes from each source shard to the destination shards that hold its layers.
2. Failover: an instance running several requests is killed mid-stream; requests lost (the goal is none),
   whether each output equals its uninterrupted run, the latency the failover added to each, and the gap
   its client saw while it resumed elsewhere (KV recomputed from the prompt and the tokens so far).
3. Skewed load: Poisson arrivals of real prompts that all land on one instance until `--skew-open-at` of
   them (default 90%) have arrived, when one or two more open (a scale-out: they were drained until then);
   time to first token, end-to-end latency and throughput with the router's migration policies off and on
   (`--skew-policies`, default `queue`, `defrag`, `balance`), on instances whose KV cache holds
   `--skew-fits` requests each, so that queued requests wait for room. By default the opened fleet has room
   for the whole load (3 x 6 places for 16 requests) and only the skew makes requests wait; `--skew-fits 3`
   overloads the fleet as well.

Prefix caching is off here: a destination that caches the prompt copies less (`specfleet bench prefix` measures
that), and these parts measure the whole copy. Run `specfleet cluster up` first (`make serve` does). Figures:
docs/migration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import ray

from actors.model.loader import load_model
from cluster.config import (CacheConfig, EngineConfig, MigrationConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpeculationConfig)
from cluster.migration_policy import POLICIES, MigrationPolicyConfig
from deploy.bench.local_fleet import Bench, add_cluster_flags, add_model_flags, local_nodes, long_prompt
from deploy.bench.output import pct, save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError, parse_numbers
from deploy.model_store import resolve_model

PARETO_SHAPE = 1.2  # part 3 with --skew-output pareto: most requests short, a few up to the cap
STAGED = MigrationConfig()  # the defaults: up to 4 stages in chunks of 256 tokens, over a torch.distributed channel
MODES = {  # part 1's ways to migrate, side by side
    "staged": STAGED,
    "stop_and_copy": STAGED.model_copy(update={"max_stages": 0}),
    "staged_object_store": STAGED.model_copy(update={"transfer": "object_store"}),
    "stop_and_copy_object_store": STAGED.model_copy(update={"max_stages": 0, "transfer": "object_store"}),
}
DRAFT_MODES = {  # part "draft": the draft model's KV moved before the stop, or rebuilt by catch-up at the destination
    "draft_moved": STAGED.model_copy(update={"draft_kv": "move"}),
    "draft_rebuilt": STAGED.model_copy(update={"draft_kv": "rebuild"}),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--contexts", default="256,1024,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="migrations per context length and mode")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each request generates")
    p.add_argument("--migrate-after", type=int, default=8, help="tokens streamed before the migration starts")
    p.add_argument("--failover-requests", type=int, default=3, help="requests on the instance that is killed")
    p.add_argument("--failover-context", type=int, default=1024, help="their prompt length in tokens")
    p.add_argument("--skew-requests", type=int, default=16, help="requests of the skewed load (0: skip part 3)")
    p.add_argument("--skew-rate", type=float, default=2.0, help="their Poisson arrival rate (requests/s)")
    p.add_argument("--skew-prompt-tokens", type=int, default=256)
    p.add_argument("--skew-max-tokens", type=int, default=96)
    p.add_argument("--skew-output", choices=["fixed", "pareto"], default="fixed",
                   help="tokens each request generates: all --skew-max-tokens, or drawn from a Pareto law "
                        f"(shape {PARETO_SHAPE}) from --skew-min-tokens, cut at --skew-max-tokens")
    p.add_argument("--skew-min-tokens", type=int, default=16)
    p.add_argument("--skew-fits", type=int, default=6, help="requests whose KV one instance holds at once (part 3)")
    p.add_argument("--skew-open-at", type=float, default=0.9,
                   help="the fraction of the arrivals after which the other instances open")
    p.add_argument("--skew-instances", type=int, choices=[2, 3], default=3,
                   help="instances of part 3: the first, and those that open later (one per node)")
    p.add_argument("--seed", type=int, default=0, help="of the arrival times")
    p.add_argument("--skew-policies", default="queue,defrag,balance",
                   help="the migration policies of part 3's 'on' run, comma-separated (cluster/migration_policy.py)")
    p.add_argument("--parts", default="downtime,failover,skew",
                   help="which parts to run, comma-separated: downtime, failover, skew, draft")
    p.add_argument("--draft-layers", default="0-9",
                   help="part draft: the target layers its self-speculative draft runs, as FIRST-LAST")
    p.add_argument("--draft-k", type=int, default=4, help="part draft: tokens drafted per round")
    p.add_argument("--stages", type=int, default=1,
                   help="parts 1 and 2: target stages per instance (>1: shard actors, one node each, the second "
                        "instance split one layer later than the first)")
    add_cluster_flags(p, "CPUs per instance (shared by its stages)")
    p.add_argument("--plot", type=Path, help="a PNG of downtime by context length and the skewed load's latencies")


async def downtime_part(b: Bench, prompt: list[int], args, modes: dict[str, MigrationConfig] = MODES) -> dict:
    """Part 1 at one context length: unmigrated, staged and stop-and-copy runs (or `modes`), interleaved repeat by
    repeat."""
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    alone_gaps: list[float] = []
    alone_tokens = None
    for _ in range(args.repeats):
        alone = await b.stream(prompt, args.max_tokens)
        alone_tokens = alone.tokens
        alone_gaps += alone.gaps_after(alone.arrivals[0])
        for mode, mcfg in modes.items():
            began: list[float] = []

            async def move(rid: str, instance: str, mcfg=mcfg, began=began):
                to = next(n for n in b.servers if n != instance)
                began.append(time.perf_counter())
                return await b.router.migrate.remote(rid, to, mcfg)

            s = await b.stream(prompt, args.max_tokens, after=args.migrate_after, during=move)
            r = s.side
            rows[mode].append({"status": r.status.value, "reason": r.reason, "downtime_ms": r.downtime_s * 1e3, "total_ms": r.total_s * 1e3,
                               "stages": r.stages, "tokens_copied": r.tokens_copied, "transfer": r.transfer,
                               "draft_tokens": r.draft_tokens, "links": r.links,
                               "client_gap_ms": max(s.gaps_after(began[0]), default=0.0) * 1e3,
                               "identical": s.tokens == alone_tokens})
    itl = statistics.median(alone_gaps) * 1e3
    out = {"context": len(prompt), "itl_median_ms": itl}
    for mode, rs in rows.items():
        ok = [r for r in rs if r["status"] == "finished"]
        out[mode] = {"finished": len(ok), "of": len(rs), "identical": all(r["identical"] for r in rs),
                     "downtime_ms_median": statistics.median(r["downtime_ms"] for r in ok) if ok else None,
                     "client_gap_ms_median": statistics.median(r["client_gap_ms"] for r in ok) if ok else None,
                     "total_ms_median": statistics.median(r["total_ms"] for r in ok) if ok else None,
                     "stages_median": statistics.median(r["stages"] for r in ok) if ok else None, "runs": rs}
    return out


async def failover_part(b: Bench, prompts: list[list[int]], args, victim_node: str) -> dict:
    """Part 2: every request runs on one instance, which is killed mid-stream; each resumes elsewhere."""
    alone = await asyncio.gather(*(b.stream(p, args.max_tokens) for p in prompts))
    b.start("bench-victim", victim_node)
    others = [n for n in b.servers if n != "bench-victim"]
    for name in others:
        await b.router.drain.remote(name)
    killed: list[float] = []

    async def kill(rid: str, instance: str) -> None:
        for name in others:
            await b.router.undrain.remote(name)
        killed.append(time.perf_counter())
        ray.kill(b.servers.pop(instance), no_restart=True)

    tasks = [asyncio.create_task(b.stream(p, args.max_tokens)) for p in prompts[1:]]
    first = await b.stream(prompts[0], args.max_tokens, after=args.migrate_after, during=kill)
    done = [first] + list(await asyncio.gather(*tasks))
    added = [(s.arrivals[-1] - s.start) - (a.arrivals[-1] - a.start) for s, a in zip(done, alone)]
    lost = sum(s.finish != "length" for s in done)
    return {"context": len(prompts[0]), "requests": len(done), "lost": lost,
            "identical": all(s.tokens == a.tokens for s, a in zip(done, alone)),
            "errors": [s.error for s in done if s.error], "resumed_on": sorted({s.instance for s in done}),
            "added_latency_ms_mean": statistics.mean(added) * 1e3, "added_latency_ms_max": max(added) * 1e3,
            "client_gap_ms_max": max(max(s.gaps_after(killed[0]), default=0.0) for s in done) * 1e3}


async def skew_part(b: Bench, prompts: list[list[int]], gaps: list[float], lengths: list[int], args,
                    policies: tuple[str, ...]) -> dict:
    """Part 3: Poisson arrivals (`gaps` between them) of requests generating `lengths` tokens, that land on the
    first instance until a fraction `--skew-open-at` have arrived, when the others open; the router's
    migration policies as given."""
    planned = MigrationConfig(policies=policies, interval_s=0.2,
                              thresholds=MigrationPolicyConfig(high_water=0.6, low_water=0.4))
    await b.router.configure.remote(RouterConfig(stats_interval_s=0.2, migration=planned))
    first, *others = list(b.servers)
    for other in others:
        await b.router.drain.remote(other)
    before = (await b.router.migration_stats.remote()).by_status["finished"]
    t0 = time.perf_counter()
    tasks = []
    for i, (p, gap, n) in enumerate(zip(prompts, gaps, lengths)):
        await asyncio.sleep(gap)
        if i == int(len(prompts) * args.skew_open_at):
            for other in others:  # the scale-out
                await b.router.undrain.remote(other)
        tasks.append(asyncio.create_task(b.stream(p, n)))
    done = await asyncio.gather(*tasks)
    makespan = time.perf_counter() - t0
    moved = (await b.router.migration_stats.remote()).by_status["finished"] - before
    ttft = [s.ttft_s * 1e3 for s in done]
    e2e = [(s.arrivals[-1] - s.start) * 1e3 for s in done]
    return {"policies": list(policies) or ["off"], "requests": len(done), "migrations": moved,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "e2e_ms_p50": pct(e2e, 50),
            "e2e_ms_p99": pct(e2e, 99), "makespan_s": makespan,
            "throughput_tok_s": sum(len(s.tokens) for s in done) / makespan,
            "completed": sum(s.finish == "length" for s in done), "outputs": [s.tokens for s in done],
            "per_request": [{"ttft_ms": round(s.ttft_s * 1e3, 1), "e2e_ms": round((s.arrivals[-1] - s.start) * 1e3, 1),
                             "ended_on": s.instance, "finish": s.finish, "error": s.error} for s in done]}


def run(args: argparse.Namespace) -> int:
    contexts = parse_numbers(args.contexts, "--contexts", int, "lengths like 256,1024")
    unknown = set(args.skew_policies.split(",")) - set(POLICIES) - {""}
    if unknown:
        raise UsageError(f"--skew-policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    parts = set(args.parts.split(","))
    if not parts <= {"downtime", "failover", "skew", "draft"}:
        raise UsageError(f"--parts: choose from downtime, failover, skew, draft; got {args.parts!r}")
    try:
        first, last = (int(x) for x in args.draft_layers.split("-"))
    except ValueError:
        raise UsageError(f"--draft-layers: expected FIRST-LAST like 0-9, got {args.draft_layers!r}") from None
    nodes = local_nodes(args.state, "migration", 3, "two instances and a failover victim")
    target = resolve_model(args.model, args.dtype)
    tok = load_model(target, args.dtype)
    if args.stages < 1:
        raise UsageError(f"--stages: at least 1, got {args.stages}")
    report: dict = {"model": target, "dtype": args.dtype, "max_tokens": args.max_tokens, "stages": args.stages,
                    "migrate_after": args.migrate_after, "modes": {m: c.model_dump() for m, c in MODES.items()},
                    "downtime": []}
    try:
        if parts & {"downtime", "failover"}:
            _downtime_and_failover(args, parts, contexts, target, tok, nodes, report)
        if "draft" in parts:
            report["draft"] = _draft(args, contexts, target, tok, nodes, tuple(range(first, last + 1)))
        if "skew" in parts and args.skew_requests:
            report["skew"] = _skew(args, target, tok, nodes)
    finally:
        ray.shutdown()
    save(report, args.json, args.plot, _plot)
    return 0


def _downtime_and_failover(args, parts: set[str], contexts: list[int], target: str, tok, nodes: list[str],
                           report: dict) -> None:
    """Parts 1 and 2 on two instances (and a third, the failover's victim) sized for the longest context."""
    longest = max(contexts) + args.max_tokens + 64
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype), speculation=SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512),
                       cache=CacheConfig(block_size=16, num_blocks=2 * longest // 16 + 16, prefix_caching=False))
    b = Bench(cfg, tok.num_layers, args.num_cpus, RouterConfig(stats_interval_s=0.5), nodes, args.stages)
    try:
        b.start("bench-a", nodes[0])
        b.start("bench-b", nodes[1], shift=1)
        asyncio.run(b.stream(long_prompt(tok, 32), 4))  # warm-up
        for c in contexts if "downtime" in parts else ():
            part = asyncio.run(downtime_part(b, long_prompt(tok, c), args))
            report["downtime"].append(part)
            st, sc = part["staged"], part["stop_and_copy"]
            so, sco = part["staged_object_store"], part["stop_and_copy_object_store"]
            print(f"context {c}: downtime staged {_ms(st['downtime_ms_median'])} vs stop-and-copy "
                  f"{_ms(sc['downtime_ms_median'])} ({_ratio(sc['downtime_ms_median'], st['downtime_ms_median'])}); "
                  f"client gap {_ms(st['client_gap_ms_median'])} vs {_ms(sc['client_gap_ms_median'])}, "
                  f"median ITL {part['itl_median_ms']:.1f} ms; through the object store: downtime "
                  f"{_ms(so['downtime_ms_median'])} staged, {_ms(sco['downtime_ms_median'])} stop-and-copy "
                  f"({_ratio(sco['downtime_ms_median'], sc['downtime_ms_median'])} the channel's); identical "
                  f"{all(part[m]['identical'] for m in MODES)}", flush=True)
        if "failover" not in parts:
            return
        text = long_prompt(tok, args.failover_context + 8 * args.failover_requests)
        prompts = [text[8 * i:8 * i + args.failover_context] for i in range(args.failover_requests)]
        f = asyncio.run(failover_part(b, prompts, args, nodes[2]))
        report["failover"] = f
        print(f"failover of {f['requests']} requests at context {f['context']}: {f['lost']} lost, identical "
              f"{f['identical']}; added latency mean {f['added_latency_ms_mean']:.0f} ms, max "
              f"{f['added_latency_ms_max']:.0f} ms; longest client gap {f['client_gap_ms_max']:.0f} ms", flush=True)
    finally:
        b.close()


def _draft(args, contexts: list[int], target: str, tok, nodes: list[str], layers: tuple[int, ...]) -> list[dict]:
    """Part "draft": with a self-speculative draft, its KV moved before the stop vs rebuilt at the destination."""
    longest = max(contexts) + args.max_tokens + 64
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype, draft_layers=layers),
                       speculation=SpeculationConfig(policy="fixed", k=args.draft_k),
                       scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512),
                       cache=CacheConfig(block_size=16, num_blocks=2 * longest // 16 + 16, prefix_caching=False))
    b = Bench(cfg, tok.num_layers, args.num_cpus, RouterConfig(stats_interval_s=0.5))
    out = []
    try:
        b.start("bench-a", nodes[0])
        b.start("bench-b", nodes[1])
        asyncio.run(b.stream(long_prompt(tok, 32), 4))  # warm-up
        for c in contexts:
            part = asyncio.run(downtime_part(b, long_prompt(tok, c), args, DRAFT_MODES))
            out.append(part)
            mv, rb = part["draft_moved"], part["draft_rebuilt"]
            print(f"context {c}, draft of layers {layers[0]}-{layers[-1]}: client gap with the draft KV moved "
                  f"{_ms(mv['client_gap_ms_median'])} vs rebuilt {_ms(rb['client_gap_ms_median'])} "
                  f"({_ratio(rb['client_gap_ms_median'], mv['client_gap_ms_median'])}); downtime "
                  f"{_ms(mv['downtime_ms_median'])} vs {_ms(rb['downtime_ms_median'])}; migration total "
                  f"{_ms(mv['total_ms_median'])} vs {_ms(rb['total_ms_median'])}; identical "
                  f"{mv['identical'] and rb['identical']}", flush=True)
    finally:
        b.close()
    return out


def _skew(args, target: str, tok, nodes: list[str]) -> dict:
    per_request = args.skew_prompt_tokens + args.skew_max_tokens + 16
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype), speculation=SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512),
                       cache=CacheConfig(block_size=16, num_blocks=args.skew_fits * per_request // 16 + 1,
                                         prefix_caching=False))
    texts = load_prompts([DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"], args.skew_requests)
    prompts = [(tok.encode(t) * 64)[:args.skew_prompt_tokens] for t in texts]
    rng = random.Random(args.seed)
    gaps = [0.0] + [rng.expovariate(args.skew_rate) for _ in prompts[1:]]  # the same arrivals for off and on
    lengths = [args.skew_max_tokens] * len(prompts)
    if args.skew_output == "pareto":  # heavy-tailed output lengths, as Llumnix's generated workloads (section 6.1)
        lengths = [min(args.skew_max_tokens, round(args.skew_min_tokens * rng.paretovariate(PARETO_SHAPE)))
                   for _ in prompts]
    runs = []
    for policies in ((), tuple(x for x in args.skew_policies.split(",") if x)):
        b = Bench(cfg, tok.num_layers, args.num_cpus, RouterConfig(stats_interval_s=0.2))
        try:
            for i in range(args.skew_instances):
                b.start(f"skew-{'abc'[i]}", nodes[i])
            asyncio.run(b.stream(prompts[0][:32], 4))  # warm-up
            runs.append(asyncio.run(skew_part(b, prompts, gaps, lengths, args, policies)))
        finally:
            b.close()
    off, on = runs
    outputs = list(zip(off.pop("outputs"), on.pop("outputs")))
    identical = all(a == b for a, b in outputs)
    # where an output differs: its index, the first token that differs, and where each run ended it
    differs = [{"request": i, "off_on": off["per_request"][i]["ended_on"], "on_on": on["per_request"][i]["ended_on"],
                "at_token": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))),
                "off_tokens": a, "on_tokens": b}
               for i, (a, b) in enumerate(outputs) if a != b]
    print(f"skewed Poisson load, {args.skew_requests} requests at {args.skew_rate:g}/s: p99 TTFT "
          f"{on['ttft_ms_p99']:.0f} ms with migration ({on['migrations']} moves) vs {off['ttft_ms_p99']:.0f} ms "
          f"without ({_ratio(off['ttft_ms_p99'], on['ttft_ms_p99'])} better); p99 e2e {on['e2e_ms_p99']:.0f} vs "
          f"{off['e2e_ms_p99']:.0f} ms ({_ratio(off['e2e_ms_p99'], on['e2e_ms_p99'])}); throughput "
          f"{on['throughput_tok_s']:.1f} vs {off['throughput_tok_s']:.1f} tok/s "
          f"({_ratio(on['throughput_tok_s'], off['throughput_tok_s'])}); identical outputs {identical}", flush=True)
    return {"off": off, "on": on, "identical": identical, "differs": differs, "rate": args.skew_rate,
            "open_at": args.skew_open_at,
            "instances": args.skew_instances,
            "output": args.skew_output, "lengths": lengths}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = report["downtime"]
    contexts = [p["context"] for p in parts]  # (none when only part 3 ran)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, label in (("staged", "staged"), ("stop_and_copy", "stop and copy"),
                        ("stop_and_copy_object_store", "stop and copy, object store")):
        axes[0].plot(contexts, [p[mode]["downtime_ms_median"] for p in parts], "o-", label=f"{label}: downtime")
        axes[0].plot(contexts, [p[mode]["client_gap_ms_median"] for p in parts], "x--", label=f"{label}: client gap")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("context (tokens)")
    axes[0].set_ylabel("ms (median)")
    axes[0].legend(fontsize=7)
    if skew := report.get("skew"):
        keys = ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99")
        xs = range(len(keys))
        axes[1].bar([x - 0.2 for x in xs], [skew["off"][k] for k in keys], 0.4, label="migration off")
        axes[1].bar([x + 0.2 for x in xs], [skew["on"][k] for k in keys], 0.4, label="migration on")
        axes[1].set_xticks(list(xs), [k.replace("_ms_", " ") for k in keys])
        axes[1].set_ylabel("ms")
        axes[1].legend(fontsize=7)
    fig.suptitle(f"{Path(report['model']).name}: live migration (left), skewed load (right)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"
