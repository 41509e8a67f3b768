"""`specfleet bench easyspec`: sequential drafting vs EasySpec layer-parallel drafting (arXiv 2502.02493), in one run.

The target runs in this process; the draft runs as shard actors on the local cluster (`draft_group_runner`): one
actor for sequential drafting (group size 1), and for a group of N one actor per member, each with
`--num-cpus` CPUs, so the members of a group compute at the same time. Every setting (group size x mode x
calibration) decodes the same prompts at temperature 0 with a fixed k, one setting after another (each
setting's draft actors hold their own copy of their layers: all at once would not fit). Reported per setting: draft-stage seconds per drafted
token (the engine's own figure), acceptance rate and mean accepted length, end-to-end tokens/s, their ratios
to sequential drafting, and agreement with its output (lossless: identical in fp32).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from actors.serving.build import draft_group_runner
from actors.engine.core import Engine
from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import (CacheConfig, DraftParallelConfig, EngineConfig, ModelConfig, SchedulerConfig,
                            SpeculationConfig)
from cluster.request import SamplingParams, SpecStats
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.bench.spec import _agreement
from deploy.cli.flags import UsageError, parse_numbers
from deploy.infra import local_cluster
from deploy.model_store import resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model (catalog name, GGUF, folder)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model sharing the target's tokenizer")
    p.add_argument("--groups", default="1,2,3", help="group sizes, comma-separated (1: sequential drafting)")
    p.add_argument("--mode", default="attention,layer", help="EasySpec modes for groups > 1: attention, layer")
    p.add_argument("--calibrate", default="on,off", help="bonus calibration for groups > 1: on, off, or both")
    p.add_argument("--sequential-head", type=int, default=2)
    p.add_argument("--sequential-tail", type=int, default=2)
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of each draft actor (its torch threads)")
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)


@dataclass
class Setting:
    """One way to draft, its engine, and what it measured."""

    name: str
    parallel: DraftParallelConfig
    tokens: int = 0
    draft_s: float = 0.0  # draft-stage seconds over the measured prompts
    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    outputs: list[list[int]] = field(default_factory=list)


def _settings(args) -> list[Setting]:
    groups = parse_numbers(args.groups, "--groups", int, "sizes like 1,2,3")
    modes = [m for m in args.mode.split(",") if m]
    calibrations = {"on": [True], "off": [False], "on,off": [True, False], "off,on": [False, True]}.get(args.calibrate)
    if calibrations is None or any(m not in ("attention", "layer") for m in modes):
        raise UsageError("--mode takes attention and/or layer; --calibrate on, off or on,off")
    out = [Setting("sequential", DraftParallelConfig())]
    for g, mode, cal in itertools.product([g for g in groups if g > 1], modes, calibrations):
        out.append(Setting(f"group {g} {mode}" + ("" if cal else " uncalibrated"),
                           DraftParallelConfig(group_size=g, sequential_head=args.sequential_head,
                                               sequential_tail=args.sequential_tail, mode=mode, calibrate=cal)))
    return out


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    state = local_cluster.read_state(args.state)
    target_path, draft_path = resolve_model(args.target, args.dtype), resolve_model(args.draft, args.dtype)
    target = load_model(target_path, args.dtype)
    prompts = [target.encode(t, chat=True)[:args.max_prompt_tokens] for t in load_prompts(args.prompts, args.num_prompts)]
    cache = CacheConfig(block_size=16, num_blocks=(args.max_prompt_tokens + args.max_tokens + 2 * args.k) // 16 + 8)
    target_runner = ModelRunner(target, range(target.num_layers), cache)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    try:
        for s in settings:  # one setting's actors at a time: a draft copy per actor would not fit in memory
            _measure(s, target_path, draft_path, target_runner, cache, prompts, params, args, target)
    finally:
        ray.shutdown()
    report = _report(args, settings, target_path, draft_path)
    _print(report)
    save(report, args.json, args.plot, _plot)
    return 0


def _measure(s: Setting, target_path: str, draft_path: str, target_runner: ModelRunner, cache: CacheConfig, prompts,
             params, args, target) -> None:
    cfg = EngineConfig(model=ModelConfig(target=target_path, draft=draft_path, dtype=args.dtype),
                       speculation=SpeculationConfig(policy="fixed", k=args.k, draft_parallel=s.parallel),
                       scheduler=SchedulerConfig(max_batch_size=1), cache=cache)
    draft_runner, stop = draft_group_runner(cfg, num_cpus=args.num_cpus, timeout_s=900, step_timeout_s=600)
    try:
        engine = Engine(target_runner, draft_runner, cfg.speculation, cfg.scheduler)
        [warm] = generate(engine, [target.encode("Hello", chat=True)], SamplingParams(temperature=0.0, max_tokens=8))
        for ids in prompts:
            t = time.perf_counter()
            [c] = generate(engine, [ids], params)
            s.seconds += time.perf_counter() - t
            s.tokens += len(c.token_ids)
            s.stats.merge(c.stats)
            s.outputs.append(c.token_ids)
        # the engine's draft seconds per drafted token covers the warm-up too: take its share out
        per_token = engine.stats().spec.draft_s_per_token
        total = per_token * (warm.stats.proposed + s.stats.proposed)
        s.draft_s = total - per_token * warm.stats.proposed
    finally:
        stop()
    print(f"{s.name}: {s.tokens / s.seconds:.2f} tok/s, draft {s.draft_s / max(s.stats.proposed, 1) * 1e3:.1f} ms "
          f"per drafted token, acceptance {s.stats.accepted / max(s.stats.proposed, 1):.3f}", flush=True)


def _report(args, settings: list[Setting], target: str, draft: str) -> dict:
    base = settings[0]
    rows = {}
    for s in settings:
        st = s.stats
        same, prefix = _agreement(base.outputs, s.outputs)
        rows[s.name] = {
            "parallel": s.parallel.model_dump(), "tokens": s.tokens, "seconds": round(s.seconds, 2),
            "tok_s": round(s.tokens / s.seconds, 3), "draft_ms_per_token": round(s.draft_s / st.proposed * 1e3, 3),
            "acceptance": round(st.accepted / st.proposed, 4) if st.proposed else None,
            "mean_accepted_length": round(st.accepted / st.rounds + 1, 3) if st.rounds else None,
            "identical_to_sequential": same, "token_agreement": round(prefix, 4),
        }
    seq = rows[base.name]
    for r in rows.values():
        r["draft_speedup"] = round(seq["draft_ms_per_token"] / r["draft_ms_per_token"], 3)
        r["tok_s_ratio"] = round(r["tok_s"] / seq["tok_s"], 3)
        r["acceptance_drop_rel"] = round(1 - r["acceptance"] / seq["acceptance"], 4) if seq["acceptance"] else None
    return {"target": target, "draft": draft, "dtype": args.dtype, "k": args.k, "num_prompts": len(base.outputs),
            "max_tokens": args.max_tokens, "num_cpus_per_draft_actor": args.num_cpus, "settings": rows}


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"EasySpec on {Path(report['target']).name} / {Path(report['draft']).name}, k = {report['k']}")
    for col in ("setting", "draft ms/token", "draft speed-up", "acceptance", "drop", "accepted length", "tok/s",
                "vs sequential", "identical"):
        table.add_column(col)
    for name, r in report["settings"].items():
        table.add_row(name, f"{r['draft_ms_per_token']:.1f}", f"{r['draft_speedup']:.2f}x", f"{r['acceptance']:.3f}",
                      f"{r['acceptance_drop_rel']:.1%}", f"{r['mean_accepted_length']:.2f}", f"{r['tok_s']:.2f}",
                      f"{r['tok_s_ratio']:.2f}x", f"{r['identical_to_sequential']:.2f}")
    Console().print(table)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["settings"])
    rows = [report["settings"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("draft_ms_per_token", "acceptance", "tok_s"),
                              ("draft ms per drafted token", "acceptance", "tokens/s end to end")):
        ax.bar(range(len(names)), [r[key] for r in rows])
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel(label)
    fig.suptitle(f"EasySpec: {Path(report['target']).name} / {Path(report['draft']).name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
