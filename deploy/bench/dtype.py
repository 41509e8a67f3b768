"""`specfleet bench dtype`: fp32 vs bf16 on each CPU path, the figures behind `dtype: auto` (actors/model/device.py).

Per ISA path (our avx512 and avx2 kernels, torch's ops), in a process of its own, since torch's own ISA is fixed
at import: the time to the first token of one long prompt (prefill in chunks of 256) and batch-1 decoding tok/s,
fp32 then bf16 in the same process, on the default model's stored weights. `--as-avx2` holds torch's own
kernels to AVX2 as well (`ATEN_CPU_CAPABILITY`, `DNNL_MAX_CPU_ISA`), so an AVX512 machine stands for an AVX2-only
one, as `make test`'s fallback pass does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from deploy.bench.prompts import DATASETS, load_prompts

AS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="a catalog name, GGUF file or model folder")
    p.add_argument("--isas", nargs="+", choices=["avx512", "avx2", "torch"], default=["avx512", "avx2", "torch"])
    p.add_argument("--as-avx2", action="store_true", help="torch's own kernels held to AVX2 too (an AVX2-only CPU)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--decode-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--one", choices=["avx512", "avx2", "torch"], help=argparse.SUPPRESS)  # a child's own path


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{dtype: {ttft_s, decode_tok_s}} on this process's ISA path."""
    import torch

    from actors.engine.core import Engine
    from actors.model.loader import load_model
    from actors.model.runner import ModelRunner
    from actors.engine.offline import generate
    from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
    from cluster.request import SamplingParams
    from deploy.model_store import resolve_model

    torch.set_num_threads(args.threads)
    texts = load_prompts([DATASETS / "mt_bench_questions.jsonl"])
    out = {}
    for dtype in ("fp32", "bf16"):
        model = load_model(resolve_model(args.model, dtype), dtype, weights="stored")
        long: list[int] = []
        for text in texts:
            long += model.encode(text, chat=False)
            if len(long) >= args.prompt_tokens:
                break
        long = long[:args.prompt_tokens]
        blocks = (args.prompt_tokens + args.max_tokens) // 16 + 8
        runner = ModelRunner(model, range(model.num_layers), CacheConfig(block_size=16, num_blocks=blocks))
        engine = Engine(runner, None, SpeculationConfig(policy="off"),
                        SchedulerConfig(max_batch_size=1, max_num_batched_tokens=256))
        greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        generate(engine, [long[:300]], greedy)  # warm-up: first-call set-up is not measured
        t = time.perf_counter()
        generate(engine, [long], greedy)
        ttft = time.perf_counter() - t
        chats = [model.encode(text, chat=True)[:args.prompt_tokens] for text in texts[:args.decode_prompts]]
        t = time.perf_counter()
        done = generate(engine, chats, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t
        out[dtype] = {"ttft_s": round(ttft, 3), "decode_tok_s": round(sum(len(d.token_ids) for d in done) / seconds, 2)}
        del engine, runner, model
    return out


def run(args: argparse.Namespace) -> int:
    if args.one:  # a child: one ISA path, its figures as one JSON line
        print(json.dumps(measure(args)), flush=True)
        return 0
    from rich.console import Console
    from rich.table import Table

    from deploy.bench.default import cpu_model

    report: dict = {"command": "specfleet bench dtype" + (" --as-avx2" if args.as_avx2 else ""), "cpu": cpu_model(),
                    "load_before": [round(x, 2) for x in os.getloadavg()], "paths": {}}
    for isa in args.isas:
        env = {**os.environ, "SPECFLEET_CPU_ISA": isa, **(AS_AVX2 if args.as_avx2 else {})}
        env.pop("SPECFLEET_CPU_KERNELS", None)
        child = [sys.executable, "-m", "deploy.cli", "bench", "dtype", "--one", isa, "--model", args.model,
                 "--prompt-tokens", str(args.prompt_tokens), "--decode-prompts", str(args.decode_prompts),
                 "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
        done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        report["paths"][isa] = json.loads(done.stdout.strip().splitlines()[-1])
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    table = Table(title=f"{report['command']}: {report['cpu']}, load {report['load_before']} -> {report['load_after']}")
    for col in ("path", "prefill fp32 s", "prefill bf16 s", "bf16 / fp32 prefill speed", "decode fp32 tok/s",
                "decode bf16 tok/s", "bf16 / fp32 decode speed"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for isa, r in report["paths"].items():
        f, b = r["fp32"], r["bf16"]
        table.add_row(isa, f"{f['ttft_s']:.2f}", f"{b['ttft_s']:.2f}", f"{f['ttft_s'] / b['ttft_s']:.2f}x",
                      f"{f['decode_tok_s']:.2f}", f"{b['decode_tok_s']:.2f}",
                      f"{b['decode_tok_s'] / f['decode_tok_s']:.2f}x")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
