"""`specfleet bench disagg`: long-prompt interference, aggregated against prefill/decode disaggregation, on the local
cluster.

Short requests (`--short-prompt` tokens, `--short-tokens` out) arrive as a Poisson process while long prompts
(`--long-prompt` tokens) arrive beside them; the figure is the short requests' inter-token latency (ITL) p99: a long
prefill that lands in an instance's step stalls every request decoding there (DistServe, OSDI '24, section 2). The
same arrivals run twice on three instances, one per node, side by side in one run: aggregated (every instance `both`,
least-load dispatch) and disaggregated (`prefill`, `decode`, `decode`: long prompts prefill on the first and move to
a decode instance after their first token; short ones, under `skip_prefill_tokens`, start on a decode instance and
never move). Greedy, so each short request's output is compared token for token between the two runs. Run
`specfleet cluster up --nodes 3` first. Design: docs/disaggregation.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import ray

from actors.model.loader import load_model
from cluster.config import (CacheConfig, EngineConfig, FleetConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpecfleetConfig, SpeculationConfig)
from cluster.disagg import DisaggConfig
from deploy.bench.local_fleet import Bench, Streamed, add_cluster_flags, add_model_flags, local_nodes, long_prompt
from deploy.bench.output import pct, save
from deploy.cli.flags import UsageError
from deploy.model_store import resolve_model
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config

MODES = {"aggregated": ("both", "both", "both"), "disaggregated": ("prefill", "decode", "decode")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--short-requests", type=int, default=12, help="short requests (their ITL is the figure)")
    p.add_argument("--short-rate", type=float, default=1.0, help="their Poisson arrival rate (requests/s)")
    p.add_argument("--short-prompt", type=int, default=64, help="their prompt length in tokens")
    p.add_argument("--short-tokens", type=int, default=128, help="tokens each generates")
    p.add_argument("--long-requests", type=int, default=4, help="long prompts arriving beside them")
    p.add_argument("--long-rate", type=float, default=0.5, help="their Poisson arrival rate (requests/s)")
    p.add_argument("--long-prompt", type=int, default=2048, help="their prompt length in tokens")
    p.add_argument("--long-tokens", type=int, default=16, help="tokens each long request generates")
    p.add_argument("--speculation", choices=["off", "ngram"], default="off")
    p.add_argument("--seed", type=int, default=0, help="of the arrival times")
    add_cluster_flags(p)


def run(args: argparse.Namespace) -> int:
    if min(args.short_requests, args.short_prompt, args.short_tokens, args.long_prompt) < 1 or args.long_requests < 0:
        raise UsageError("--short-requests, --short-prompt, --short-tokens and --long-prompt must be at least 1, "
                         "--long-requests at least 0")
    if min(args.short_rate, args.long_rate) <= 0:
        raise UsageError("--short-rate and --long-rate must be positive")
    nodes = local_nodes(args.state, "disagg", 3, "one instance each")
    target = resolve_model(args.model, args.dtype)
    tok = load_model(target, args.dtype)
    text = long_prompt(tok, args.long_prompt + args.short_requests * args.short_prompt)
    shorts = [text[args.long_prompt + i * args.short_prompt:][:args.short_prompt] for i in range(args.short_requests)]
    longs = [text[i:i + args.long_prompt] for i in range(args.long_requests)]  # each its own (not a shared prefix)
    rng = random.Random(args.seed)
    arrivals = sorted([(t, "short", p) for t, p in zip(_poisson(rng, args.short_rate, len(shorts)), shorts)]
                      + [(t + 0.5, "long", p) for t, p in zip(_poisson(rng, args.long_rate, len(longs)), longs)],
                      key=lambda a: a[0])
    report: dict = {"model": target, "dtype": args.dtype, "args": {k: str(v) for k, v in vars(args).items()},
                    "modes": {}}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for mode, roles in MODES.items():
            figures, outputs[mode] = _one(args, target, tok, nodes, roles, arrivals)
            report["modes"][mode] = figures
    finally:
        ray.shutdown()
    agg, dis = report["modes"]["aggregated"], report["modes"]["disaggregated"]
    report["identical"] = outputs["aggregated"] == outputs["disaggregated"]
    report["itl_p99_ratio"] = (agg["short_itl_ms_p99"] / dis["short_itl_ms_p99"]
                               if agg["short_itl_ms_p99"] and dis["short_itl_ms_p99"] else None)
    ratio = "-" if report["itl_p99_ratio"] is None else f"{report['itl_p99_ratio']:.2f}x"
    print(f"long-prompt interference: short requests' ITL p99 {agg['short_itl_ms_p99']:.1f} ms aggregated vs "
          f"{dis['short_itl_ms_p99']:.1f} ms disaggregated ({ratio} lower); TTFT p99 short "
          f"{agg['short_ttft_ms_p99']:.0f} vs {dis['short_ttft_ms_p99']:.0f} ms, long {agg['long_ttft_ms_p99']} vs "
          f"{dis['long_ttft_ms_p99']} ms; handoffs {dis['handoffs']}; identical short outputs {report['identical']}",
          flush=True)
    save(report, args.json, None, lambda r, p: None)
    return 0


def _poisson(rng: random.Random, rate: float, n: int) -> list[float]:
    """Arrival times of n requests of a Poisson process of `rate` per second, the first at 0."""
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _one(args, target: str, tok, nodes: list[str], roles: tuple[str, ...], arrivals) -> tuple[dict, list[list[int]]]:
    """One run of the arrivals on three instances with `roles`: its figures and the short requests' outputs."""
    longest = args.long_prompt + args.long_tokens + 64
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype),
                       speculation=SpeculationConfig(method="ngram", policy="fixed", k=3) if args.speculation == "ngram"
                       else SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=16),
                       cache=CacheConfig(block_size=16, num_blocks=4 * longest // 16 + 64, prefix_caching=False))
    router_cfg = RouterConfig(stats_interval_s=0.2, disaggregation=DisaggConfig(roles=roles))
    b = Bench(cfg, tok.num_layers, args.num_cpus, router_cfg)
    b.frontend = Frontend(frontend_config(SpecfleetConfig(engine=cfg, fleet=FleetConfig(instances=len(roles)),
                                                          router=router_cfg)), b.router)  # it sends the prompt's shape
    try:
        for i, role in enumerate(roles):
            b.start(f"pd-{i}", nodes[i], role=role)
        asyncio.run(b.stream(arrivals[0][2][:16], 4))  # warm-up

        async def load() -> list[tuple[str, Streamed]]:
            began = time.perf_counter()

            async def one(at: float, kind: str, prompt: list[int]) -> tuple[str, Streamed]:
                await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
                return kind, await b.stream(prompt, args.short_tokens if kind == "short" else args.long_tokens)
            return await asyncio.gather(*(one(*a) for a in arrivals))
        done = asyncio.run(load())
        routing = ray.get(b.router.routing_stats.remote())
    finally:
        b.close()
    short = [s for kind, s in done if kind == "short"]
    long_ = [s for kind, s in done if kind == "long"]
    itl = [g for s in short if s.arrivals for g in s.gaps_after(s.arrivals[0])]
    ms = lambda v: None if v is None else round(1e3 * v, 2)  # noqa: E731
    return ({"roles": list(roles), "short_itl_ms_p50": ms(pct(itl, 50)), "short_itl_ms_p99": ms(pct(itl, 99)),
             "short_ttft_ms_p99": ms(pct([s.ttft_s for s in short], 99)),
             "long_ttft_ms_p99": ms(pct([s.ttft_s for s in long_], 99)),
             "completed": sum(s.finish == "length" for _, s in done), "of": len(done),
             "placements": routing.disaggregation, "handoffs": routing.handoffs},
            [s.tokens for s in short])
