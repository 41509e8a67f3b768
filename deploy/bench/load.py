"""`specfleet bench load`: Poisson arrivals of real prompts against one engine, per policy (off, fixed, goodput).

For each rate, the same arrival times and prompts are replayed against a fresh engine with each policy in
turn (interleaved per rate, so drift in machine speed hits every policy alike); the models are loaded once.
A saturation check runs 1 and then C concurrent requests per policy. Latency is end to end from arrival;
TTFT to the first token; TPOT is (last - first token time) / (tokens - 1) per request.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.engine.core import Engine
from actors.speculation.cost_model import ForwardShape, StepCostModel
from actors.model.loader import load_model
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
from cluster.request import Request, SamplingParams
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.bench.output import pct, save
from deploy.cli.flags import UsageError, parse_numbers
from deploy.model_store import resolve_model

POLICIES = ("off", "fixed", "goodput")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model (catalog name, GGUF, folder)")
    p.add_argument("--draft", required=True, help="draft model sharing the target's tokenizer")
    p.add_argument("--rates", default="0.5,1,2,4", help="request rates (requests/s), comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate and policy")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompts are cut to their first N tokens")
    p.add_argument("--k", type=int, default=4, help="K: drafts per request for fixed, the most for goodput")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--draft-quantization", choices=["none", "int8", "int4"], default="int8")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="saturation check: C requests at once vs 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)


@dataclass
class Trace:
    """Timestamps of one request (seconds from the run's start)."""

    arrival: float
    first: float | None = None
    finish: float | None = None
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    policy: str
    rate: float
    traces: list[Trace] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0

    def summary(self) -> dict:
        done = [t for t in self.traces if t.finish is not None]
        lat = sorted(t.finish - t.arrival for t in done)
        ttft = [t.first - t.arrival for t in done if t.first is not None]
        tpot = [(t.finish - t.first) / (t.tokens - 1) for t in done if t.tokens > 1]
        span = max(t.finish for t in done) - min(t.arrival for t in done)
        tokens = sum(t.tokens for t in done)
        return {
            "policy": self.policy, "rate": self.rate, "requests": len(done), "tokens": tokens,
            "throughput_tok_s": round(tokens / span, 3),
            "mean_latency_s": round(sum(lat) / len(lat), 3),
            "p99_latency_s": round(pct(lat, 99), 3),
            "mean_ttft_s": round(sum(ttft) / len(ttft), 3),
            "mean_tpot_s": round(sum(tpot) / len(tpot), 4) if tpot else None,
            "mean_k": round(sum(self.ks) / len(self.ks), 3) if self.ks else 0.0,
            "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
        }


def serve(engine: Engine, arrivals: list[float], prompts: list[list[int]], max_tokens: int,
          policy: str, rate: float) -> RunResult:
    """Replay arrivals in real time against `engine` until every request has finished."""
    result = RunResult(policy, rate, [Trace(a) for a in arrivals])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = {}
    start, nxt = time.perf_counter(), 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            engine.add_request(Request(f"q{nxt}", tuple(prompts[nxt]), params, arrival_time=arrivals[nxt]))
            seqs[nxt] = engine.waiting[-1]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        deltas = engine.step()
        t = time.perf_counter() - start
        for d in deltas:
            trace = result.traces[int(d.request_id[1:])]
            if d.token_ids and trace.first is None:
                trace.first = t
            trace.tokens += len(d.token_ids)
            trace.token_ids.extend(d.token_ids)
            if d.finished:
                trace.finish = t
    for seq in seqs.values():
        result.ks.extend(seq.stats.k_history)
        result.accepted += seq.stats.accepted
        result.proposed += seq.stats.proposed
    return result


def run(args: argparse.Namespace) -> int:
    rates = parse_numbers(args.rates, "--rates", float, "numbers like 0.5,1,2")
    policies = args.policies.split(",")
    if bad := [p for p in policies if p not in POLICIES] or [r for r in rates if r <= 0]:
        raise UsageError(f"bad --policies or --rates: {bad}")
    if args.max_prompt_tokens < 1:
        raise UsageError("--max-prompt-tokens must be at least 1")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    target = load_model(resolve_model(args.target, args.dtype), args.dtype)
    draft_model = load_model(resolve_model(args.draft, args.dtype), args.dtype)
    print(f"loaded target and draft in {time.perf_counter() - t0:.0f}s", flush=True)
    cache = CacheConfig(block_size=16, num_blocks=args.max_batch_size * (1024 + args.max_tokens) // 16 + 64)
    target_runner = ModelRunner(target, range(target.num_layers), cache)
    draft_runner = ModelRunner(draft_model, range(draft_model.num_layers), cache)
    if args.draft_quantization != "none":
        quantize_runner(draft_runner, args.draft_quantization)
    sched = SchedulerConfig(max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens)

    cost = StepCostModel()  # one step-time model for every goodput engine: calibrated once, then fitted online

    def engine(policy: str) -> Engine:
        return Engine(target_runner, None if policy == "off" else draft_runner,
                      SpeculationConfig(policy=policy, k=args.k), sched, cost_model=cost)

    texts = load_prompts(args.prompts)
    encoded = [target.encode(t, chat=True)[:args.max_prompt_tokens] for t in texts]
    for p in policies:  # warm-up
        generate(engine(p), [encoded[0]], SamplingParams(temperature=0, max_tokens=8))

    saturation = []
    for p in policies:
        for c in (1, args.concurrency):
            e = engine(p)
            r = serve(e, [0.0] * c, encoded[:c], args.max_tokens, p, 0.0)
            s = r.summary()
            saturation.append({"policy": p, "concurrency": c, "throughput_tok_s": s["throughput_tok_s"],
                               "mean_k": s["mean_k"]})
            print(f"saturation {p} x{c}: {s['throughput_tok_s']:.2f} tok/s, mean k {s['mean_k']:.2f}", flush=True)

    runs = []
    for rate in rates:
        rng = random.Random(args.seed * 1000 + int(rate * 1000))
        arrivals, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t > args.duration:
                break
            arrivals.append(t)
        arrivals = arrivals or [0.0]
        picks = [encoded[rng.randrange(len(encoded))] for _ in arrivals]
        outputs = {}
        for p in policies:
            r = serve(engine(p), arrivals, picks, args.max_tokens, p, rate)
            outputs[p] = [t.token_ids for t in r.traces]
            s = r.summary()
            # lossless check: every policy's outputs against the first policy's (identical in fp32; bf16 near-ties flip)
            s["identical_to_" + policies[0]] = round(
                sum(a == b for a, b in zip(outputs[p], outputs[policies[0]])) / len(arrivals), 4)
            runs.append(s)
            print(f"rate {rate:g}/s {p:>8}: {s['requests']} req, {s['throughput_tok_s']:.2f} tok/s, latency mean "
                  f"{s['mean_latency_s']:.2f}s p99 {s['p99_latency_s']:.2f}s, TTFT {s['mean_ttft_s']:.2f}s, "
                  f"TPOT {s['mean_tpot_s']}s, mean k {s['mean_k']:.2f}", flush=True)

    report = _report(args, rates, policies, runs, saturation)
    if cost.fitted:  # what the goodput policy believed a forward costs, by tokens fed, at the end of the run
        report["cost_model"] = {
            name: {n: round(model.predict(ForwardShape(1, n)), 4) for n in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128)}
            for name, model in (("target_forward_s", cost.target), ("draft_forward_s", cost.draft))
        }
    _print_table(report)
    save(report, args.json, args.plot, _plot)
    return 0


def _report(args, rates, policies, runs, saturation) -> dict:
    ratios = {}
    by = {(r["rate"], r["policy"]): r for r in runs}
    if {"off", "fixed", "goodput"} <= set(policies):
        for rate in rates:
            best = min(by[(rate, "off")]["mean_latency_s"], by[(rate, "fixed")]["mean_latency_s"])
            ratios[f"rate {rate:g}: goodput latency / best of off, fixed"] = round(
                by[(rate, "goodput")]["mean_latency_s"] / best, 3)
    sat = {(s["policy"], s["concurrency"]): s["throughput_tok_s"] for s in saturation}
    for p in policies:
        ratios[f"{p}: {args.concurrency} concurrent / 1, tokens/s"] = round(
            sat[(p, args.concurrency)] / sat[(p, 1)], 3)
    return {
        "command": "specfleet bench load", "target": args.target, "draft": args.draft, "k": args.k,
        "dtype": args.dtype, "draft_quantization": args.draft_quantization, "duration_s": args.duration,
        "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens, "max_batch_size": args.max_batch_size,
        "max_num_batched_tokens": args.max_num_batched_tokens, "threads": torch.get_num_threads(),
        "runs": runs, "saturation": saturation, "ratios": ratios,
    }


def _print_table(report: dict) -> None:
    print(f"\n{'rate':>6} {'policy':<8}{'req':>5}{'tok/s':>8}{'lat mean':>9}{'lat p99':>9}{'TTFT':>7}{'TPOT':>7}{'k':>6}")
    for r in report["runs"]:
        print(f"{r['rate']:>6g} {r['policy']:<8}{r['requests']:>5}{r['throughput_tok_s']:>8.2f}{r['mean_latency_s']:>9.2f}"
              f"{r['p99_latency_s']:>9.2f}{r['mean_ttft_s']:>7.2f}{r['mean_tpot_s'] or 0:>7.3f}{r['mean_k']:>6.2f}")
    for name, v in report["ratios"].items():
        print(f"{name}: {v:.3f}")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for policy, color in zip(POLICIES, ("#888", "#2a7", "#57a")):
        rows = [r for r in report["runs"] if r["policy"] == policy]
        if not rows:
            continue
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["mean_latency_s"] for r in rows], "o-", color=color, label=policy)
        axes[1].plot(rates, [r["throughput_tok_s"] for r in rows], "o-", color=color, label=policy)
        axes[2].plot(rates, [r["mean_k"] for r in rows], "o-", color=color, label=policy)
    for ax, label in zip(axes, ("mean latency (s)", "throughput (tokens/s)", "mean k")):
        ax.set_xlabel("request rate (1/s)")
        ax.set_ylabel(label)
        ax.set_xscale("log")
    axes[0].legend()
    fig.suptitle(f"{Path(report['target']).stem} / {Path(report['draft']).stem}, {report['dtype']}, "
                 f"{report['max_tokens']} tokens per request")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
