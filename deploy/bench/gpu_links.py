"""NCCL between two GPUs, as a pipeline's activations (actors/transport/p2p.py) and a migration's KV channel
(actors/kv/channel.py) use it: two processes, rank r on cuda:r, each transfer checked bit for bit and timed.

A step of `specfleet bench gpu`. NCCL refuses two ranks on one GPU ("Duplicate GPU detected", NCCL 2.5 and later:
github.com/NVIDIA/nccl/issues/418), so with fewer than two GPUs nothing runs and the report says why; the
single-GPU link paths (gloo carrying CUDA tensors) are the unit tests that step runs on CUDA.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

ACTIVATION_SHAPE = (8, 1536)  # (rows, hidden): a verification step's activations between two stages
BANDWIDTH_SHAPE = (4096, 1024)  # 16 MiB of fp32, sent REPEATS times to time the link
REPEATS = 10


def _peer(rank: int, address: str, kv_address: str, timeout_s: float, queue) -> None:
    """One rank: activations over P2P (NCCL), then a KV export over a KVChannel (NCCL); rank 1 reports."""
    import torch

    from actors.kv.cache import KVExport
    from actors.kv.channel import KVChannel, KVHeader
    from actors.transport.p2p import P2P

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    out: dict = {"rank": rank}
    link = P2P(address, rank, 2, timeout_s, device=device)
    try:
        out["p2p_backend"] = link.backend
        x = torch.arange(ACTIVATION_SHAPE[0] * ACTIVATION_SHAPE[1], dtype=torch.float32,
                         device=device).view(ACTIVATION_SHAPE)  # (N, H)
        big = torch.ones(BANDWIDTH_SHAPE, device=device)  # (4096, 1024) fp32
        if rank == 0:
            link.send(x, dst=1)
            for _ in range(REPEATS):
                link.send(big, dst=1)
        else:
            got, _ = link.recv(ACTIVATION_SHAPE, torch.float32, src=0)
            out["p2p_exact"] = bool(torch.equal(got, x))
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(REPEATS):
                got, _ = link.recv(BANDWIDTH_SHAPE, torch.float32, src=0)
            torch.cuda.synchronize()
            out["p2p_gb_s"] = round(REPEATS * big.numel() * 4 / (time.perf_counter() - t) / 1e9, 2)
    finally:
        link.close()
    channel = KVChannel(kv_address, rank, timeout_s, backend="nccl")
    g = torch.Generator(device=device).manual_seed(0)
    sent = [KVExport("r", (i, i + 1), 16 * i, 16 * i + 16, torch.randn(2, 16, 4, 64, generator=g, device=device),
                     torch.randn(2, 16, 4, 64, generator=g, device=device)) for i in range(4)]  # (layers, T, Hkv, D)
    if rank == 0:
        out["kv_bytes"] = channel.send(sent)
    else:
        got = channel.recv(tuple(KVHeader.of(e) for e in sent))
        out["kv_exact"] = all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(got, sent))
        out["kv_device"] = str(got[0].k.device)
    queue.put(out)


def measure(timeout_s: float) -> dict:
    """{"ran": bool, "why"?: str, rank 1's checks and figures}: NCCL between cuda:0 and cuda:1."""
    import torch

    from actors.transport.p2p import free_address

    n = torch.cuda.device_count()
    if n < 2:
        return {"ran": False, "why": f"{n} GPU: NCCL needs one GPU per rank (NCCL refuses two ranks on one GPU)"}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address, kv_address = free_address("127.0.0.1"), free_address("127.0.0.1")
    procs = [ctx.Process(target=_peer, args=(r, address, kv_address, timeout_s, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout_s * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    got = next(r for r in results if r["rank"] == 1)
    return {"ran": True, "gpus": n, **{k: v for k, v in got.items() if k != "rank"},
            "kv_bytes": next(r for r in results if r["rank"] == 0)["kv_bytes"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout-s", type=float, default=30.0, help="each rendezvous and transfer's deadline")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    report = measure(args.timeout_s)
    args.json.write_text(json.dumps(report))
    print(json.dumps(report))
    ok = not report["ran"] or (report.get("p2p_exact") and report.get("kv_exact") and report["p2p_backend"] == "nccl")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
