"""Micro-benchmark of a device's speed: achieved matmul TFLOPS, in the unit of the catalog's speeds."""

from __future__ import annotations

import time

import torch


def measure_speed(
    device: str | torch.device = "cpu", *, size: int = 1024, dtype: torch.dtype | None = None,
    repeats: int = 10, warmup: int = 2,
) -> float:
    """Achieved TFLOPS of a (size x size) @ (size x size) matmul on `device`: the median of `repeats` timings.

    dtype defaults to bfloat16 on CUDA (what the catalog's tensor-core figures count) and float32 on CPU.
    A relative number: compare devices measured with the same arguments, and pass the results to
    `placement.inventory.override_speeds`.
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        a @ b
    sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        seconds.append(time.perf_counter() - start)
    median = sorted(seconds)[len(seconds) // 2]
    return 2 * size**3 / median / 1e12
