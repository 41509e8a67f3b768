"""`specfleet bench moe`: plain expert parallelism vs Speculative MoE's grouping and pre-scheduling, in one run.

Routing statistics are profiled on one part of the prompts (actors/moe/profile.py); the figures come from
another part (held out). For each rank count, the MoE model runs as expert-parallel rank actors on the local
cluster (gloo all-to-all between processes) under these settings, one after another, on the same prompts:

    plain        contiguous experts per rank, each request on the lightest rank
    grouped      experts grouped by co-activation and affinity (placement/experts.py), lightest rank
    grouped+pre  grouped, and each request on the rank its prompt's predicted experts favour (within --slack)

and again with tensor-parallel attention (every rank holds a slice of the heads and runs every token;
actors/moe/shuffle.py), where each token's FFN runs on one rank:

    tp           contiguous experts, tokens on a balanced contiguous split
    tp+grouped   grouped experts, balanced split
    tp+shuffle   grouped, and each token on the rank its predicted experts favour (Speculative MoE's token
                 shuffling; predictions below --confidence fall back to the balanced split)

Each layout's gains are against its own plain setting (plain, tp); the tensor-parallel rows also report the
attention's reduce-scatter and all-gather bytes, which replace the all-reduce such attention needs anyway.

Reported per setting, from the ranks' own counters (actors/moe/ep.py): local activation rate (share of
(token, expert) pairs served on the token's rank), all-to-all bytes per token (over every MoE layer), MoE-layer
milliseconds per token, tokens/s, and whether the output equals one process's (it must: temperature 0, fp32).
Arithmetic note: with top-k experts over R ranks spread evenly, a placement that ignores routing keeps about
1/R of activations local.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from actors.serving.build import expert_parallel_runner
from actors.engine.core import Engine
from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from actors.moe.ep import EPStats
from actors.moe.profile import moe_layers, profile
from actors.engine.offline import generate
from cluster.config import (CacheConfig, EngineConfig, ExpertParallelConfig, ModelConfig, SchedulerConfig,
                            SpeculationConfig)
from cluster.request import SamplingParams
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError, parse_balance, parse_numbers
from deploy.infra import local_cluster
from placement.experts import contiguous_plan, group_experts

SETTINGS = ("plain", "grouped", "grouped+pre", "tp", "tp+grouped", "tp+shuffle")
BASELINE = {"plain": "plain", "grouped": "plain", "grouped+pre": "plain", "tp": "tp", "tp+grouped": "tp",
            "tp+shuffle": "tp"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a MoE model (folder, GGUF or catalog name), e.g. from train-moe")
    p.add_argument("--ranks", default="2,3", help="expert-parallel rank counts, comma-separated")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--profile-prompts", type=int, default=96, help="prompts the routing statistics are taken on")
    p.add_argument("--num-prompts", type=int, default=32, help="held-out prompts the figures are taken on")
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="requests decoding together")
    p.add_argument("--slack", type=int, default=2, help="grouped+pre: requests a rank may hold above the lightest")
    p.add_argument("--balance", type=parse_balance, default=None,
                   help="grouping: cap each rank's expert load per layer at (1 + BALANCE) times an even share "
                        "(default none: expert counts only)")
    p.add_argument("--confidence", type=float, default=0.0,
                   help="tp+shuffle: least share of a token's predicted expert mass on its rank to move it there")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--num-cpus", type=float, default=0.5, help="CPUs of each rank actor (its torch threads)")
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--out", type=Path, help="folder to keep the routing statistics and plans in (default: temporary)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)


@dataclass
class Run:
    """One setting at one rank count, and what it measured."""

    ranks: int
    setting: str
    experts: ExpertParallelConfig
    stats: EPStats = field(default_factory=EPStats)
    per_rank_tokens: list[float] = field(default_factory=list)  # tokens each rank ran as home (attention load)
    per_rank_served: list[dict[int, int]] = field(default_factory=list)  # pairs each rank's experts ran, by layer
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    ranks = parse_numbers(args.ranks, "--ranks", int, "counts like 2,3")
    settings = args.settings.split(",")
    unknown = [name for name in settings if name not in SETTINGS]
    missing = {BASELINE[name] for name in settings} - set(settings)
    if unknown or missing:
        raise UsageError(f"--settings: unknown {unknown}, or without the baseline they are compared with {missing}")
    from deploy.model_store import resolve_model

    path = resolve_model(args.model)
    model = load_model(path, "fp32")
    layers = moe_layers(ModelRunner(model, range(model.num_layers), CacheConfig(num_blocks=8)))
    if not layers:
        raise UsageError(f"{args.model} has no MoE layers")
    num_experts = model.hf_model.model.layers[layers[0]].mlp.gate.weight.shape[0]
    if max(ranks) > num_experts:
        raise UsageError(f"--ranks {args.ranks}: the model has {num_experts} experts per layer")
    texts = load_prompts(args.prompts)
    need = args.profile_prompts + args.num_prompts
    if len(texts) < need:
        raise UsageError(f"{len(texts)} prompts in {[str(p) for p in args.prompts]}, {need} asked for")
    encoded = [model.encode(t, chat=True)[:args.max_prompt_tokens] for t in texts[:need]]
    # load_prompts takes the files in turn, so both parts hold MT-Bench and HumanEval prompts
    profiled, measured = encoded[:args.profile_prompts], encoded[args.profile_prompts:]
    cache = CacheConfig(block_size=16, num_blocks=(args.max_prompt_tokens + args.max_tokens) // 16 * args.batch + 64)

    out = args.out or Path(tempfile.mkdtemp(prefix="specfleet-moe-"))
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    stats = profile(ModelRunner(model, range(model.num_layers), CacheConfig(block_size=16, num_blocks=64)), profiled)
    print(f"profiled {stats.tokens} tokens of {len(profiled)} prompts in {time.perf_counter() - t:.1f} s", flush=True)
    stats.save(out / "routing.safetensors", model=path)
    runs = []
    for r in ranks:
        plan = group_experts(stats.layers, stats.coact.numpy(), stats.affinity.numpy(), stats.load.numpy(), r,
                             balance=args.balance)
        (out / f"plan-{r}.json").write_text(plan.model_dump_json())
        (out / f"contiguous-{r}.json").write_text(contiguous_plan(stats.layers, num_experts, r).model_dump_json())
        plan_file, stats_file = str(out / f"plan-{r}.json"), str(out / "routing.safetensors")
        tp = dict(attention="tensor", confidence=args.confidence)
        every = {"plain": ExpertParallelConfig(ranks=r),
                 "grouped": ExpertParallelConfig(ranks=r, plan=plan_file),
                 "grouped+pre": ExpertParallelConfig(ranks=r, plan=plan_file, stats=stats_file, slack=args.slack),
                 "tp": ExpertParallelConfig(ranks=r, **tp),
                 "tp+grouped": ExpertParallelConfig(ranks=r, plan=plan_file, **tp),
                 "tp+shuffle": ExpertParallelConfig(ranks=r, plan=plan_file, stats=stats_file, **tp)}
        runs += [Run(r, name, every[name]) for name in settings]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    reference = _one_process(model, cache, measured, params, args.batch)

    state = local_cluster.read_state(args.state)
    local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    try:
        for run_ in runs:
            _measure(run_, path, cache, measured, params, args)
    finally:
        ray.shutdown()
    report = _report(args, path, stats, runs, reference)
    _print(report)
    save(report, args.json, args.plot, _plot)
    return 0


def _one_process(model, cache: CacheConfig, prompts, params, batch: int) -> list[list[int]]:
    engine = Engine(ModelRunner(model, range(model.num_layers), cache), None, SpeculationConfig(policy="off"),
                    SchedulerConfig(max_batch_size=batch))
    return [c.token_ids for c in generate(engine, prompts, params)]


def _measure(r: Run, path: str, cache: CacheConfig, prompts, params, args) -> None:
    cfg = EngineConfig(model=ModelConfig(target=path), speculation=SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=args.batch), cache=cache, experts=r.experts)
    target, stop = expert_parallel_runner(cfg, num_cpus=args.num_cpus, timeout_s=600)
    try:
        engine = Engine(target, None, cfg.speculation, cfg.scheduler)
        generate(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        target.executor.ep_stats()  # from zero
        t = time.perf_counter()
        completions = generate(engine, prompts, params)
        r.seconds = time.perf_counter() - t
        for s in target.executor.ep_stats():
            r.stats.add(s)
            r.per_rank_tokens.append(s.model_tokens)
            r.per_rank_served.append(s.served_per_layer)
        r.outputs = [c.token_ids for c in completions]
        r.tokens = sum(len(o) for o in r.outputs)
    finally:
        stop()
    print(f"{r.ranks} ranks, {r.setting}: local activation rate {r.stats.local_rate:.3f}, "
          f"{r.tokens / r.seconds:.1f} tok/s", flush=True)


def _report(args, path: str, stats, runs: list[Run], reference: list[list[int]]) -> dict:
    num_layers = len(stats.layers)
    rows: dict[str, dict[str, dict]] = {}
    for r in runs:
        rows.setdefault(str(r.ranks), {})[r.setting] = {
            "local_activation_rate": round(r.stats.local_rate, 4),
            "alltoall_bytes_per_token": round(r.stats.bytes_per_token, 1),  # over every MoE layer
            # tensor-parallel attention's reduce-scatter and all-gather, over every layer (0 with data parallel)
            "attention_bytes_per_token": round(r.stats.attn_bytes / r.stats.model_tokens, 1),
            "moe_ms_per_token": round(r.stats.seconds_per_token * 1e3, 4),  # summed over the ranks' MoE layers
            "tok_s": round(r.tokens / r.seconds, 2),
            # the busiest rank's share of the tokens over an even share (1.0: balanced): with data-parallel attention
            # the requests' homes (attention and KV); with tensor-parallel attention where tokens landed for the FFN
            "load_imbalance": _imbalance(r.per_rank_tokens),
            # the same for the (token, expert) pairs each rank's experts computed (the expert load), per MoE layer
            # (a layer waits for its busiest rank), averaged over the layers
            "expert_load_imbalance": round(sum(_imbalance([rank.get(layer, 0) for rank in r.per_rank_served])
                                               for layer in stats.layers) / num_layers, 3),
            "identical_to_one_process": r.outputs == reference,
        }
    for settings in rows.values():
        for name, row in settings.items():
            plain = settings[BASELINE[name]]
            gain = row["local_activation_rate"] - plain["local_activation_rate"]
            row["local_rate_gain_points"] = round(gain * 100, 2)
            row["bytes_reduction"] = round(1 - row["alltoall_bytes_per_token"] / plain["alltoall_bytes_per_token"], 4)
            row["moe_time_ratio"] = round(row["moe_ms_per_token"] / plain["moe_ms_per_token"], 4)
    entropy = stats.usage_entropy()
    return {"model": path, "profiled_tokens": stats.tokens, "num_prompts": len(reference),
            "max_tokens": args.max_tokens, "batch": args.batch, "slack": args.slack,
            "balance": args.balance, "confidence": args.confidence, "num_cpus_per_rank": args.num_cpus,
            "moe_layers": num_layers, "num_experts": stats.num_experts,
            "top_k": stats.top_k, "usage_entropy": [round(float(e), 4) for e in entropy], "ranks": rows}


def _imbalance(per_rank: list[float]) -> float:
    return round(max(per_rank) * len(per_rank) / sum(per_rank), 3) if sum(per_rank) else 1.0


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Speculative MoE on {Path(report['model']).name}: {report['num_experts']} experts, "
                        f"top-{report['top_k']}, {report['moe_layers']} MoE layers, held-out prompts")
    for col in ("ranks", "setting", "local rate", "gain (points)", "a2a bytes/token", "reduction",
                "attention bytes/token", "MoE ms/token", "tok/s", "load imbalance", "expert load imbalance",
                "identical"):
        table.add_column(col)
    for ranks, settings in report["ranks"].items():
        for name, r in settings.items():
            table.add_row(ranks, name, f"{r['local_activation_rate']:.3f}", f"{r['local_rate_gain_points']:+.1f}",
                          f"{r['alltoall_bytes_per_token']:.0f}", f"{r['bytes_reduction']:.1%}",
                          f"{r['attention_bytes_per_token']:.0f}",
                          f"{r['moe_ms_per_token']:.3f}", f"{r['tok_s']:.1f}", f"{r['load_imbalance']:.2f}",
                          f"{r['expert_load_imbalance']:.2f}",
                          str(r["identical_to_one_process"]))
    Console(width=200).print(table)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    keys = (("local_activation_rate", "local activation rate"),
            ("alltoall_bytes_per_token", "all-to-all bytes per token"),
            ("moe_ms_per_token", "MoE-layer ms per token"))
    names = list(next(iter(report["ranks"].values())))
    width = 0.8 / len(names)
    for ax, (key, label) in zip(axes, keys):
        for i, setting in enumerate(names):
            xs = [j + i * width for j in range(len(report["ranks"]))]
            ax.bar(xs, [report["ranks"][r][setting][key] for r in report["ranks"]], width, label=setting)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(report["ranks"]))],
                      [f"{r} ranks" for r in report["ranks"]])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Speculative MoE: {Path(report['model']).name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
