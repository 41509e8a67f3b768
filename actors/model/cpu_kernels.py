"""Our CPU kernels for bf16 decoding on CPUs with AVX512-BF16 and AVX512-VNNI: the int4 matmul (int4_cpu.cpp) and the
fused per-layer steps (fused_cpu.cpp), built once per machine by torch's C++ extension builder (cached under
~/.cache/torch_extensions), and the weight layout the matmul reads.

Where they beat torch's own ops is measured in docs/benchmarks.md. Elsewhere (another CPU, fp32, CUDA) or where
they cannot be built (no C++ compiler or no ninja), the model runs on torch's ops. `SPECFLEET_CPU_KERNELS=torch` keeps
torch's ops anyway (a diagnostic: the benchmarks' comparison).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from actors.model.kernel_build import build_lock, ninja_on_path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("int4_cpu.cpp", "fused_cpu.cpp", "layer_cpu.cpp")]
ROWS, GROUP = 16, 32  # the matmul's row block and scale group (int4_cpu.cpp kRows, kGroup)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp"]


@functools.cache
def ops():
    """`torch.ops.specfleet` (int4_mm, int4_mm_q8, int8_rows, int4_dequant, rms_norm, add_rms_norm, rope_, silu_mul,
    span_attention, decode_layer), built on first use; None where this CPU or machine cannot run them."""
    reason = unavailable()
    if reason is not None:
        log.info("our CPU kernels do not run here (%s); using torch's ops", reason)
        return None
    from torch.utils.cpp_extension import load

    name = f"specfleet_cpu_{build_id()}"
    try:
        with build_lock(name):  # bounded, and never stuck on a killed build's lock (actors/model/kernel_build.py)
            load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS, is_python_module=False,
                 verbose=False)
    except (OSError, RuntimeError) as e:  # no compiler, it refused the flags, or a build held past the bound
        log.warning("our AVX512 CPU kernels could not be built (%s); using torch's ops", e)
        return None
    _register_fake()
    return torch.ops.specfleet


@functools.cache
def build_id() -> str:
    """The kernels' identity: a digest of their sources and compiler flags (the name of their build)."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:12]


def identity() -> str:
    """What computes this process's CPU matmuls and fused steps: our kernels' `build_id()`, or "torch" where they do
    not run (without building them)."""
    return "torch" if unavailable() is not None else build_id()


def unavailable() -> str | None:
    """Why our kernels cannot run in this process, or None where they run (or can be built: a build that still
    fails falls back too, with a warning)."""
    if os.environ.get("SPECFLEET_CPU_KERNELS") == "torch":
        return "SPECFLEET_CPU_KERNELS=torch"
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU has no AVX512-BF16"
    if not torch.cpu._is_vnni_supported():
        return "this CPU has no AVX512-VNNI"
    if shutil.which(os.environ.get("CXX", "c++")) is None:  # the compiler torch's extension builder calls
        return "no C++ compiler"
    from torch.utils.cpp_extension import is_ninja_available

    ninja_on_path()  # the `ninja` package's, where the venv's bin is not on PATH
    return None if is_ninja_available() else "no ninja (torch's extension builder needs it)"


def kernel(activations: str = "int8") -> Callable | None:
    """The int4 matmul (int4_cpu.cpp) on inputs rounded to int8 per group (`int4_mm_q8`) or as given in bf16
    (`int4_mm`), or None where our kernels do not run."""
    lib = ops()
    if lib is None:
        return None
    return {"int8": lib.int4_mm_q8, "bf16": lib.int4_mm}[activations]


def _register_fake() -> None:
    """Output shapes for fake tensors (torch.compile tracing)."""
    @torch.library.register_fake("specfleet::int4_mm")
    def _(x, codes, scale, offset, scale_mult, offset_mult, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specfleet::int4_mm_q8")
    def _(x, codes, scale, offset, scale_mult, offset_mult, bias, n):  # noqa: ANN001, ANN202 - the op's schema
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specfleet::decode_layer")
    def _(x, *rest):  # noqa: ANN001, ANN002, ANN202 - the op's schema
        return torch.empty_like(x)

    @torch.library.register_fake("specfleet::int8_rows")
    def _(x):  # noqa: ANN001, ANN202 - the op's schema
        return torch.empty_like(x)

    @torch.library.register_fake("specfleet::int4_dequant")
    def _(codes, scale, offset, scale_mult, offset_mult, n, k):  # noqa: ANN001, ANN202 - the op's schema
        return codes.new_empty(n, k, dtype=torch.bfloat16)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
         levels: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The matmul's layout of 4-bit codes (N, K) uint8 (planes side by side; N a multiple of 16, K of 32) and their
    per-group scale and offset (N, K / 32) fp32: (codes, scale, offset, scale_mult, offset_mult) for int4_mm.

    Codes: (N / 16, K / 8, 64) uint8, the 32 16-bit words of chunk c, word j = 2i + e holding row i's code at
    8c + 2t + e in its nibble t (bits 4t .. 4t + 3). Scales, the fewest bytes that hold them exactly: a K-quant's two levels (`levels`:
    fp16 per 8 groups, uint8 multipliers per group), else fp16 per group where every value is an fp16, else fp32;
    each as (N / 16, groups, 16), rows innermost. The multipliers are None but for two levels.
    """
    n, k = codes.shape
    c = codes.to(torch.int32).view(n // ROWS, ROWS, k // 8, 4, 2)  # block, row i, chunk, nibble t, e
    words = c[:, :, :, 0] | c[:, :, :, 1] << 4 | c[:, :, :, 2] << 8 | c[:, :, :, 3] << 12  # (blocks, 16, K / 8, 2)
    words = words.permute(0, 2, 1, 3).reshape(n // ROWS, k // 8, 32).to(torch.int16)  # word j = 2i + e (wraps: bits)
    packed = words.contiguous().view(torch.uint8)  # (blocks, K / 8, 64), little-endian words

    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (N, G) -> (N / 16, G, 16)
        return t.to(dtype).view(n // ROWS, ROWS, -1).transpose(1, 2).contiguous()

    if levels is not None and all(_is_half(t) for t in (levels[0], levels[2])):
        d, sc, dm, mn = levels
        return (packed, blocked(d, torch.float16), blocked(dm, torch.float16), blocked(sc, torch.uint8),
                blocked(mn, torch.uint8))
    dtype = torch.float16 if _is_half(scale) and _is_half(offset) else torch.float32
    return packed, blocked(scale, dtype), blocked(offset, dtype), None, None


def _is_half(t: torch.Tensor) -> bool:
    """Every value of fp32 `t` is an fp16 (finite): it can be stored in half the bytes exactly."""
    h = t.to(torch.float16)
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())
