"""Linear layers that compute on quantized weights through torch's fused weight-only kernels, each kernel's shape
preconditions checked before it is chosen.

- `Int4Linear`: 4-bit codes with a scale and a zero per group of 32-256 weights, the layout of gpt-fast's int4
  weight-only matmul: `_weight_int4pack_mm_for_cpu` on the CPU, `_weight_int4pack_mm` (tinygemm) on CUDA; both
  dequantize w = (code - 8) * scale + zero inside the kernel. Codes of 5 to 8 bits are split into two 4-bit
  planes, code = low + 16 * high, laid side by side along K (the input is repeated to match): exact, at the
  bytes of int8. One class per kernel, chosen when the layer is built: `TorchInt4Linear` (torch's kernels) and
  `CpuInt4Linear` (ours, below).
- `Int8Linear`: int8 codes with one scale per output row (`_weight_int8pack_mm`, a CPU kernel).

Preconditions (measured on torch 2.13; tests/unit/test_qlinear.py holds them):
- `_weight_int8pack_mm` (CPU): K % 16 == 0. Other K give wrong results and, for batches of 2+ rows, a segfault
  (K = 72, a tiny Llama's hidden size, crashes). Guarded here; such layers take the dense matmul.
- `_convert_weight_to_int4pack_for_cpu`: N % 16 == 0 (other N are padded with zero rows, sliced off the
  output); `_weight_int4pack_mm_for_cpu`: group in {32, 64, 128, 256}, K % group == 0. Its vectorised (AVX512 /
  AVX2) kernel is bf16 only: fp32 runs a scalar loop (exact, slow: for tests), so `weights: stored` pays in bf16.
- CUDA `_convert_weight_to_int4pack`: N % 8 == 0 (padded as on the CPU), K % (16 * inner tiles) == 0;
  `_weight_int4pack_mm`: bf16 only, compute capability 8.0+. Int8 has no CUDA kernel here: such layers are
  stored dense on CUDA.
- Our AVX512-BF16/VNNI kernel (int4_cpu.cpp), where it is built: bf16 inputs (taken as given, or rounded per group
  of 32 to int8: `Activations`), groups of 32, K % 32 == 0, any N.
Shape legend: M rows of input, K input features, N output features, G groups per row (K / group), P planes.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from actors.model import cpu_kernels
from actors.model.gguf_blocks import GroupedInts

INT4_GROUPS = (32, 64, 128, 256)
# how our CPU kernel takes its input rows (`engine.model.activations`): rounded to int8 per group of 32 (llama.cpp's
# Q8_0 dot products: twice the multiply-adds per instruction, the rows' rounding in the logits) or bf16 as given
Activations = Literal["int8", "bf16"]
ACTIVATIONS: tuple[Activations, ...] = ("int8", "bf16")
# above this many input rows (a prefill chunk) a call takes the GEMM path: int8 inputs on our int4 x int8 GEMM
# (int4_gemm_q8: the decode kernel's bits for every row, so deterministic mode keeps it), bf16 inputs on the weights
# expanded once and a dense bf16 GEMM (not in deterministic mode: its order depends on M)
DENSE_ROWS = 16
# int8 inputs: above this many rows, where torch's bf16 GEMM runs on AMX tiles (oneDNN, Sapphire Rapids and later),
# the weights expanded once and that GEMM beat our VPDPBUSD GEMM (measured on the 135M's shapes, docs/weights.md:
# about even at 64 rows, 1.7x at 256); elsewhere (AVX2, AVX512 without AMX: bf16 emulated or at half VNNI's rate)
# and in deterministic mode, never
AMX_ROWS = 64
_ROW_CHUNK = 4096  # rows packed at a time (a multiple of the CPU kernel's 64-row blocks): bounds the int32 copy


def int4_unsupported(w: GroupedInts, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `w` cannot run on the int4 kernel on `device` in `dtype`, or None if it can."""
    n, k = w.shape
    planes = -(-w.bits // 4)
    if planes > 2:
        return f"{w.bits}-bit codes"
    if w.group not in INT4_GROUPS:
        return f"groups of {w.group} (the kernel takes {INT4_GROUPS})"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"{dtype} (the CUDA kernel is bf16 only)"
        if (planes * k) % 32:
            return f"K = {planes * k} is not a multiple of 32"
        if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
            return "a GPU below compute capability 8.0"
        return None
    return f"device {device.type}"


def int8_unsupported(k: int, device: torch.device) -> str | None:
    """Why an int8 (N, k) weight cannot run on `_weight_int8pack_mm` on `device`, or None if it can."""
    if device.type != "cpu":
        return f"device {device.type} (the kernel is a CPU one)"
    return f"K = {k} is not a multiple of 16 (the kernel then crashes)" if k % 16 else None


class Int4Linear(nn.Module):
    """y = x @ W.T + b, W (N, K) as 4-bit codes in P planes with a scale and an offset per group. Two kernels, one
    class each, chosen when the layer is built (`Int4Linear(...)` gives the one that runs here): on a CPU where our
    kernels run, with bf16 inputs and groups of 32, `CpuInt4Linear` (actors/model/int4_cpu.cpp: fp32 scales, the
    planes and the bias in one call; the inputs as `activations` says); otherwise `TorchInt4Linear`, torch's int4
    weight-only kernel for `device`. Build it only where `int4_unsupported` says nothing."""

    own: object | None = None  # our kernel's op (int4_mm_q8 or int4_mm) where it computes this layer

    def __new__(cls, *args, **kwargs) -> "Int4Linear":  # noqa: ANN002, ANN003 - the chosen class's arguments
        """`Int4Linear(w, bias, device, dtype, ours=True, activations="int8")`: the class whose kernel runs `w` here
        (`kernel_class`); a subclass named directly is built as it is."""
        if cls is Int4Linear:
            cls = kernel_class(*args, **kwargs)
        return super().__new__(cls)

    def _setup(self, w: GroupedInts, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
               activations: Activations) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What both kernels start from: the checked shape, and the codes as planes (N + pad, P*K) with each plane's
        scales and offsets (N + pad, P*G), padded with zero rows to the kernel's N multiple (`pad`)."""
        nn.Module.__init__(self)
        why = int4_unsupported(w, device, dtype)
        if why is not None:
            raise ValueError(f"the int4 kernel cannot take this weight: {why}")
        self.out_features, self.in_features = w.shape
        self.planes = -(-w.bits // 4)
        self.group = w.group
        self.activations = activations
        pad = -self.out_features % (16 if device.type == "cpu" else 8)  # zero rows: the kernel's N multiple
        codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (w.codes, w.scale, w.offset))
        planes = torch.cat([codes & 0x0F] + ([codes >> 4] if self.planes == 2 else []), dim=1)  # (N, P*K)
        scales = torch.cat([scale * 16**p for p in range(self.planes)], dim=1)  # (N, P*G): plane p's is 16**p * scale
        offsets = torch.cat([offset] + [torch.zeros_like(offset)] * (self.planes - 1), dim=1)  # the first carries it
        self.bias = None if bias is None else bias.to(device, dtype)
        return pad, planes, scales, offsets

    def packed(self) -> dict | None:
        """What `CpuInt4Linear.from_packed` rebuilds this module from; None if our kernel does not compute it."""
        return None


def kernel_class(w: GroupedInts, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 ours: bool = True, activations: Activations = "int8") -> type[Int4Linear]:
    """Which kernel computes `w`: ours (`CpuInt4Linear`) on the CPU in bf16 with groups of 32 where our kernels run,
    else torch's (`TorchInt4Linear`). `ours=False` keeps torch's kernel even where ours runs (the benchmark's
    comparison); `activations`: how ours takes the input (torch's kernels take it as given)."""
    mine = ours and (device.type, dtype, w.group) == ("cpu", torch.bfloat16, cpu_kernels.GROUP)
    return CpuInt4Linear if mine and cpu_kernels.kernel(activations) is not None else TorchInt4Linear


class CpuInt4Linear(Int4Linear):
    """Int4Linear on our CPU kernel (int4_cpu.cpp) of the process's ISA, weights in its packed layout
    (cpu_kernels.pack). Which computation a call takes depends on its rows, known per call (`path`): up to
    DENSE_ROWS (a decode, a verification) the kernel; more (a prefill chunk) our int4 x int8 GEMM, bit for bit the
    kernel's; bf16 inputs, or int8 ones past AMX_ROWS on an AMX CPU, the weights expanded once and a dense GEMM,
    unless the layer is `invariant` (deterministic mode: every row gets the kernel's bits, whatever M)."""

    def __init__(self, w: GroupedInts, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 ours: bool = True, activations: Activations = "int8") -> None:
        pad, planes, scales, offsets = self._setup(w, bias, device, dtype, activations)
        self.own = cpu_kernels.kernel(activations)
        self.lib = cpu_kernels.ops()  # the ISA's build `own` is of
        self.padded = False  # our kernel stores only the real rows
        # deterministic mode: every row on our kernel, whatever M (the dense path rounds each weight to bf16 and
        # its GEMM's order depends on M)
        self.invariant = False
        levels = None
        if w.levels is not None:  # the same per plane: d scaled by 16**p, the offset's on the first plane only
            d, sc, dm, mn = (F.pad(t, (0, 0, 0, pad)) for t in w.levels)
            levels = (torch.cat([d * 16**p for p in range(self.planes)], 1), sc.repeat(1, self.planes),
                      torch.cat([dm] + [torch.zeros_like(dm)] * (self.planes - 1), 1), mn.repeat(1, self.planes))
        self.weight, self.scale, self.offset, self.scale_mult, self.offset_mult = cpu_kernels.pack(
            planes, scales, offsets, levels)

    @classmethod
    def from_packed(cls, packed: dict, bias: torch.Tensor | None, dtype: torch.dtype,
                    activations: Activations = "int8") -> "CpuInt4Linear | None":
        """The module our kernel computes from operands `pack` wrote earlier (actors/model/layout_cache.py: their
        shape, planes and group, and the FIELDS), on the CPU in bf16; None where our kernel does not run now."""
        own = cpu_kernels.kernel(activations) if dtype == torch.bfloat16 else None
        if own is None or packed["group"] != cpu_kernels.GROUP:
            return None
        m = nn.Module.__new__(cls)
        nn.Module.__init__(m)
        m.out_features, m.in_features = packed["out_features"], packed["in_features"]
        m.planes, m.group, m.activations = packed["planes"], packed["group"], activations
        m.padded, m.invariant = False, False
        m.bias = None if bias is None else bias.to(dtype)  # a CPU layout: its bias was read on the CPU
        m.own, m.lib = own, cpu_kernels.ops()
        m.weight, m.scale, m.offset, m.scale_mult, m.offset_mult = (packed[f] for f in (
            "weight", "scale", "offset", "scale_mult", "offset_mult"))
        return m

    def packed(self) -> dict:
        """What `from_packed` rebuilds this module from."""
        return {"out_features": self.out_features, "in_features": self.in_features, "planes": self.planes,
                "group": self.group, "weight": self.weight, "scale": self.scale, "offset": self.offset,
                "scale_mult": self.scale_mult, "offset_mult": self.offset_mult}

    def operands(self) -> list[torch.Tensor]:
        """Our kernel's operands (codes, scale, offset, scale_mult, offset_mult, bias), an empty tensor for an
        absent one: a projection of actors/model/layer_cpu.cpp's one-call decode layer."""
        none = self.weight.new_empty(0)
        return [self.weight, self.scale, self.offset] + [none if t is None else t for t in
                                                         (self.scale_mult, self.offset_mult, self.bias)]

    def dequantized(self) -> torch.Tensor:
        """The weights (N, K) bf16 expanded from our kernel's codes (planes summed, each weight rounded once)."""
        return self.lib.int4_dequant(self.weight, self.scale, self.offset, self.scale_mult,
                                     self.offset_mult, self.out_features, self.in_features)

    def path(self, m: int) -> Literal["kernel", "gemm", "dense"]:
        """Which computation a call of `m` input rows takes: our decode kernel (`own`), our int4 x int8 GEMM (its
        bits, any M) or the weights expanded once and torch's dense bf16 GEMM (DENSE_ROWS, AMX_ROWS)."""
        if m <= DENSE_ROWS:
            return "kernel"
        if self.activations == "int8":
            return "dense" if m > AMX_ROWS and not self.invariant and cpu_kernels.amx() else "gemm"
        return "kernel" if self.invariant else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        path = self.path(x2.shape[0])
        if path == "dense":  # the weights expanded once, a dense GEMM
            if self.activations == "int8":  # on the rows as the kernel rounds them
                x2 = self.lib.int8_rows(x2)
            y = F.linear(x2, self.dequantized(), self.bias)
        else:
            op = self.own if path == "kernel" else self.lib.int4_gemm_q8
            y = op(x2, self.weight, self.scale, self.offset, self.scale_mult, self.offset_mult, self.bias,
                   self.out_features)  # (M, N)
        return y.view(*shape[:-1], self.out_features)


class TorchInt4Linear(Int4Linear):
    """Int4Linear on torch's int4 weight-only kernel: `_weight_int4pack_mm_for_cpu` on the CPU,
    `_weight_int4pack_mm` (tinygemm) on CUDA; 5-8 bit codes as two planes with the input repeated per plane."""

    def __init__(self, w: GroupedInts, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 ours: bool = True, activations: Activations = "int8") -> None:
        pad, planes, scales, offsets = self._setup(w, bias, device, dtype, activations)
        self.padded = pad > 0
        self.weight = _pack(planes, device)  # packed for torch's kernel
        # torch's kernels dequantize (code - 8) * scale + zero: zero = offset + 8 * scale
        self.scale_zeros = torch.stack([scales, offsets + 8 * scales], dim=-1).transpose(0, 1) \
            .contiguous().to(device, dtype)  # (P*G, N, 2)
        self.kernel = torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu" \
            else torch.ops.aten._weight_int4pack_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.planes > 1:
            x2 = x2.repeat(1, self.planes)  # (M, P*K): one input copy per plane
        y = self.kernel(x2.contiguous(), self.weight, self.group, self.scale_zeros)  # (M, N padded)
        if self.padded:
            y = y[:, :self.out_features].contiguous()  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def _pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """4-bit codes (N, K) uint8 -> the int4 kernel's packed weight on `device`."""
    if device.type == "cpu":
        return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(part.to(torch.int32), 1)
                          for part in codes.split(_ROW_CHUNK)])  # (N, K / 2) uint8, 64-row blocks
    pairs, inner = tinygemm_pairs(codes)
    return torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), inner)


def tinygemm_pairs(codes: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The CUDA kernel's input, made on the host: 4-bit codes (N, K) -> bytes (N, K / 2) holding two codes each,
    the even-indexed one in the high nibble (gpt-fast's and torchao's convention), and its inner K tiles."""
    k = codes.shape[1]
    inner = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    return (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), inner


class Int8Linear(nn.Module):
    """y = x @ (q * s).T + b with int8 codes q (N, K) and one scale per row s (N,), w ≈ q * s.

    On the CPU kernel where its precondition holds (`int8_unsupported`); otherwise the same maths as a dense
    matmul of the codes, so an odd-sized layer is slower, never wrong or a crash.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.weight = codes.to(device)  # (N, K) int8
        self.scale = scale.to(device, dtype)  # (N,)
        self.bias = None if bias is None else bias.to(device, dtype)
        self.fused = int8_unsupported(self.in_features, device) is None

    @classmethod
    def rtn(cls, w: torch.Tensor, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> "Int8Linear":
        """Round-to-nearest per output row (`rtn_int8`)."""
        codes, scale = rtn_int8(w)
        return cls(codes, scale, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.fused and x2.dtype in (torch.bfloat16, torch.float16, torch.float32):
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scale)  # (M, N)
        else:
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def rtn_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest per output row, as gpt-fast's `WeightOnlyInt8Linear` (pytorch-labs/gpt-fast, quantize.py):
    w (N, K) -> codes (N, K) int8 in [-127, 127] and scales (N,) with w ≈ codes * scale, the scale max|w| / 127
    rounded to an fp16 (our kernel then reads 2 bytes of it a group)."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(2**-24).half().float()  # (N,)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear around existing tensors (shared, not copied): weight (N, K), bias (N,) or None."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def stored_linear(w: GroupedInts, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                  activations: Activations = "int8") -> nn.Module:
    """The fastest exact-where-possible module for a quantized weight on `device` in `dtype`:

    the int4 kernel where it takes the weight (exact: 4-bit codes as stored, 5-8 bit codes as two planes); else
    int8 per row re-quantized from the weight's values (not exact: Q6_K's 16-weight groups, which no int4 group
    size holds), see `int8_linear`; else (no int8 kernel on the device) the dequantized weight, dense. In fp32 on
    the CPU the weight is dense: fp32 holds every stored weight exactly, and torch's fp32 int4 kernel is a scalar
    loop (the int4 kernels pay in bf16).
    """
    if (device.type, dtype) == ("cpu", torch.float32):
        return dense_linear(w.dequantize().to(device), None if bias is None else bias.to(device, dtype))
    if int4_unsupported(w, device, dtype) is None:
        return Int4Linear(w, bias, device, dtype, activations=activations)
    dense = w.dequantize()  # (N, K) fp32
    if device.type == "cpu":
        return int8_linear(dense, bias, device, dtype, activations)
    return dense_linear(dense.to(device, dtype), None if bias is None else bias.to(device, dtype))


def int8_linear(w: torch.Tensor, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                activations: Activations = "int8") -> nn.Module:
    """w (N, K) round to nearest per row on int8 (Int8Linear.rtn's codes and scales). Where our AVX512 kernel
    runs (bf16 on such a CPU, K a multiple of 32), the same codes go to it as two 4-bit planes with the row's
    scale in every group: the same maths, about twice as fast as `_weight_int8pack_mm` (docs/benchmarks.md)."""
    n, k = w.shape
    if (device.type, dtype) == ("cpu", torch.bfloat16) and k % cpu_kernels.GROUP == 0 and cpu_kernels.kernel() is not None:
        q, scale = rtn_int8(w)
        codes = (q.to(torch.int16) + 128).to(torch.uint8)  # (N, K), 1..255
        per_group = scale[:, None].expand(n, k // cpu_kernels.GROUP).contiguous()  # (N, G)
        return Int4Linear(GroupedInts(codes, per_group, -128 * per_group, bits=8, group=cpu_kernels.GROUP,
                                      source="rtn8"), bias, device, dtype, activations=activations)
    return Int8Linear.rtn(w, bias, device, dtype)
