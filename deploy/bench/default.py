"""`specfleet bench default`: off vs fixed vs goodput for every draft kind, on the default model and the Qwen pair,
at batch 1 and batch 8, in one run.

For each setup (model pair and dtype) the target is loaded once and shared by every mode; a mode is a draft
kind (the setup's draft model, n-gram lookup, suffix lookup) with a policy (fixed k, goodput), plus plain
decoding (`off`). At batch 1 the modes run interleaved prompt by prompt, at batch 8 all prompts at once per
mode, so drift in machine speed hits every mode alike. Ratios come from totals (generated tokens / wall
seconds) within the run; with `--repeats`, each pass's ratio too (the table's range, JSON `vs_off_by_pass`), so the
run shows its own noise beside the pooled ratio. Agreement is against `off` at the same batch size (in fp32 it
must be 1.0: the engine is lossless; in bf16 a different batch shape may round differently).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.model.device import device_name, resolve_device
from actors.engine.core import Engine
from actors.model.loader import load_model
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from actors.speculation.cost_model import StepCostModel
from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from deploy.bench.output import Measured, save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.bench.spec import _agreement
from deploy.model_store import resolve_model

# name -> (target, draft model or None for a layer self-draft of every target layer, int8 draft)
SETUPS = {
    "default": ("smollm2-135m-instruct", None, True),
    "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", False),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS),
                   help="default: SmolLM2-135M with its int8 all-layer self-draft; qwen: Coder 1.5B with the 0.5B")
    p.add_argument("--target", help="instead of --setups: any model `generate` takes (catalog name, GGUF, folder)")
    p.add_argument("--draft", help="with --target: its draft model (default: an all-layer self-draft)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="where weights, KV cache and sampling run (auto: the GPU if there is one)")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"],
                   help="JSONL(.gz) files: MT-Bench ('turns') and/or HumanEval ('prompt'); taken in turn")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per setup (batch 8 runs them at once)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default model)")
    p.add_argument("--qwen-num-prompts", type=int, default=8)
    p.add_argument("--qwen-max-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompts per batch size, modes interleaved (in reverse order on odd passes)")
    p.add_argument("--continuous", action="store_true",
                   help="queue every prompt at once, so a finished request's slot is refilled as in a server, with "
                        "output lengths drawn from [max_tokens / 4, max_tokens] per prompt (seeded); default: groups "
                        "of `batch` prompts that all run to max_tokens")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--kinds", nargs="+", choices=["model", "ngram", "suffix"], default=["model", "ngram", "suffix"])
    p.add_argument("--start", action="store_true",
                   help="also time to first token from a cold and a warm start per setup (deploy/bench/start.py)")
    p.add_argument("--weights", choices=["dequantized", "stored", "int8", "int4"], default="dequantized",
                   help="engine.model.weights of the target and its draft (actors/model/weights.py)")
    p.add_argument("--deterministic", choices=["off", "on", "both"], default="off",
                   help="engine.deterministic (the batch-invariant forward); both: every mode also as '<mode> det', "
                        "its agreement against 'off det', its speed against 'off'")
    p.add_argument("--json", type=Path, help="write the results here")


@dataclass
class Mode(Measured):
    """One engine setting measured at one batch size."""

    name: str
    engine: Engine
    by_pass: list[Measured] = field(default_factory=list)  # the same tokens and seconds, per pass over the prompts


def cpu_model() -> str:
    """The CPU's model name and its bf16 flags (figures depend on them)."""
    name, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    bf16 = sorted(f for f in flags if "bf16" in f or f == "amx_tile")
    return f"{name} ({', '.join(bf16) or 'no bf16 flags'})"


@dataclass(frozen=True)
class Setup:
    """A model pair to measure, with its prompt count and length."""

    name: str
    target: str
    draft: str | None  # None: a self-draft of every target layer
    int8: bool  # the model draft quantized to int8
    num_prompts: int
    max_tokens: int


def setups(args: argparse.Namespace) -> list[Setup]:
    """The setups a run measures: `--target` (and `--draft`) alone, or the named ones."""
    if args.target:
        return [Setup("custom", args.target, args.draft, False, args.num_prompts, args.max_tokens)]
    if args.draft:
        raise SystemExit("--draft needs --target")
    return [Setup(name, *SETUPS[name], args.qwen_num_prompts if name == "qwen" else args.num_prompts,
                  args.qwen_max_tokens if name == "qwen" else args.max_tokens) for name in args.setups]


def _build(setup: Setup, args: argparse.Namespace, batch: int, costs: dict[str, StepCostModel]) -> dict[str, Engine]:
    cache = CacheConfig(block_size=16, num_blocks=(setup.num_prompts * (setup.max_tokens + 1024)) // 16 + 64)
    target, draft = _models(setup, args.dtype, args.device, args.weights)
    engines = {}
    for det in {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]:
        target_runner = ModelRunner(target, range(target.num_layers), cache, deterministic=det)
        suffix = " det" if det and args.deterministic == "both" else ""
        engines.update({name + suffix: e for name, e in _engines(setup, args, batch, costs, cache, target_runner,
                                                                draft, suffix).items()})
    return engines


def _engines(setup: Setup, args: argparse.Namespace, batch: int, costs: dict[str, StepCostModel],
             cache: CacheConfig, target_runner: ModelRunner, draft, suffix: str) -> dict[str, Engine]:
    """`off` and each draft kind with each policy on one target runner (goodput's cost model calibrated once per
    draft kind and `suffix`)."""
    draft_name, int8 = setup.draft, setup.int8
    sched = SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=max(256, batch))
    engines = {"off": Engine(target_runner, None, SpeculationConfig(policy="off"), sched,
                             deterministic=target_runner.deterministic)}
    for kind in args.kinds:
        runner = None
        if kind == "model":
            runner = ModelRunner(draft, range(draft.num_layers), cache)
            if int8:
                quantize_runner(runner, "int8")
        label = "int8 self-draft" if kind == "model" and int8 and not draft_name else \
            ("draft model" if kind == "model" else kind)
        for policy in ("fixed", "goodput"):
            spec = SpeculationConfig(method=kind, policy=policy, k=args.k)
            cost = costs.get(kind + suffix) if policy == "goodput" else None  # calibrated once per draft kind
            e = Engine(target_runner, runner, spec, sched, cost_model=cost, deterministic=target_runner.deterministic)
            if policy == "goodput":
                costs[kind + suffix] = e.cost_model
            engines[f"{label} {policy}"] = e
    return engines


_MODELS: dict = {}


def _models(setup: Setup, dtype: str, device: str, weights: str = "dequantized") -> tuple:
    """The setup's (target, draft) LoadedModels on `device` with `weights`, loaded once per run."""
    if (setup, dtype, weights) not in _MODELS:
        target_name, draft_name = setup.target, setup.draft
        t0 = time.perf_counter()
        where = resolve_device(device)
        target = load_model(resolve_model(target_name, dtype), dtype, where, weights)
        draft = load_model(resolve_model(draft_name, dtype), dtype, where, weights) if draft_name else target
        _MODELS[(setup, dtype, weights)] = (target, draft)
        print(f"{setup.name}: loaded in {time.perf_counter() - t0:.0f}s", flush=True)
    return _MODELS[(setup, dtype, weights)]


def _measure(setup: Setup, args: argparse.Namespace, prompts: list[list[int]], batch: int,
             costs: dict[str, StepCostModel]) -> dict[str, Mode]:
    modes = {name: Mode(name, e) for name, e in _build(setup, args, batch, costs).items()}
    params: SamplingParams | list[SamplingParams] = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens,
                                                                   ignore_eos=True)
    for m in modes.values():  # warm-up on a real prompt: first-call kernel set-up is not what we measure
        generate(m.engine, [prompts[0]] * min(batch, 2), SamplingParams(temperature=0.0, max_tokens=4))
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    if args.continuous:  # one group of every prompt: the engine keeps `batch` running, refilling as requests end
        rng = random.Random(0)
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(max(1, setup.max_tokens // 4),
                                                                          setup.max_tokens), ignore_eos=True)
                  for _ in prompts]
        groups = [prompts]
    order = list(modes.values())
    for n, group in enumerate([g for _ in range(args.repeats) for g in groups]):
        if n % len(groups) == 0:  # a new pass: the suffix drafter's shared tree must not hold these prompts' answers
            for m in modes.values():
                m.by_pass.append(Measured())
                if getattr(m.engine.drafter, "shared", None) is not None:
                    m.engine.drafter.shared.clear()
        order.reverse()  # alternate the order so that drift in machine speed favours no mode
        for m in order:
            t = time.perf_counter()
            done = generate(m.engine, group, params)
            took = time.perf_counter() - t
            m.seconds += took
            m.by_pass[-1].seconds += took
            for c in done:
                m.tokens += len(c.token_ids)
                m.by_pass[-1].tokens += len(c.token_ids)
                m.stats.merge(c.stats)
                m.outputs.append(c.token_ids)
    print(f"{setup.name} batch {batch}: " + ", ".join(f"{n} {m.tok_s:.1f}" for n, m in modes.items()), flush=True)
    return modes


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    report = {"command": "specfleet bench default", "dtype": args.dtype, "weights": args.weights, "k": args.k,
              "cpu": cpu_model(),
              "deterministic": args.deterministic,
              "device": device_name(resolve_device(args.device)),
              "threads": torch.get_num_threads(), "setups": {}}
    for setup in setups(args):
        n = setup.num_prompts
        target = _models(setup, args.dtype, args.device, args.weights)[0]
        prompts = [target.encode(p, chat=True) for p in load_prompts(args.prompts, n)]
        costs: dict[str, StepCostModel] = {}
        rows = {}
        for batch in args.batches:
            modes = _measure(setup, args, prompts, batch, costs)
            off = modes["off"]
            rows[batch] = {}
            for name, m in modes.items():  # a deterministic mode's agreement: against deterministic plain decoding
                same, prefix = _agreement(modes["off det"].outputs if name.endswith(" det") else off.outputs,
                                          m.outputs)
                rows[batch][name] = {
                    "tok_s": round(m.tok_s, 2), "vs_off": round(m.tok_s / off.tok_s, 3) if off.tok_s else None,
                    "acceptance": round(m.stats.acceptance_rate, 3) if m.stats.proposed else None,
                    "mean_k": round(sum(m.stats.k_history) / len(m.stats.k_history), 2) if m.stats.k_history else 0.0,
                    "identical_to_off": same, "token_agreement": round(prefix, 4),
                    "repeatable": _repeatable(m.outputs, args.repeats),
                    "vs_off_by_pass": _by_pass(m, off),
                }
            rows[batch]["_goodput_vs_best"] = _goodput_vs_best(rows[batch])
        report["setups"][setup.name] = {"target": setup.target, "num_prompts": n, "max_tokens": setup.max_tokens,
                                        "repeats": args.repeats, "batches": rows}
        if args.start:
            report["setups"][setup.name]["start"] = _start_figures(setup, args.dtype,
                                                                   load_prompts(args.prompts, 1)[0])
        if len(args.batches) > 1 and 1 in args.batches:
            report["setups"][setup.name]["off_saturation"] = {
                b: round(rows[b]["off"]["tok_s"] / rows[1]["off"]["tok_s"], 2) for b in args.batches if b != 1}
    _print(report)
    save(report, args.json, None, lambda *_: None)
    return 0


def _repeatable(outputs: list[list[int]], passes: int) -> float | None:
    """The share of prompts whose output was the same in every pass (None with one pass)."""
    if passes < 2:
        return None
    n = len(outputs) // passes
    runs = [outputs[p * n:(p + 1) * n] for p in range(passes)]
    return round(sum(all(r[i] == runs[0][i] for r in runs) for i in range(n)) / n, 3)


def _by_pass(m: Mode, off: Mode) -> list[float] | None:
    """The mode's tokens/s over off's in each pass over the prompts, the two run side by side (None with one pass):
    their spread is the bench's own noise, next to the pooled ratio."""
    if len(m.by_pass) < 2:
        return None
    return [round(a.tok_s / b.tok_s, 3) if b.tok_s else None for a, b in zip(m.by_pass, off.by_pass)]


def _start_figures(setup: Setup, dtype: str, prompt: str) -> dict[str, float]:
    """Cold and warm time to first token of the setup with speculation off (helper `start`'s measure_start)."""
    from cluster.config import EngineConfig
    from deploy.bench.start import measure_start

    cfg = EngineConfig.model_validate({"model": {"target": setup.target, "draft": setup.draft, "dtype": dtype},
                                       "speculation": {"policy": "off"}})
    figures = measure_start(cfg, prompt)
    return {"cold_first_token_s": round(figures.cold.first_token_s, 2),
            "warm_first_token_s": round(figures.warm.first_token_s, 2)}


def _goodput_vs_best(rows: dict) -> dict[str, float]:
    """Per draft kind: goodput's tokens/s over the better of off and fixed (the policy's promise: >= 0.95)."""
    out = {}
    for name, r in rows.items():
        if name.endswith(" goodput"):
            kind = name[: -len(" goodput")]
            best = max(rows["off"]["tok_s"], rows[f"{kind} fixed"]["tok_s"])
            out[kind] = round(r["tok_s"] / best, 3) if best else None
    return out


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]bench default[/] {report['dtype']}, k <= {report['k']}, {report['threads']} threads, "
                  f"CPU {report['cpu']}, device {report['device']}")
    for setup, s in report["setups"].items():
        for batch, rows in s["batches"].items():
            t = Table(title=f"{setup} ({s['target']}), batch {batch}, {s['num_prompts']} prompts x "
                            f"{s['max_tokens']} tokens")
            for col in ("mode", "tok/s", "vs off", "accept", "mean k", "identical", "agreement", "repeatable"):
                t.add_column(col, justify="left" if col == "mode" else "right")
            for name, r in rows.items():
                if name.startswith("_"):
                    continue
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                vs = f"{r['vs_off']:.2f}x"
                if r["vs_off_by_pass"] and name != "off":
                    vs += f" ({min(r['vs_off_by_pass']):.2f}-{max(r['vs_off_by_pass']):.2f})"
                t.add_row(name, f"{r['tok_s']:.1f}", vs, acc, f"{r['mean_k']:.2f}",
                          f"{r['identical_to_off']:.2f}", f"{r['token_agreement']:.3f}",
                          "-" if r["repeatable"] is None else f"{r['repeatable']:.2f}")
            console.print(t)
            console.print("goodput / best of (off, fixed): " +
                          ", ".join(f"{k} {v:.2f}" for k, v in rows["_goodput_vs_best"].items()))
        if "start" in s:
            console.print(f"{setup}: time to first token, cold {s['start']['cold_first_token_s']} s, "
                          f"warm {s['start']['warm_first_token_s']} s")
        if "off_saturation" in s:
            console.print(f"{setup}: off at batch b / batch 1: {s['off_saturation']}")
