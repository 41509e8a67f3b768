"""`specfleet bench attention`: attention over the paged KV cache, per layer, two ways side by side on this device.

`gather` is what the runner does (actors/model/layers.py): copy each sequence's blocks into a padded
(B, S, kvh, hd) and run scaled_dot_product_attention with a boolean mask. `pool` avoids that copy: every
query attends over the layer's whole block pool (1, NB*BS, kvh, hd) as one key sequence, masked to its own
slots. The report gives each one's median time per layer call and pool / gather, for decode (T = 1) and a
verification of k+1 = 5 tokens, at a few batch sizes and context lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.model.device import resolve_device
from actors.kv.cache import KVCache
from actors.model.metadata import AttentionMetadata, SeqChunk

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}  # (query heads, KV heads, head dim)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--num-blocks", type=int, default=2048, help="blocks in the pool (the default cache's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    torch.manual_seed(0)
    rows = []
    for model, (nh, kvh, hd) in SHAPES.items():
        for b in (int(x) for x in args.batches.split(",")):
            for ctx in (int(x) for x in args.contexts.split(",")):
                for t in (1, 5):
                    row = _one(device, args, nh, kvh, hd, b, ctx, t)
                    rows.append({"model": model, "batch": b, "context": ctx, "new_tokens": t, **row})
                    print(f"{model:>13} B={b:<2} ctx={ctx:<5} T={t}: gather {row['gather_ms']:.3f} ms, "
                          f"pool {row['pool_ms']:.3f} ms, pool/gather {row['pool_over_gather']:.2f}x", flush=True)
    report = {"device": str(device), "num_blocks": args.num_blocks, "block_size": args.block_size, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


@torch.inference_mode()
def _one(device: torch.device, args: argparse.Namespace, nh: int, kvh: int, hd: int, b: int, ctx: int,
         t: int) -> dict:
    cache = KVCache([0], args.num_blocks, args.block_size, kvh, hd, device=device)
    cache.k.normal_()
    cache.v.normal_()
    for i in range(b):  # contexts in place, then room for the new tokens
        assert cache.reserve(f"r{i}", ctx + t)
        cache.set_length(f"r{i}", ctx)
    meta = AttentionMetadata.build([SeqChunk(f"r{i}", tuple(range(t)), t) for i in range(b)], cache)
    q = torch.randn(b * t, nh, hd, device=device)  # (N, nh, hd)

    def gather() -> torch.Tensor:
        keys, values = cache.gather(0, meta.block_tables)  # (B, S, kvh, hd): the copy
        qp = q.view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        return F.scaled_dot_product_attention(qp, keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=meta.mask(), enable_gqa=True)

    slots = torch.arange(args.num_blocks * args.block_size, device=device)  # (P,) every slot of the pool
    own = torch.zeros(b, t, slots.shape[0], dtype=torch.bool, device=device)  # (B, T, P)
    for i in range(b):
        table = torch.tensor(cache.block_table(f"r{i}"), device=device)
        seq_slots = (table[:, None] * args.block_size + torch.arange(args.block_size, device=device)).flatten()
        for j in range(t):
            own[i, j, seq_slots[:ctx + j + 1]] = True
    pool_mask = own.view(1, 1, b * t, -1)  # (1, 1, N, P)

    def pool() -> torch.Tensor:
        k = cache.k[0].view(1, -1, kvh, hd).transpose(1, 2)  # (1, kvh, P, hd): a view, no copy
        v = cache.v[0].view(1, -1, kvh, hd).transpose(1, 2)
        qp = q.view(1, b * t, nh, hd).transpose(1, 2)  # (1, nh, N, hd)
        return F.scaled_dot_product_attention(qp, k, v, attn_mask=pool_mask, enable_gqa=True)

    a = gather().transpose(1, 2).reshape(b * t, nh, hd)
    p = pool().transpose(1, 2).reshape(b * t, nh, hd)
    assert torch.allclose(a, p, atol=1e-4), "the two ways disagree"
    g_ms, p_ms = _median_ms(gather, device, args.repeats), _median_ms(pool, device, args.repeats)
    return {"gather_ms": g_ms, "pool_ms": p_ms, "pool_over_gather": p_ms / g_ms}


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
