"""The AVX512-BF16 int4 matmul of int4_cpu.cpp: built once per machine (torch's C++ extension builder, cached under
~/.cache/torch_extensions), and the weight layout it reads.

Used for bf16 inputs on CPUs with AVX512-BF16, where it beats torch's `_weight_int4pack_mm_for_cpu` (measured in
docs/benchmarks.md); elsewhere, or where it cannot be built (no C++ compiler), Int4Linear stays on torch's
kernel. `SPECFLEET_CPU_INT4=aten` keeps torch's kernel anyway (a diagnostic: the benchmark's comparison).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_cpu.cpp")
ROWS, GROUP = 16, 32  # the kernel's row block and scale group (int4_cpu.cpp kRows, kGroup)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]


@functools.cache
def kernel() -> Callable | None:
    """`torch.ops.specfleet.int4_mm`, built on first use; None where this CPU or machine cannot run it."""
    if os.environ.get("SPECFLEET_CPU_INT4") == "aten" or not torch.cpu._is_avx512_bf16_supported():
        return None
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    try:
        load(name=f"specfleet_int4_cpu_{digest}", sources=[str(SOURCE)], extra_cflags=FLAGS,
             is_python_module=False, verbose=False)
    except (OSError, RuntimeError) as e:  # no compiler, or it refused the flags: torch's kernel does the work
        log.warning("the AVX512-BF16 int4 kernel could not be built (%s); using torch's int4 kernel", e)
        return None
    _register_fake()
    return torch.ops.specfleet.int4_mm


def _register_fake() -> None:
    """Shapes for torch.compile and fake tensors: (M, K) x (blocks, ...) -> (M, n)."""
    @torch.library.register_fake("specfleet::int4_mm")
    def _(x, codes, scale, offset, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of 4-bit codes (N, K) uint8 (planes side by side; N a multiple of 16, K of 32) and their
    per-group scale and offset (N, K / 32) fp32: codes (N / 16, K / 4, 32) uint8 where byte j = 2i + e of chunk c
    holds row i's code at 4c + e (low nibble) and 4c + 2 + e (high nibble); scale, offset (N / 16, K / 32, 16)."""
    n, k = codes.shape
    c = codes.view(n // ROWS, ROWS, k // 4, 2, 2)  # block, row i, chunk, k + 0/1 or k + 2/3, e
    packed = (c[:, :, :, 0] | c[:, :, :, 1] << 4).permute(0, 2, 1, 3).reshape(n // ROWS, k // 4, 32)
    blocked = [t.float().view(n // ROWS, ROWS, -1).transpose(1, 2).contiguous() for t in (scale, offset)]
    return packed.contiguous(), blocked[0], blocked[1]
