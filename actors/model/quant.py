"""Weight-only quantization at load, round to nearest (RTN), as gpt-fast does (pytorch-labs/gpt-fast, quantize.py).

- int8: per output row, w ≈ q * s with q in [-127, 127] and s = max|w| / 127 (actors/model/qlinear.py Int8Linear).
- int4: per group of `group` weights of a row, asymmetric: w ≈ s * q + lo with q in [0, 15], s = (max - min) / 15
  and lo = the group's min (both rounded to fp16); computed on the int4 kernel (qlinear.Int4Linear), or where its
  shape preconditions fail on int8.
Decoding is memory-bound, so fewer bytes per weight make each forward faster (docs/benchmarks.md). For a draft
this is lossless: every emitted token is still the target's, only the acceptance rate can move. A target
quantized at load computes a different model than its checkpoint (`engine.model.weights: int8 | int4`).
"""

from __future__ import annotations

from typing import Literal

import torch

from actors.model.gguf_blocks import GroupedInts

INT4_GROUP = 32
QuantMode = Literal["int8", "int4"]  # the weight modes (actors/model/weights.py WeightMode) quantized at load

def rtn_int4(w: torch.Tensor, group: int = INT4_GROUP) -> GroupedInts:
    """Round-to-nearest 4-bit codes of w (N, K) per group of `group` weights (a group of K where K is not a
    multiple of `group`, so every width quantizes; the int4 kernel then decides whether it can take it)."""
    n, k = w.shape
    group = group if k % group == 0 else k
    g = w.detach().float().view(n, k // group, group)  # (N, G, group)
    # the scale and the minimum as fp16 values (the codes are rounded against them): our CPU kernel then reads 2
    # bytes for each instead of 4 (cpu_kernels.pack)
    lo = _half(g.amin(-1))  # (N, G)
    scale = _half(((g.amax(-1) - lo) / 15).clamp_min(2**-24))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return GroupedInts(codes, scale, lo, bits=4, group=group, source="rtn")


def _half(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest fp16 (kept in fp32)."""
    return t.to(torch.float16).float()


def quantize_runner(runner, mode: QuantMode) -> None:
    """Compute `runner`'s dense linear maps (attention, MLP, LM head) quantized at load in `mode` ("int8" /
    "int4") from now on. The target's own modules are never modified (a self-speculative draft shares them): the
    runner gets new ones. MoE experts keep their dense weights; routing is unchanged."""
    runner.use_weights(mode)
