"""Int8 weight-only quantization of a draft runner's linear layers (lossless: the target still verifies).

Per output channel, w ≈ q * s with q int8 in [-127, 127] and s = max|w| / 127, as in gpt-fast's
`WeightOnlyInt8Linear` (pytorch-labs/gpt-fast, quantize.py). Decoding is memory-bound, so halving
the bytes of a bf16 draft makes each draft forward about 2-3x faster on this CPU (docs/benchmarks.md).
Only the draft is quantized: every emitted token is still the target's, so the output is unchanged
and only the acceptance rate can move. The target's modules are never modified (a self-speculative
draft shares them): the runner's references are swapped for new modules.
"""

from __future__ import annotations

import torch
from torch import nn

from actors.model.layers import DenseMLP

FUSED_IN_MULTIPLE = 32  # the input sizes the fused int8 kernel handles (see Int8Linear)


class Int8Linear(nn.Module):
    """y = x @ (q * s).T + b with int8 weights q (out, in) and per-row scales s (out,)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (out,)
        self.weight = torch.round(w / scale[:, None]).to(torch.int8)  # (out, in)
        self.scale = scale.to(linear.weight.dtype)  # (out,)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # aten._weight_int8pack_mm (a CPU and MPS kernel) reads the input in blocks without checking its width: on
        # an input size that is not a multiple of its block it returns garbage or crashes the process (seen at 72,
        # 40, 24, 8 on AVX-512; 16 is its block there, 32 covers the wider ones). Other widths take the plain path.
        self.fused = w.shape[1] % FUSED_IN_MULTIPLE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, in)
        if self.fused and x2.dtype == torch.bfloat16 and x2.device.type == "cpu" and x2.is_contiguous():
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scale)  # (N, out)
        else:
            y = (x2 @ self.weight.to(x2.dtype).t()) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


def quantize_runner_int8(runner) -> None:
    """Swap every dense linear of `runner` (attention, MLP, LM head) for an Int8Linear copy.

    MoE experts keep their weights (their fused 3D tensors are not linears); routing is unchanged.
    """
    for layer in runner.layers:
        a = layer.attn
        a.q_proj, a.k_proj, a.v_proj, a.o_proj = (Int8Linear(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        if isinstance(layer.ffn, DenseMLP):
            f = layer.ffn
            f.gate_proj, f.up_proj, f.down_proj = (Int8Linear(m) for m in (f.gate_proj, f.up_proj, f.down_proj))
    if runner.lm_head is not None:
        runner.lm_head = Int8Linear(runner.lm_head)
