"""Int8 draft linears at input sizes the fused CPU kernel cannot take (issue 24: a draft of hidden size 72 crashed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.model.quant import FUSED_IN_MULTIPLE, Int8Linear


@pytest.mark.parametrize("width", [8, 24, 40, 64, 72, 100, 128])
@pytest.mark.parametrize("rows", [1, 3])
def test_an_int8_linear_of_any_input_size_gives_its_dequantized_product(width: int, rows: int) -> None:
    """Before the guard, widths that are not a multiple of the kernel's block gave garbage (inf at 72) or a
    segmentation fault; now they take the plain path and every width matches x @ (q * s).T in bf16."""
    torch.manual_seed(width * 10 + rows)
    linear = nn.Linear(width, 41).to(torch.bfloat16)  # 41 outputs: an odd output size too
    q = Int8Linear(linear)
    assert q.fused == (width % FUSED_IN_MULTIPLE == 0)
    x = torch.randn(2, rows, width, dtype=torch.bfloat16)  # (batch, rows, in)
    y = q(x)  # (batch, rows, out)
    ref = x.float() @ (q.weight.float() * q.scale.float()[:, None]).t() + linear.bias.float()  # (batch, rows, out)
    assert y.shape == (2, rows, 41)
    assert torch.allclose(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
