"""`specfleet bench spec`: plain decoding vs speculative decoding vs transformers' assisted generation, one run.

All modes share the loaded weights and run on the same prompts at batch 1, interleaved prompt by
prompt (a, b, ..., c for prompt 1, then prompt 2, ...) so that drift in machine speed hits every
mode alike. Ratios are taken from totals (generated tokens / wall seconds) within the one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.model.device import device_name, resolve_device
from actors.engine.core import Engine
from actors.model.loader import LoadedModel, load_model
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import CacheConfig, SpeculationConfig
from cluster.request import SamplingParams, SpecStats
from deploy.bench.output import Measured, save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.model_store import resolve_model

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model (catalog name, GGUF, folder)")
    p.add_argument("--draft", required=True, help="draft model sharing the target's tokenizer")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"],
                   help="JSONL(.gz) files: MT-Bench ('turns') and/or HumanEval ('prompt'); taken in turn")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="where weights, KV cache and sampling run (auto: the GPU if there is one)")
    p.add_argument("--draft-quantization", choices=["none", "int8"], default="int8",
                   help="int8 also runs the unquantized draft as an extra row")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' assisted generation")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a bar chart here (PNG)")


@dataclass
class ModeResult(Measured):
    name: str
    peak_rss_gb: float = 0.0


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux: /proc/self/clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _engine_mode(target: ModelRunner, draft: ModelRunner | None, k: int) -> Callable:
    engine = Engine(target, draft, SpeculationConfig(policy="fixed" if draft else "off", k=k))

    def run(ids: list[int], max_tokens: int) -> tuple[list[int], SpecStats]:
        r = generate(engine, [ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        return r.token_ids, r.stats
    return run


def _peer_mode(target: LoadedModel, draft: LoadedModel) -> Callable:
    def run(ids: list[int], max_tokens: int) -> tuple[list[int], SpecStats]:
        x = torch.tensor([ids], device=target.device)
        out = target.hf_model.generate(
            x, attention_mask=torch.ones_like(x), assistant_model=draft.hf_model, do_sample=False,
            max_new_tokens=max_tokens, pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id,
        )
        return out[0, len(ids):].tolist(), SpecStats()
    return run


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of prompts with identical output, mean fraction of tokens before the first difference)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return same / len(a), sum(prefix) / len(prefix)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    target = load_model(resolve_model(args.target, args.dtype), args.dtype, device)
    draft = load_model(resolve_model(args.draft, args.dtype), args.dtype, device)
    print(f"loaded target and draft in {time.perf_counter() - t0:.0f}s", flush=True)
    cache = CacheConfig(block_size=16, num_blocks=(args.max_tokens + 4096) // 16)
    target_runner = ModelRunner(target, range(target.num_layers), cache)

    def draft_runner(quantize: bool) -> ModelRunner:
        r = ModelRunner(draft, range(draft.num_layers), cache)
        if quantize:
            quantize_runner(r, "int8")
        return r

    int8 = args.draft_quantization == "int8"
    modes: dict[str, Callable] = {"a_plain": _engine_mode(target_runner, None, 0),
                                  "b_spec": _engine_mode(target_runner, draft_runner(int8), args.k)}
    if int8:
        modes["b_spec_draft_" + args.dtype] = _engine_mode(target_runner, draft_runner(False), args.k)
    if not args.no_peer:
        modes["c_hf_assisted"] = _peer_mode(target, draft)
    results = {name: ModeResult(name) for name in modes}

    prompts = load_prompts(args.prompts, args.num_prompts)
    for fn in modes.values():  # warm-up: first-call kernel set-up is not what we measure
        fn(target.encode("Hello", chat=True), 8)
    for i, prompt in enumerate(prompts):
        ids = target.encode(prompt, chat=True)
        for name, fn in modes.items():
            _reset_peak_rss()
            t = time.perf_counter()
            out, stats = fn(ids, args.max_tokens)
            dt = time.perf_counter() - t
            r = results[name]
            r.tokens, r.seconds = r.tokens + len(out), r.seconds + dt
            r.peak_rss_gb = max(r.peak_rss_gb, _peak_rss_gb())
            r.stats.merge(stats)
            r.outputs.append(out)
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{n} {results[n].tok_s:.2f}" for n in modes), flush=True)

    report = _report(args, results)
    _print_table(report)
    save(report, args.json, args.plot, _plot)
    return 0


def _report(args: argparse.Namespace, results: dict[str, ModeResult]) -> dict:
    plain = results["a_plain"].outputs
    modes = {}
    for name, r in results.items():
        same, prefix = _agreement(plain, r.outputs)
        modes[name] = {
            "tokens": r.tokens, "seconds": round(r.seconds, 2), "tok_s": round(r.tok_s, 3),
            "peak_rss_gb": round(r.peak_rss_gb, 2), "identical_to_plain": same, "token_agreement": round(prefix, 4),
            **({"spec": r.stats.as_dict()} if r.stats.rounds else {}),
        }
    b = results["b_spec"].tok_s
    ratios = {f"b_spec/{n}": round(b / r.tok_s, 3) for n, r in results.items() if n != "b_spec" and r.tok_s}
    return {
        "command": "specfleet bench spec", "target": args.target, "draft": args.draft, "k": args.k,
        "dtype": args.dtype, "draft_quantization": args.draft_quantization, "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "device": device_name(resolve_device(args.device)),
        "modes": modes, "ratios": ratios,
    }


def _print_table(report: dict) -> None:
    print(f"\n{'mode':<22}{'tok/s':>8}{'tokens':>8}{'peak GB':>9}{'identical':>10}{'accept':>8}{'mean len':>9}")
    for name, m in report["modes"].items():
        s = m.get("spec", {})
        print(f"{name:<22}{m['tok_s']:>8.2f}{m['tokens']:>8}{m['peak_rss_gb']:>9.2f}{m['identical_to_plain']:>10.2f}"
              f"{s.get('acceptance_rate', float('nan')):>8.3f}{s.get('mean_accepted_length', float('nan')):>9.2f}")
    print("ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in report["ratios"].items()))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["modes"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [report["modes"][n]["tok_s"] for n in names], color=["#888", "#2a7", "#7b5", "#57a"][: len(names)])
    ax.set_ylabel("tokens / s (batch 1)")
    ax.set_title(f"k={report['k']}, {report['dtype']}, {report['num_prompts']} prompts x {report['max_tokens']} tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
