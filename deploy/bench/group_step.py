"""`specfleet bench group-step`: what one EasySpec group step costs between processes, against the layer it runs.

A layer-parallel draft (actors/speculation/draft_group.py) pays one exchange per group step: rank 0 broadcasts the group
input, every rank runs its layer, an all-gather joins the results. Here each of `--ranks` processes (one torch
thread each, gloo) runs a layer-sized MLP (the draft's hidden and intermediate sizes; default the Qwen2.5-0.5B
draft's) in three ways, `--steps` times each: alone (no exchange, all ranks computing at once), the exchange
alone, and the full group step. The step costs more than the MLP plus the exchange when the ranks finish their
MLPs at different times: every step waits for the slowest rank. No model, no Ray: two processes and gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.transport.p2p import free_address
from deploy.bench.output import save
from deploy.cli.flags import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="processes in the group (one torch thread each)")
    p.add_argument("--hidden", type=int, default=896, help="hidden size (Qwen2.5-Coder-0.5B's: 896)")
    p.add_argument("--intermediate", type=int, default=4864, help="MLP size (Qwen2.5-Coder-0.5B's: 4864)")
    p.add_argument("--tokens", type=int, default=1, help="rows of the step's input (a batch-1 draft forward: 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--steps", type=int, default=300, help="steps timed per way (the first 10% are warm-up)")
    p.add_argument("--json", type=Path)


def _rank(rank: int, args: argparse.Namespace, address: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=args.ranks)
    dt, h, i = DTYPES[args.dtype], args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(rank)
    gate_up = torch.randn(h, 2 * i, generator=gen).to(dt) / h ** 0.5  # (H, 2I)
    down = torch.randn(i, h, generator=gen).to(dt) / i ** 0.5  # (I, H)
    x = torch.randn(args.tokens, h, generator=gen).to(dt)  # (N, H)

    def mlp(v: torch.Tensor) -> torch.Tensor:
        a, b = (v @ gate_up).chunk(2, dim=-1)  # (N, I) each
        return (torch.nn.functional.silu(a) * b) @ down  # (N, H)

    def exchange(v: torch.Tensor) -> None:
        out = [torch.empty_like(v) for _ in range(args.ranks)]
        dist.all_gather(out, v)

    def step() -> None:
        dist.broadcast(x, src=0)
        exchange(mlp(x))

    def comm() -> None:
        dist.broadcast(x, src=0)
        exchange(x)

    timed = {}
    for name, fn in (("mlp_alone", lambda: mlp(x)), ("exchange_alone", comm), ("group_step", step)):
        times = []
        dist.barrier()
        for _ in range(args.steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        kept = times[len(times) // 10:]
        timed[name] = {"mean_ms": statistics.fmean(kept) * 1e3, "median_ms": statistics.median(kept) * 1e3,
                       "p90_ms": statistics.quantiles(kept, n=10)[-1] * 1e3}
    results[rank] = timed
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2 or args.steps < 10:
        raise UsageError("--ranks must be at least 2 and --steps at least 10")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args, free_address("127.0.0.1"), results), nprocs=args.ranks)
        per_rank = [dict(results[r]) for r in range(args.ranks)]
    mean = {k: max(r[k]["mean_ms"] for r in per_rank) for k in per_rank[0]}  # the slowest rank sets the pace
    # what a step costs beyond its MLP and its exchange: waiting for the slowest rank
    wait = mean["group_step"] - mean["mlp_alone"] - mean["exchange_alone"]
    # below 1, the group step beats running its layers one after another in one process
    vs_in_order = mean["group_step"] / (args.ranks * mean["mlp_alone"])
    report = {"ranks": args.ranks, "hidden": args.hidden, "intermediate": args.intermediate, "tokens": args.tokens,
              "dtype": args.dtype, "steps": args.steps, "cpu_count": os.cpu_count(), "per_rank": per_rank,
              "mean_ms": {k: round(v, 3) for k, v in mean.items()}, "wait_ms": round(wait, 3),
              "step_over_layers_in_order": round(vs_in_order, 3)}
    print(f"{args.ranks} ranks, {args.dtype}, N={args.tokens}: MLP alone {mean['mlp_alone']:.2f} ms, exchange alone "
          f"{mean['exchange_alone']:.2f} ms, group step {mean['group_step']:.2f} ms = {vs_in_order:.2f}x its "
          f"{args.ranks} MLPs in order ({wait:.2f} ms waiting for the slowest rank)", flush=True)
    save(report, args.json, None, lambda r, p: None)
    return 0
