"""Point-to-point activation transfer between pipeline stages: torch.distributed, gloo on CPU and NCCL on GPUs.

The group's backend is NCCL when every stage computes on a GPU (tensors go GPU to GPU) and gloo otherwise,
through host memory (a GPU stage beside a CPU stage copies to and from it). Each instance has its own process
group, one rank per target stage (rank = stage index), joined through a
private TCP rendezvous address (its store listening there only, every rank proving the cluster's link secret before
anything crosses: actors/transport/rendezvous.py) and bounded by a timeout: a transfer whose peer died fails (gloo sees the
connection close) or times out, never hangs. One shard process belongs to one instance, so the group is the
process's default group.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.transport import rendezvous


class TransferError(RuntimeError):
    """A send or receive between stages failed or ran past the group's timeout (a peer died or hung)."""


def backend_for(device: torch.device) -> str:
    """NCCL when activations live on a GPU, gloo otherwise (the stages of one group share a device kind)."""
    return "nccl" if device.type == "cuda" else "gloo"


def use_node_interface(ip: str) -> str | None:
    """Make gloo and NCCL in this process talk over the interface that holds `ip` (the Ray node's address), unless
    the operator chose one (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). Left alone, gloo binds the address this
    machine's hostname resolves to, which on a host whose name maps to 127.0.x.x (and between network namespaces
    sharing one hostname) is loopback: peers on other hosts are then refused. Returns the interface chosen."""
    import psutil

    name = next((iface for iface, addrs in psutil.net_if_addrs().items()
                 if any(a.family == socket.AF_INET and a.address == ip for a in addrs)), None)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name


def free_address(host: str) -> str:
    """A TCP rendezvous address on `host` (this machine's address) with a port the OS calls free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


@dataclass(frozen=True)
class Transfer:
    """One send or receive: its size, when it started and ended (wall clock, time.time()), and which peer."""

    kind: str  # "send" or "recv"
    peer: int
    nbytes: int
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class P2P:
    """This process's rank in an instance's process group; moves (N, H) activations to and from its neighbours."""

    def __init__(self, init_method: str, rank: int, world_size: int, timeout_s: float,
                 device: torch.device | str = "cpu", backend: str | None = None, secret: bytes | None = None) -> None:
        """`secret`: the link secret every rank must prove (default: the cluster's, rendezvous.link_secret)."""
        self.device = torch.device(device)  # the stage's compute device: received tensors land on it
        self.backend = backend or backend_for(self.device)  # the group's: "gloo" if any stage computes on a CPU
        # what the wire carries: the GPU itself under NCCL; host memory under gloo (mixed or CPU-only groups)
        self.wire = self.device if self.backend == "nccl" else torch.device("cpu")
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = rendezvous.store(host, int(port), world_size, rank == 0, self.timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        try:  # before any activation crosses: every stage holds the cluster's secret
            rendezvous.authenticate(dist.distributed_c10d._get_default_group(), rank, world_size,
                                    secret if secret is not None else rendezvous.link_secret(), self.timeout,
                                    self.wire, f"the pipeline group at {init_method}")
        except RuntimeError as e:
            self.close()
            raise TransferError(f"rank {rank}: {e}") from None

    def send(self, x: torch.Tensor, dst: int) -> Transfer:
        """Send x (N, H) to rank `dst`; returns when it is sent."""
        started = time.time()
        buf = x.to(self.wire).contiguous()  # a no-op unless a GPU stage sends over gloo
        try:
            dist.isend(buf, dst).wait(self.timeout)
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError (DistBackendError)
            raise TransferError(f"rank {self.rank}: send of {tuple(x.shape)} to rank {dst} failed: {e}") from None
        return Transfer("send", dst, buf.numel() * buf.element_size(), started, time.time())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> tuple[torch.Tensor, Transfer]:
        """Receive a tensor of `shape` and `dtype` from rank `src`; it lands on this stage's device."""
        started = time.time()
        buf = torch.empty(shape, dtype=dtype, device=self.wire)
        try:
            dist.irecv(buf, src).wait(self.timeout)
        except RuntimeError as e:
            raise TransferError(f"rank {self.rank}: receive of {shape} from rank {src} failed: {e}") from None
        return buf.to(self.device), Transfer("recv", src, buf.numel() * buf.element_size(), started, time.time())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
