"""A torch.distributed channel between two processes that carries a migrating request's KV: one link of a migration.

A migration (cluster/migration.py) opens one per pair of a source stage and a destination stage that share
layers (actors/kv/links.py), for its duration alone (two migrations between the same instances each have
theirs): the source stage's process hosts a TCP store at a free port of its node and is rank 0, the
destination stage's is rank 1, and a two-rank group connects them (made directly over the store, so it leaves
each process's default group, the pipeline's (actors/transport/p2p.py), alone): NCCL when both instances keep their KV
on GPUs, gloo otherwise. The KV's tensors go over it in order; their headers (request, layers, token range,
shape, dtype) go with the coordinator's calls, so the receiver knows what to allocate. Every operation is
bounded by the channel's timeout: a peer that died fails the transfer, never hangs it. The store and gloo's
pairs listen only on the addresses the two ends use, and both ends prove the cluster's link secret before any
KV crosses (actors/transport/rendezvous.py).

Tensors cross on the backend's wire device: NCCL sends them GPU to GPU from where the cache holds them; gloo
carries host memory, so only a GPU instance migrating to or from a CPU instance stages its KV on the host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.transport import rendezvous
from actors.kv.cache import KVExport


class ChannelError(RuntimeError):
    """The channel could not be opened, or a transfer over it failed or timed out."""


@dataclass(frozen=True)
class KVHeader:
    """What a KVExport is without its tensors: enough to receive them."""

    request_id: str
    layer_ids: tuple[int, ...]
    start: int
    end: int
    shape: tuple[int, ...]  # of k and of v: (L, end - start, kv_heads, head_dim)
    dtype: str  # e.g. "float32"

    @classmethod
    def of(cls, e: KVExport) -> "KVHeader":
        return cls(e.request_id, e.layer_ids, e.start, e.end, tuple(e.k.shape), str(e.k.dtype).removeprefix("torch."))


class KVChannel:
    """One end of a two-rank group; `send` and `recv` block (run them off the event loop)."""

    def __init__(self, address: str, rank: int, timeout_s: float, backend: str = "gloo",
                 secret: bytes | None = None) -> None:
        """`secret`: the link secret both ends must prove (default: the cluster's, rendezvous.link_secret)."""
        if backend not in ("gloo", "nccl"):
            raise ChannelError(f"unknown KV channel backend {backend!r} (gloo or nccl)")
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.rank, self.timeout = rank, timedelta(seconds=timeout_s)
        # where tensors must be to cross: the current GPU for NCCL, host memory for gloo
        self.wire = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        try:
            self.store = rendezvous.store(host, int(port), 2, rank == 0, self.timeout)
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self.group = dist.ProcessGroupNCCL(self.store, rank, 2, options)
            else:
                local = host if rank == 0 else rendezvous.source_address(host)
                self.group = dist.ProcessGroupGloo(self.store, rank, 2, rendezvous.gloo_options(local, self.timeout))
        except (RuntimeError, OSError) as e:
            raise ChannelError(f"opening the KV channel at {address} as rank {rank} failed: {e}") from None
        try:  # before any KV crosses: both ends hold the cluster's secret
            rendezvous.authenticate(self.group, rank, 2, secret if secret is not None else rendezvous.link_secret(),
                                    self.timeout, self.wire, f"the KV channel at {address}")
        except (RuntimeError, OSError) as e:
            self.group = self.store = None  # torn down: nothing is sent on a link whose peer is unknown
            raise ChannelError(f"the KV channel at {address} refused as rank {rank}: {e}") from None
        self._lock = threading.Lock()  # one transfer at a time, in the order they were asked for

    def send(self, exports: list[KVExport]) -> int:
        """Send each export's K and V to the other end; returns the bytes sent."""
        sent = 0
        with self._lock:
            for e in exports:
                for t in (e.k, e.v):
                    buf = t.detach().to(self.wire).contiguous()  # no copy when the cache is on the wire device
                    self._wait(self.group.send([buf], 1 - self.rank, 0), "send")
                    sent += buf.numel() * buf.element_size()
        return sent

    def recv(self, headers: tuple[KVHeader, ...]) -> list[KVExport]:
        """Receive the tensors the headers describe, in order, onto the wire device (the cache's import moves them
        to its own device if that differs)."""
        out = []
        with self._lock:
            for h in headers:
                kv = []
                for _ in range(2):
                    buf = torch.empty(h.shape, dtype=getattr(torch, h.dtype), device=self.wire)
                    self._wait(self.group.recv([buf], 1 - self.rank, 0), "receive")
                    kv.append(buf)
                out.append(KVExport(h.request_id, h.layer_ids, h.start, h.end, kv[0], kv[1]))
        return out

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:  # a dead peer or a timeout
            raise ChannelError(f"rank {self.rank}: KV {what} failed: {e}") from None
