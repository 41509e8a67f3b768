"""`specfleet experts profile|plan|apply|status`: routing statistics and expert plans for expert parallelism.

    specfleet experts profile --model M --out routing.safetensors      # offline, from the shared datasets
    specfleet experts profile --online INSTANCE --out routing.safetensors   # from the app's served traffic
    specfleet experts plan --stats routing.safetensors --ranks 2 --out plan.json
    specfleet experts apply --plan plan.json --config C.yaml --out C-grouped.yaml   # then `specfleet serve`
    specfleet experts status --stats routing.safetensors [--plan plan.json]

A plan takes effect when an instance's ranks load (each reorders its experts by it, actors/moe/permute.py):
`apply` checks it against the config's model and rank count and writes the config that uses it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from deploy.bench.prompts import DATASETS
from deploy.cli.admin_cmd import _guard, add_endpoint_flags, client
from deploy.cli.flags import UsageError, parse_balance, read_json_file
from deploy.cli.tables import show, table
from placement.experts import ExpertPlan, contiguous_plan, group_experts, objective


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    prof = actions.add_parser("profile", help="routing statistics of a MoE model over prompts (offline), or of "
                              "an expert-parallel instance's served traffic (--online)")
    source = prof.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a MoE model: folder, GGUF or catalog name (offline, over --prompts)")
    source.add_argument("--online", metavar="INSTANCE", help="the served instance whose traffic to take (the "
                        "statistics since the last --online read of it)")
    add_endpoint_flags(prof)
    prof.add_argument("--prompts", type=Path, nargs="+",
                      default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    prof.add_argument("--num-prompts", type=int, default=96)
    prof.add_argument("--max-prompt-tokens", type=int, default=256)
    prof.add_argument("--out", type=Path, required=True, help="the statistics file to write (.safetensors)")
    prof.set_defaults(run=_guard(run_profile))

    plan = actions.add_parser("plan", help="group co-activated experts on ranks (Speculative MoE)")
    plan.add_argument("--stats", type=Path, required=True, help="routing statistics from `experts profile`")
    plan.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks")
    plan.add_argument("--out", type=Path, required=True, help="the plan file to write (.json)")
    plan.add_argument("--balance", type=parse_balance, default=None,
                      help="also cap each rank's expert load per layer at (1 + BALANCE) times an even share, e.g. "
                           "0.5 (default none: expert counts only)")
    plan.set_defaults(run=run_plan)

    apply = actions.add_parser("apply", help="write a config whose instances load their experts by a plan")
    apply.add_argument("--plan", type=Path, required=True)
    apply.add_argument("--config", type=Path, required=True, help="the config to start from")
    apply.add_argument("--stats", type=Path, help="also pre-schedule by these routing statistics")
    apply.add_argument("--attention", choices=["data", "tensor"],
                       help="data: whole requests per rank, placed by --stats; tensor: heads split over the ranks, "
                            "single tokens placed by --stats (token shuffling)")
    apply.add_argument("--out", type=Path, required=True, help="the config to write")
    apply.set_defaults(run=run_apply)

    status = actions.add_parser("status", help="what a statistics file (and a plan) say")
    status.add_argument("--stats", type=Path, required=True)
    status.add_argument("--plan", type=Path)
    status.set_defaults(run=run_status)


def run_profile(args: argparse.Namespace) -> int:
    if args.online:
        return _profile_online(args)
    from actors.model.loader import load_model
    from actors.model.runner import ModelRunner
    from actors.moe.profile import profile
    from cluster.config import CacheConfig
    from deploy.bench.prompts import load_prompts
    from deploy.model_store import resolve_model

    path = resolve_model(args.model)
    model = load_model(path, "fp32")
    texts = load_prompts(args.prompts, args.num_prompts)
    prompts = [model.encode(t, chat=True)[:args.max_prompt_tokens] for t in texts]
    runner = ModelRunner(model, range(model.num_layers), CacheConfig(block_size=16, num_blocks=64))
    try:
        stats = profile(runner, prompts)
    except ValueError as e:
        raise UsageError(f"{args.model}: {e}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stats.save(args.out, model=path)
    print(f"profiled {stats.tokens} tokens of {len(prompts)} prompts over {len(stats.layers)} MoE layers "
          f"-> {args.out}")
    return 0


def _profile_online(args: argparse.Namespace) -> int:
    with client(args) as c:
        data = c.routing(args.online)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    stats = _stats(args.out)
    print(f"{args.online}: routing of {stats.tokens} served tokens over {len(stats.layers)} MoE layers -> {args.out}")
    return 0


def _stats(path: Path):
    from actors.moe.profile import ExpertRoutingStats

    try:
        return ExpertRoutingStats.load_file(path)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"{path}: not routing statistics this build reads ({e})") from None


def _plan(path: Path) -> ExpertPlan:
    return read_json_file(path, ExpertPlan, f"{path}: no such plan file", "a valid expert plan")


def run_plan(args: argparse.Namespace) -> int:
    stats = _stats(args.stats)
    if not 1 <= args.ranks <= stats.num_experts:
        raise UsageError(f"--ranks {args.ranks}: need 1 to {stats.num_experts} (the experts per layer)")
    coact, affinity, load = stats.coact.numpy(), stats.affinity.numpy(), stats.load.numpy()
    plan = group_experts(stats.layers, coact, affinity, load, args.ranks, balance=args.balance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(plan.model_dump_json(indent=1))
    _print_plan(stats, plan)
    print(f"plan for {args.ranks} ranks -> {args.out}")
    return 0


def run_apply(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from actors.model.loader import load_model_config as model_config
    from deploy.model_store import resolve_model

    plan = _plan(args.plan)
    cfg = load_config(args.config)
    model = model_config(resolve_model(cfg.engine.model.target))
    num_experts = getattr(model, "num_local_experts", None) or getattr(model, "num_experts", None)
    if not num_experts:
        raise UsageError(f"{cfg.engine.model.target} is not a MoE model: there are no experts to place")
    if plan.num_experts != num_experts or max(plan.layers) >= model.num_hidden_layers:
        raise UsageError(f"{args.plan} places {plan.num_experts} experts over layers {list(plan.layers)}; the model "
                         f"has {num_experts} experts and {model.num_hidden_layers} layers")
    raw = yaml.safe_load(args.config.read_text())
    experts = raw["engine"].setdefault("experts", {})
    experts.update({"ranks": plan.num_ranks, "plan": str(args.plan.resolve())})
    if args.stats is not None:
        experts["stats"] = str(_stats_path(args.stats))
    if args.attention is not None:
        experts["attention"] = args.attention
    raw.setdefault("fleet", {})["pipeline_stages"] = plan.num_ranks
    from cluster.config import parse_config

    parse_config(raw, source=str(args.out))  # what is written must load
    args.out.write_text(yaml.safe_dump(raw, sort_keys=False))
    print(f"{args.out}: {plan.num_ranks} expert-parallel ranks with {args.plan}; deploy it with "
          f"`specfleet serve --config {args.out}`")
    return 0


def _stats_path(path: Path) -> Path:
    _stats(path)  # readable, or a clear error
    return path.resolve()


def run_status(args: argparse.Namespace) -> int:
    stats = _stats(args.stats)
    load = stats.load.double()
    usage = load / load.sum(-1, keepdim=True).clamp_min(1)
    entropy = stats.usage_entropy()
    t = table("MoE layer", "usage entropy (1 = uniform)", "busiest expert share", "co-activated pairs",
              title=f"{args.stats}: {stats.tokens} tokens, {stats.num_experts} experts, top-{stats.top_k}")
    for pos, layer in enumerate(stats.layers):
        t.add_row(str(layer), f"{float(entropy[pos]):.3f}", f"{float(usage[pos].max()):.3f}",
                  str(int(stats.coact[pos].sum()) // 2))
    show(t)
    if args.plan is not None:
        _print_plan(stats, _plan(args.plan))
    return 0


def _print_plan(stats, plan: ExpertPlan) -> None:
    """Each rank's experts per layer, and the co-activation and affinity mass kept on one rank vs contiguous."""
    coact, affinity = stats.coact.numpy(), stats.affinity.numpy()
    plain = contiguous_plan(plan.layers, plan.num_experts, plan.num_ranks)
    kept = objective(np.asarray(plan.ranks), coact, affinity)
    base = objective(np.asarray(plain.ranks), coact, affinity)
    t = table("MoE layer", *(f"rank {r}" for r in range(plan.num_ranks)), title=f"expert plan: {plan.num_ranks} ranks")
    for pos, layer in enumerate(plan.layers):
        t.add_row(str(layer), *(" ".join(map(str, plan.experts_of(pos, r))) for r in range(plan.num_ranks)))
    show(t)
    print(f"co-activation and affinity pair mass kept on one rank: {kept:.0f} vs {base:.0f} with contiguous experts "
          f"({kept / max(base, 1):.2f}x)")
