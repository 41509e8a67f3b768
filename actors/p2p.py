"""Point-to-point activation transfer between pipeline stages: torch.distributed, gloo on CPU and NCCL on GPUs.

Each instance has its own process group, one rank per target stage (rank = stage index), joined through a
private TCP rendezvous address and bounded by a timeout: a transfer whose peer died fails (gloo sees the
connection close) or times out, never hangs. One shard process belongs to one instance, so the group is the
process's default group.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class TransferError(RuntimeError):
    """A send or receive between stages failed or ran past the group's timeout (a peer died or hung)."""


def transfer_device() -> torch.device:
    """The device activations travel from: this process's GPU if it has one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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

    def __init__(self, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.device = transfer_device()
        self.backend = backend_for(self.device)
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=self.timeout)

    def send(self, x: torch.Tensor, dst: int) -> Transfer:
        """Send x (N, H) to rank `dst`; returns when it is sent."""
        started = time.time()
        buf = x.to(self.device).contiguous()  # a no-op where x already lives on the transfer device
        try:
            dist.isend(buf, dst).wait(self.timeout)
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError (DistBackendError)
            raise TransferError(f"rank {self.rank}: send of {tuple(x.shape)} to rank {dst} failed: {e}") from None
        return Transfer("send", dst, buf.numel() * buf.element_size(), started, time.time())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> tuple[torch.Tensor, Transfer]:
        """Receive a tensor of `shape` and `dtype` from rank `src` (it lands on the transfer device)."""
        started = time.time()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            dist.irecv(buf, src).wait(self.timeout)
        except RuntimeError as e:
            raise TransferError(f"rank {self.rank}: receive of {shape} from rank {src} failed: {e}") from None
        return buf, Transfer("recv", src, buf.numel() * buf.element_size(), started, time.time())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
