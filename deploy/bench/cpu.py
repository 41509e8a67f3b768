"""`specfleet bench cpu`: llama.cpp's plain decoding (the anchor) against ours, plain and speculative, with the
weights dequantized and computed as stored, on the default model, Gemma 3 270M and the Qwen pair, in one run.

Every row decodes the same chat prompts (each model's chat template, our tokenizer's ids given to llama.cpp too),
greedy, exactly `--max-tokens` new tokens, timed per request with its prefill, at each of `--batches` (llama.cpp
at batch 1 only: its row is the anchor of a single user). Rows run interleaved group of prompts by group, their
order rotating, so that drift in the machine's speed hits every row alike; ratios come from totals within the run. Each setup also reports how far the stored weights' logits are from the dequantized
ones and how often their greedy tokens agree, and `--profile` reports the share of a plain decode step spent
outside torch's kernels.

llama.cpp rows (where `llama_cpp` is importable, deploy/bench/llama_anchor.py): plain and its prompt-lookup
speculation on the installed build (this CPU's native ISA), and the same on a second, AVX2-only build in a child
process (`--llama-avx2-lib`); "x llama.cpp" holds each row to the llama.cpp plain row of its own ISA. Time to the
first token of one long prompt (`--ttft-tokens`, MT-Bench text, the same ids for every engine; ours prefills in
chunks of 256) is measured per ISA path beside llama.cpp's, one after the other.

ISA paths (`--isas`, default every one this CPU runs, and torch's ops): the first (this machine's default, e.g.
avx512) runs every row; each other (avx2, torch) adds its own plain and speculative stored rows, named "[isa]", on
the same models loaded again under `SPECFLEET_CPU_ISA=isa` (actors/model/cpu_kernels.py), measured interleaved
with the others.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engine.core import Engine
from actors.model import cpu_kernels
from actors.model.loader import LoadedModel, load_model
from actors.model.metadata import SeqChunk
from actors.model.qlinear import DENSE_ROWS
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams, SpecStats
from deploy.bench import llama_anchor
from deploy.bench.default import cpu_model
from deploy.bench.output import Measured, save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.bench.spec import _agreement
from deploy.cli.flags import UsageError
from deploy.model_store import model_path, resolve_model


@dataclass(frozen=True)
class Setup:
    """A target, how it speculates (a draft model, or none for a lookup drafter), and its draft's re-quantization."""

    target: str
    draft: str | None
    speculation: SpeculationConfig
    draft_quantization: str  # of the dequantized rows' draft (the stored rows' draft is stored, or re-quantized)


SETUPS = {
    # the default app: n-gram lookup with the goodput policy (deploy/configs/default.yaml)
    "default": Setup("smollm2-135m-instruct", None, SpeculationConfig(method="ngram", policy="goodput", k=4), "none"),
    # the Qwen pair, the 0.5B drafting 4 tokens a round (its best setting so far: docs/benchmarks.md)
    # Gemma 3 270M (issue 37), n-gram lookup as the default app speculates
    "gemma3": Setup("gemma3-270m", None, SpeculationConfig(method="ngram", policy="goodput", k=4), "none"),
    "qwen": Setup("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", SpeculationConfig(policy="fixed", k=4), "int8"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", nargs="*", choices=list(SETUPS), default=list(SETUPS),
                   help="the model setups to run (none, with --kernels: the kernels' table alone)")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2, help="torch's and llama.cpp's threads")
    p.add_argument("--batches", type=int, nargs="+", default=[1],
                   help="batch sizes: at batch B our rows decode B prompts at once (continuous batching)")
    p.add_argument("--stored-draft", nargs="+", choices=["stored", "int8", "int4"], default=["int4", "stored"],
                   help="the Qwen draft of the stored rows, one row each: as stored, or re-quantized at load")
    p.add_argument("--activations", nargs="+", choices=["int8", "bf16"], default=["int8", "bf16"],
                   help="how our int4 kernel takes the stored rows' inputs, one set of stored rows each (int8: "
                        "the default's; bf16 rows take only the first --stored-draft)")
    p.add_argument("--fp32-reference", nargs="*", choices=list(SETUPS), default=["default"],
                   help="setups whose bf16 logits are also held to the target's stored weights computed in fp32")
    p.add_argument("--no-llama", action="store_true", help="leave out the llama.cpp row even if it is installed")
    p.add_argument("--llama-lookup", type=int, default=10,
                   help="llama.cpp's prompt-lookup row proposes up to this many tokens a step (the binding's "
                        "default, 10); 0 leaves the row out")
    p.add_argument("--llama-avx2-lib", type=Path, default=os.environ.get("SPECFLEET_LLAMA_AVX2_LIB"),
                   help="a folder holding an AVX2-only build of llama.cpp's shared libraries (default "
                        "$SPECFLEET_LLAMA_AVX2_LIB): adds its rows, named \"[avx2]\", run in a child process")
    p.add_argument("--no-dequantized", action="store_true",
                   help="leave out the dequantized rows and the stored-vs-dequantized check (a shorter run)")
    p.add_argument("--ttft-tokens", type=int, default=2000,
                   help="time to the first token of a prompt this long (0: not measured)")
    p.add_argument("--ttft-setups", nargs="*", choices=list(SETUPS), default=["default"],
                   help="the setups whose time to first token is measured")
    p.add_argument("--profile", action="store_true", help="profile one plain stored request of the first setup")
    p.add_argument("--kernels", action="store_true", help="also time each matmul kernel alone (deploy/bench/kernels.py)")
    p.add_argument("--kernel-rows", type=int, nargs="+", default=None,
                   help="with --kernels: the input rows each kernel is timed at (default 1 5)")
    p.add_argument("--isas", nargs="+", choices=[*cpu_kernels.ISAS, "torch"], default=None,
                   help="our kernels' ISA paths, one set of rows each (default: every one this CPU runs, then torch)")
    p.add_argument("--json", type=Path, help="write the results here")


@dataclass
class Row(Measured):
    """One engine's row: its name and how it decodes a batch of prompts, then what it measured."""

    name: str
    run: Callable[[list[list[int]], int], tuple[list[list[int]], SpecStats]]


def _engine(target: ModelRunner, draft: ModelRunner | None, spec: SpeculationConfig | None, batch: int) -> Callable:
    engine = Engine(target, draft, spec or SpeculationConfig(policy="off"),
                    SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=max(256, batch)))

    def run(prompts: list[list[int]], n: int) -> tuple[list[list[int]], SpecStats]:
        done = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        stats = SpecStats()
        for d in done:
            stats.merge(d.stats)
        return [d.token_ids for d in done], stats
    return run


Llama = llama_anchor.LlamaCpp | llama_anchor.LlamaCppProcess


def _llamas(setup: Setup, args: argparse.Namespace) -> dict[str, Llama]:
    """The setup's llama.cpp engines by row name: plain and prompt lookup on the installed build, then the same on
    the AVX2-only build (a child process each); none without the binding or with --no-llama."""
    if args.no_llama or not llama_anchor.available():
        return {}
    gguf = model_path(setup.target)
    # the plain engines also take the long prompt of the time to first token; a lookup engine keeps every
    # position's logits (n_ctx x vocabulary floats: 1.7 GB for Gemma 3's), so its context is the chat prompts'
    n_ctx = {"plain": max(args.max_tokens + 2048, args.ttft_tokens + 64), "lookup": args.max_tokens + 1536}
    lookups = [("plain", None)] + ([("lookup", args.llama_lookup)] if args.llama_lookup else [])
    out: dict[str, Llama] = {f"llama.cpp {kind}": llama_anchor.LlamaCpp(gguf, args.threads, n_ctx[kind], k)
                             for kind, k in lookups}
    if args.llama_avx2_lib:
        out |= {f"llama.cpp {kind} [avx2]": llama_anchor.LlamaCppProcess(args.llama_avx2_lib, gguf, args.threads,
                                                                         n_ctx[kind], k) for kind, k in lookups}
    return out


def _llama_row(name: str, llama: Llama) -> Row:
    return Row(name, lambda prompts, n: ([llama.generate(ids, n) for ids in prompts], SpecStats()))


def _rows(setup: Setup, args: argparse.Namespace, target: LoadedModel, draft: LoadedModel | None,
          batch: int, isa: str | None = None, llamas: dict[str, Llama] | None = None) -> list[Row]:
    """llama.cpp's (batch 1), then ours: plain and speculative, dequantized and stored; with `isa` (another ISA path
    than the default's), only its plain and speculative stored rows (int8 inputs, the first stored draft)."""
    cache = CacheConfig(block_size=16, num_blocks=batch * (args.max_tokens + 2048) // 16 + 8 * batch)
    rows = [_llama_row(name, llama) for name, llama in (llamas or {}).items()] if batch == 1 and isa is None else []
    paths = [("stored", args.activations[0])] if isa else \
        ([] if args.no_dequantized else [("dequantized", "int8")]) + [("stored", a) for a in args.activations]
    for weights, act in paths:
        runner = ModelRunner(target, range(target.num_layers), cache, weights=weights, activations=act)
        name = (weights if act == "int8" else f"{weights} (bf16 in)") + (f" [{isa}]" if isa else "")
        rows.append(Row(f"plain {name}", _engine(runner, None, None, batch)))
        if draft is None:
            rows.append(Row(f"spec {name}", _engine(runner, None, setup.speculation, batch)))
            continue
        if weights == "dequantized":
            drafts = [setup.draft_quantization]
        else:  # bf16-input rows: the first stored draft only
            drafts = args.stored_draft[:1] if act == "bf16" or isa else args.stored_draft
        for quant in drafts:
            draft_runner = ModelRunner(draft, range(draft.num_layers), cache, activations=act,
                                       weights=weights if quant in ("none", "stored") else quant)
            label = "" if weights == "dequantized" else f", draft {quant}"
            rows.append(Row(f"spec {name}{label}", _engine(runner, draft_runner, setup.speculation, batch)))
    return rows


def _logit_gap(target: LoadedModel, ids: list[int], exact: LoadedModel | None) -> dict[str, float]:
    """A prompt's logits on the decode path (the prompt fed DENSE_ROWS tokens at a time: every row on the kernel a
    decode or verification step runs), stored weights with int8 and with bf16 inputs, against the dequantized
    weights (bf16): the largest difference, the logits' standard deviation, and the share of positions whose top
    token agrees. With `exact` (the model in fp32, stored: the GGUF's own weights in fp32 arithmetic), each bf16
    path against it too."""
    cache = CacheConfig(block_size=16, num_blocks=len(ids) // 16 + 2)

    def logits(model: LoadedModel, weights: str, activations: str = "int8") -> torch.Tensor:  # (len(ids), V)
        runner = ModelRunner(model, range(model.num_layers), cache, weights=weights, activations=activations)
        return torch.cat([runner.forward([SeqChunk("gap", tuple(ids[i:i + DENSE_ROWS]), len(ids[i:i + DENSE_ROWS]))])
                          for i in range(0, len(ids), DENSE_ROWS)])

    def gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        return round(float((a - b).abs().max()), 3), round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4)

    paths = {"stored": logits(target, "stored"), "stored (bf16 in)": logits(target, "stored", "bf16"),
             "dequantized": logits(target, "dequantized")}
    dense = paths["dequantized"]
    out = dict(zip(("max_abs_diff", "top1_agreement"), gap(paths["stored"], dense)),
               logit_std=round(float(dense.std()), 3))
    out["bf16_in_max_abs_diff"], out["bf16_in_top1_agreement"] = gap(paths["stored (bf16 in)"], dense)
    if exact is not None:
        ref = logits(exact, "stored")
        for name, got in paths.items():
            out[f"{name}_vs_fp32_max_abs_diff"], out[f"{name}_vs_fp32_top1"] = gap(got, ref)
    return out


def _profile(run: Callable, ids: list[int], n: int) -> dict[str, float]:
    """One request under torch's profiler: wall time, time inside torch ops (self CPU time summed), the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run([ids], n)
        wall = time.perf_counter() - t
    inside = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {"wall_s": round(wall, 3), "in_ops_s": round(inside, 3), "outside_share": round(1 - inside / wall, 3),
            "ms_per_token": round(wall / n * 1e3, 2),
            "top_ops_ms_per_token": {e.key: round(e.self_cpu_time_total / 1e3 / n, 3) for e in top}}


def cpu_load() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages: how busy it was around the measurement."""
    return [round(x, 2) for x in os.getloadavg()]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isas = args.isas or [i for i in cpu_kernels.ISAS if cpu_kernels.unavailable(i) is None] + ["torch"]
    flags = sorted(f for f in cpu_kernels.cpu_flags() if f in {n for need in cpu_kernels.NEEDS.values() for n in need}
                   or f.startswith(("avx512", "amx")))
    report: dict = {"command": "specfleet bench cpu", "cpu": cpu_model(), "threads": args.threads, "isas": isas,
                    "cpu_isa_flags": flags, "default_isa": dict(zip(("isa", "why"), cpu_kernels.choice())),
                    "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "load_before": cpu_load(),
                    "llama_cpp": llama_anchor.available() and not args.no_llama, "llama_cpp_builds": {},
                    "ttft_tokens": args.ttft_tokens, "ttft": {}, "setups": {}}
    texts = load_prompts(args.prompts, args.num_prompts)
    if args.kernels:
        from deploy.bench import kernels

        report["kernels"] = kernels.measure(rows=tuple(args.kernel_rows or kernels.ROWS))
    for name in args.setups:
        setup = SETUPS[name]
        t0 = time.perf_counter()
        with cpu_kernels.forced(isas[0]):
            target = load_model(resolve_model(setup.target, "bf16"), "bf16", weights="stored")
            draft = load_model(resolve_model(setup.draft, "bf16"), "bf16", weights="stored") if setup.draft else None
        print(f"{name}: loaded in {time.perf_counter() - t0:.0f}s", flush=True)
        prompts = [target.encode(t, chat=True) for t in texts]
        gap = None
        if not args.no_dequantized:
            exact = load_model(resolve_model(setup.target, "fp32"), "fp32", weights="stored") \
                if name in args.fp32_reference else None
            with cpu_kernels.forced(isas[0]):
                gap = _logit_gap(target, prompts[0], exact)
            del exact
        others = {}  # the other ISA paths' own loads of the models (a model's projections are built for one ISA)
        for isa in isas[1:]:
            with cpu_kernels.forced(isa):
                others[isa] = (load_model(resolve_model(setup.target, "bf16"), "bf16", weights="stored"),
                               load_model(resolve_model(setup.draft, "bf16"), "bf16", weights="stored")
                               if setup.draft else None)
        llamas = _llamas(setup, args)
        report["llama_cpp_builds"] |= {n: llm.system_info for n, llm in llamas.items() if "plain" in n}
        if args.ttft_tokens and name in args.ttft_setups:
            ours = {isas[0]: target} | {isa: t for isa, (t, _) in others.items()}
            report["ttft"][name] = _ttft(_long_prompt(target, args.ttft_tokens), ours, llamas)
            print(f"{name}: time to first token " + ", ".join(f"{k} {v['seconds']}s"
                                                             for k, v in report["ttft"][name].items()), flush=True)
        for batch in args.batches:
            with cpu_kernels.forced(isas[0]):
                rows = _rows(setup, args, target, draft, batch, llamas=llamas)
            for isa, (t, d) in others.items():
                with cpu_kernels.forced(isa):
                    rows += _rows(setup, args, t, d, batch, isa)
            _measure(f"{name} batch {batch}", rows, prompts, batch, args.max_tokens)
            report["setups"][name if batch == 1 else f"{name}, batch {batch}"] = _report(setup, rows, gap)
            if args.profile and not report.get("profile"):
                plain = next(r for r in rows if r.name == "plain stored")
                report["profile"] = {"setup": name, "batch": batch, **_profile(plain.run, prompts[0], args.max_tokens)}
            del rows
        for llm in llamas.values():
            llm.close()
        del target, draft, others, llamas
    report["load_after"] = cpu_load()
    _print(report)
    save(report, args.json, None, lambda *_: None)
    return 0


def _measure(label: str, rows: list[Row], prompts: list[list[int]], batch: int, n: int) -> None:
    """Every row decodes every group of `batch` prompts, the rows' order rotating from group to group."""
    for r in rows:  # warm-up: first-call set-up (and the goodput policy's calibration) is not measured
        r.run([prompts[0]] * min(batch, 2), 8)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for i, group in enumerate(groups):
        for r in rows[i % len(rows):] + rows[:i % len(rows)]:
            t = time.perf_counter()
            outs, stats = r.run(group, n)
            r.seconds += time.perf_counter() - t
            r.tokens += sum(map(len, outs))
            r.stats.merge(stats)
            r.outputs.extend(outs)
        print(f"{label} group {i + 1}/{len(groups)}: " + ", ".join(f"{r.name} {r.tok_s:.1f}" for r in rows),
              flush=True)


def _isa_tag(name: str) -> str:
    """A row's ISA tag, " [avx2]", or "" for the default path's rows (and the installed llama.cpp build's)."""
    tag = re.search(r" \[\w+\]", name)
    return tag.group(0) if tag else ""


def _own_plain_name(name: str) -> str | None:
    """The plain row a speculative row's output and speed are held to: ours to ours, llama.cpp's to llama.cpp's."""
    if name.startswith("spec"):
        return name.split(",")[0].replace("spec", "plain", 1)
    if name.startswith("llama.cpp lookup"):
        return name.replace("lookup", "plain", 1)
    return None


def _report(setup: Setup, rows: list[Row], gap: dict[str, float] | None) -> dict:
    by_name = {r.name: r for r in rows}
    out = {}
    for r in rows:
        # the llama.cpp plain row of the row's own ISA where there is one, else the installed build's
        anchor = by_name.get("llama.cpp plain" + _isa_tag(r.name)) or by_name.get("llama.cpp plain")
        own_plain = by_name.get(_own_plain_name(r.name) or "")
        same, prefix = _agreement(own_plain.outputs, r.outputs) if own_plain else (None, None)
        out[r.name] = {
            "tok_s": round(r.tok_s, 2), "tokens": r.tokens, "seconds": round(r.seconds, 2),
            "vs_llama_cpp": round(r.tok_s / anchor.tok_s, 3) if anchor and anchor.tok_s else None,
            "vs_own_plain": round(r.tok_s / own_plain.tok_s, 3) if own_plain and own_plain.tok_s else None,
            "identical_to_own_plain": same,
            "token_agreement_with_own_plain": None if prefix is None else round(prefix, 4),
            "acceptance": round(r.stats.acceptance_rate, 3) if r.stats.proposed else None,
        }
    report = {"target": setup.target, "draft": setup.draft or setup.speculation.method, "rows": out}
    if gap is not None:
        same, prefix = _agreement(by_name["plain dequantized"].outputs, by_name["plain stored"].outputs)
        report["stored_vs_dequantized"] = {**gap, "identical_outputs": same, "token_agreement": round(prefix, 4)}
    return report


def _long_prompt(model: LoadedModel, n: int) -> list[int]:
    """The first `n` tokens of the MT-Bench questions' first turns run together (no chat template)."""
    ids: list[int] = []
    for text in load_prompts([DATASETS / "mt_bench_questions.jsonl"]):
        ids += model.encode(text, chat=False)
        if len(ids) >= n:
            return ids[:n]
    raise UsageError(f"the MT-Bench questions hold {len(ids)} tokens; --ttft-tokens asked for {n}")


def _ttft(prompt: list[int], ours: dict[str, LoadedModel], llamas: dict[str, Llama]) -> dict[str, dict]:
    """Seconds to the first token of `prompt` at batch 1, greedy, from an empty cache: each of our ISA paths (stored
    weights, int8 inputs, prefill in chunks of 256) and each llama.cpp build's plain engine (n_batch 512), one
    after the other after a warm-up on the prompt's first 256 tokens; "x llama.cpp" is the time over llama.cpp's of
    the same ISA (the installed build's where there is no such build)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs: dict[str, Callable[[list[int]], list[int]]] = {}
    for isa, model in ours.items():
        with cpu_kernels.forced(isa):
            runner = ModelRunner(model, range(model.num_layers),
                                 CacheConfig(block_size=16, num_blocks=len(prompt) // 16 + 8), weights="stored")
        engine = Engine(runner, None, SpeculationConfig(policy="off"),
                        SchedulerConfig(max_batch_size=1, max_num_batched_tokens=256))
        runs[f"ours [{isa}]"] = lambda ids, e=engine: generate(e, [ids], greedy)[0].token_ids
    for name, llama in llamas.items():
        if " plain" in name:
            runs[name.replace(" plain", "")] = lambda ids, llm=llama: llm.generate(ids, 1)
    for run in runs.values():
        run(prompt[:256])
    out: dict[str, dict] = {}
    for name, run in runs.items():
        t = time.perf_counter()
        first = run(prompt)
        seconds = time.perf_counter() - t
        out[name] = {"seconds": round(seconds, 2), "prefill_tok_s": round(len(prompt) / seconds, 1),
                     "first_token": first[0]}
    for name, r in out.items():
        anchor = out.get("llama.cpp" + _isa_tag(name)) or out.get("llama.cpp")
        r["x_llama_cpp"] = round(r["seconds"] / anchor["seconds"], 2) if anchor and name.startswith("ours") else None
    return out


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape  # a row's "[avx2]" is text, not markup
    from rich.table import Table

    console = Console(width=120)
    if "kernels" in report:
        from deploy.bench import kernels

        kernels.print_table(report["kernels"])
    console.print(f"CPU ISA: {' '.join(report['cpu_isa_flags']) or '-'}; our kernels by default: "
                  f"{report['default_isa']['isa']} ({report['default_isa']['why']}); rows per ISA path: "
                  + ", ".join(report["isas"]))
    console.print(f"[bold]bench cpu[/] {report['threads']} threads, CPU {report['cpu']}, {report['num_prompts']} "
                  f"prompts x {report['max_tokens']} tokens; load average before {report['load_before']}, after "
                  f"{report['load_after']}")
    for name, s in report["setups"].items():
        t = Table(title=f"{name}: {s['target']} (speculation: {s['draft']})")
        for col in ("row", "tok/s", "x llama.cpp", "x own plain", "accept", "identical", "agreement"):
            t.add_column(col, justify="left" if col == "row" else "right", no_wrap=True)
        for row, r in s["rows"].items():
            def fmt(v, spec="{:.2f}"):
                return "-" if v is None else spec.format(v)
            t.add_row(escape(row), f"{r['tok_s']:.1f}", fmt(r["vs_llama_cpp"], "{:.2f}x"), fmt(r["vs_own_plain"], "{:.2f}x"),
                      fmt(r["acceptance"]), fmt(r["identical_to_own_plain"]), fmt(r["token_agreement_with_own_plain"],
                                                                                  "{:.3f}"))
        console.print(t)
        if "stored_vs_dequantized" not in s:
            continue
        g = s["stored_vs_dequantized"]
        console.print(f"stored vs dequantized (bf16, decode-path logits of a prompt): at most {g['max_abs_diff']} "
                      f"apart (logit std {g['logit_std']}), top-1 agreement {g['top1_agreement']:.3f}; with bf16 "
                      f"inputs at most {g['bf16_in_max_abs_diff']}, top-1 {g['bf16_in_top1_agreement']:.3f}; greedy "
                      f"outputs identical {g['identical_outputs']:.2f}, token agreement {g['token_agreement']:.3f}")
        if "stored_vs_fp32_max_abs_diff" in g:
            console.print("against the GGUF's weights in fp32: " + ", ".join(
                f"{w} (bf16) at most {g[w + '_vs_fp32_max_abs_diff']}, top-1 {g[w + '_vs_fp32_top1']:.3f}"
                for w in ("stored", "stored (bf16 in)", "dequantized")))
    for name, info in report["llama_cpp_builds"].items():
        console.print(escape(f"{name}: {info}"))
    for name, runs in report["ttft"].items():
        t = Table(title=f"{name}: time to the first token of a {report['ttft_tokens']}-token prompt, batch 1")
        for col in ("engine", "seconds", "prefill tok/s", "x llama.cpp", "first token"):
            t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
        for engine, r in runs.items():
            t.add_row(escape(engine), f"{r['seconds']:.2f}", f"{r['prefill_tok_s']:.0f}",
                      "-" if r["x_llama_cpp"] is None else f"{r['x_llama_cpp']:.2f}x", str(r["first_token"]))
        console.print(t)
    if "profile" in report:
        p = report["profile"]
        console.print(f"profile ({p['setup']}, plain stored): {p['ms_per_token']} ms per token, "
                      f"{p['outside_share']:.0%} of the wall time outside torch ops; top ops (ms per token): "
                      + ", ".join(f"{k} {v}" for k, v in p["top_ops_ms_per_token"].items()))
