"""`specfleet bench models`: one model on the native path (the hand-written layers) and on the generic path
(transformers' own decoder layers on our paged cache), side by side in one run, batch 1, the same chat prompts.

First the check: in fp32 on the dequantized weights (the same maths on both paths, to rounding), the native path's
greedy tokens on every prompt must equal the generic path's (exit status 1 if not). Then the rates: rows decode the
same prompts greedily, exactly `--max-tokens` new tokens each, timed per request with its prefill, interleaved
prompt by prompt with their order rotating (drift in the machine's speed hits every row alike); plain and
speculative (n-gram lookup, k = 4), native with the weights dequantized and as stored (the GGUF file's blocks on our
kernels), generic dequantized (the only way it runs), and llama.cpp on the same file as the anchor where installed
(deploy/bench/llama_anchor.py). The machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from actors.model.loader import LoadedModel, load_model
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig, SpeculationConfig
from cluster.request import SamplingParams, SpecStats
from deploy.bench import llama_anchor
from deploy.bench.cpu import Row, _engine, cpu_load
from deploy.bench.default import cpu_model
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.model_store import model_path, resolve_model

SPECULATION = SpeculationConfig(method="ngram", policy="fixed", k=4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma3-270m", help="catalog name or GGUF file (a family both paths run)")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--check-tokens", type=int, default=24, help="greedy tokens per prompt of the fp32 check")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="of the timed rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama", action="store_true", help="leave out the llama.cpp row even if it is installed")
    p.add_argument("--json", type=Path, help="write the results here")


def _greedy(model: LoadedModel, prompts: list[list[int]], n: int, weights: str = "dequantized") -> list[list[int]]:
    """Each prompt's `n` greedy tokens on a fresh runner of `model` (its path), one request at a time."""
    cache = CacheConfig(block_size=16, num_blocks=(max(map(len, prompts)) + n) // 16 + 4)
    run = _engine(ModelRunner(model, range(model.num_layers), cache, weights=weights), None, None, 1)
    return [run([p], n)[0][0] for p in prompts]


def check(source: str, texts: list[str], n: int) -> dict:
    """fp32, dequantized: the native path's greedy tokens against the generic path's, per prompt."""
    native = load_model(resolve_model(source, "fp32"), "fp32", weights="dequantized", backend="native")
    generic = load_model(resolve_model(source, "fp32"), "fp32", backend="generic")
    prompts = [native.encode(t, chat=True) for t in texts]
    a, b = _greedy(native, prompts, n), _greedy(generic, prompts, n)
    same = [x == y for x, y in zip(a, b)]
    return {"native": native.plan.describe(), "generic": generic.plan.describe(), "tokens": n,
            "same_tokens": same, "all_same": all(same), "first_text": native.tokenizer.decode(a[0])}


def _rows(source: str, dtype: str, args: argparse.Namespace, max_len: int) -> tuple[list[Row], list[list[int]], dict]:
    native = load_model(resolve_model(source, dtype), dtype, weights="stored", backend="native")
    generic = load_model(resolve_model(source, dtype), dtype, backend="generic")
    cache = CacheConfig(block_size=16, num_blocks=max_len // 16 + 8)
    rows = []
    if llama_anchor.available() and not args.no_llama:
        llama = llama_anchor.LlamaCpp(model_path(source), args.threads, n_ctx=max_len + 16)
        rows.append(Row("llama.cpp plain", lambda ps, n: ([llama.generate(ids, n) for ids in ps], SpecStats())))
    for name, model, weights in (("native stored", native, "stored"), ("native dequantized", native, "dequantized"),
                                 ("generic", generic, "dequantized")):
        runner = ModelRunner(model, range(model.num_layers), cache, weights=weights)
        rows.append(Row(f"{name} plain", _engine(runner, None, None, 1)))
        rows.append(Row(f"{name} spec (ngram k=4)", _engine(runner, None, SPECULATION, 1)))
    plans = {"native": native.plan.describe(), "generic": generic.plan.describe()}
    return rows, [native.encode(t, chat=True) for t in load_prompts(args.prompts, args.num_prompts)], plans


def run(args: argparse.Namespace) -> int:
    import time

    torch.set_num_threads(args.threads)
    texts = load_prompts(args.prompts, args.num_prompts)
    report: dict = {"command": "specfleet bench models " + " ".join(sys.argv[3:]), "model": args.model,
                    "cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype, "max_tokens": args.max_tokens,
                    "load_before": cpu_load()}
    report["check_fp32"] = check(args.model, texts, args.check_tokens)
    print(f"check (fp32, dequantized): native == generic greedy on {sum(report['check_fp32']['same_tokens'])}/"
          f"{len(texts)} prompts", flush=True)
    rows, prompts, report["plans"] = _rows(args.model, args.dtype, args, 2048)
    for i, ids in enumerate(prompts):  # interleaved, the order rotating per prompt
        for row in rows[i % len(rows):] + rows[:i % len(rows)]:
            t = time.perf_counter()
            out, stats = row.run([ids], args.max_tokens)
            row.seconds += time.perf_counter() - t
            row.tokens += sum(len(o) for o in out)
            row.stats.merge(stats)
            row.outputs += out
    report["load_after"] = cpu_load()
    generic = next(r for r in rows if r.name == "generic plain")
    report["rows"] = [{"name": r.name, "tok_s": round(r.tok_s, 2), "vs_generic_plain": round(r.tok_s / generic.tok_s, 2),
                       "acceptance": round(r.stats.acceptance_rate, 3) if r.stats.proposed else None} for r in rows]
    native_plain = next(r for r in rows if r.name == "native dequantized plain")
    report["bf16_native_generic_same_tokens"] = sum(a == b for a, b in zip(native_plain.outputs, generic.outputs))
    print(f"{report['plans']['native']} vs {report['plans']['generic']}; load {report['load_before']} -> "
          f"{report['load_after']}")
    for r in report["rows"]:
        print(f"  {r['name']:<34} {r['tok_s']:>8.2f} tok/s  {r['vs_generic_plain']:>5.2f}x generic"
              + (f"  acceptance {r['acceptance']}" if r["acceptance"] is not None else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["check_fp32"]["all_same"] else 1
